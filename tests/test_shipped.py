"""End to end on the shipped model: exported afresh, served over gRPC, equal to the offline ONNX decoder.

The shipped model is undertrained (see model/shipped/MODEL_CARD.md), so these tests check the served
path on real weights, not translation quality: the quality figures come from `python -m export.variants`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from model.artifact import TOKENIZER_FILE
from model.tokenizer import Tokenizer
from server.offline import translate_ids
from tests.serving import export_tiny_onnx, onnx_model, request, running_server

pytestmark = pytest.mark.shipped

CASES = [
    ("de", "en", ["Ich habe keine Zeit.", "Wo ist der Bahnhof?"]),
    ("en", "de", ["I don't have time.", "Where is the station?"]),
]


@pytest.fixture(scope="module")
def exported_shipped(shipped_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("shipped") / "model"
    shutil.copytree(shipped_model_dir, model_dir, ignore=shutil.ignore_patterns("onnx"))
    export_tiny_onnx(model_dir)
    return model_dir


@pytest.mark.parametrize(("source", "target", "texts"), CASES)
def test_served_translation_equals_offline_decoding(
    exported_shipped: Path, source: str, target: str, texts: list[str]
) -> None:
    model = onnx_model(exported_shipped, max_slots=16)
    tok = Tokenizer(exported_shipped / TOKENIZER_FILE)
    with running_server(model) as served:
        reply = served.stub.Translate(request(texts, source=source, target=target, beam_size=4))
    sources = [tok.encode_source(t, target) for t in texts]
    offline = translate_ids(model.runner, sources, 4, 1.0, None)  # the server's default output limit
    assert [r.translation for r in reply.results] == [tok.decode(list(h[0].tokens)) for h in offline]
    assert all(r.translation.strip() for r in reply.results)
