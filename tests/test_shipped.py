"""End to end on the shipped model: exported afresh, served over gRPC, equal to the offline ONNX decoder.

The shipped model is undertrained (see model/shipped/MODEL_CARD.md): these tests check the served path on
real weights and a quality floor on short held-out sentences that a broken export, a swapped language tag
or an untrained model falls far below. The quality figures come from `python -m server.gates.variants`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu

from model.data import read_tsv
from model.directory import VARIANTS_FILE, read_metadata
from model.files import TOKENIZER_FILE
from model.tokenizer import Tokenizer
from server.core.offline import translate_ids
from server.gates.variants import translate_pairs
from tests.serving import onnx_model, request, runner_of, running_server

pytestmark = pytest.mark.shipped

TEST_FILE = Path(__file__).resolve().parents[1] / "data" / "test.tsv"
# chrF on the 50 shortest held-out sentences: the shipped model scores 30.4 de->en and 28.1 en->de; its
# training checkpoints scored between 19.7 and 31.2, an untrained model under 10. The floor stays below the
# weakest of these: short sentences swing between models.
CHRF_FLOOR = 18.0

CASES = [
    ("de", "en", ["Ich habe keine Zeit.", "Wo ist der Bahnhof?"]),
    ("en", "de", ["I don't have time.", "Where is the station?"]),
]


@pytest.mark.parametrize(("source", "target", "texts"), CASES)
def test_served_translation_equals_offline_decoding(
    exported_shipped: Path, source: str, target: str, texts: list[str]
) -> None:
    model = onnx_model(exported_shipped, max_slots=16)
    tok = Tokenizer(exported_shipped / TOKENIZER_FILE)
    with running_server(model) as served:
        reply = served.stub.Translate(request(texts, source=source, target=target, beam_size=4))
    sources = [tok.encode_source(t, target) for t in texts]
    penalty = model.description.default_length_penalty[f"{source}-{target}"]  # decoding.json's, as served
    offline = translate_ids(runner_of(model), sources, 4, penalty, None)  # the server's default output limit
    assert [r.translation for r in reply.results] == [tok.decode(list(h[0].tokens)) for h in offline]
    assert all(r.translation.strip() for r in reply.results)


@pytest.mark.parametrize(("source", "target"), [("de", "en"), ("en", "de")])
def test_shipped_model_translates_short_held_out_sentences(exported_shipped: Path, source: str, target: str) -> None:
    model = onnx_model(exported_shipped, max_slots=64)
    tok = Tokenizer(exported_shipped / TOKENIZER_FILE)
    pairs = sorted(read_tsv(TEST_FILE), key=lambda p: (len(getattr(p, source)), getattr(p, source)))[:50]
    hypotheses = translate_pairs(runner_of(model), tok, pairs, (source, target), beam_size=4, length_penalty=1.0)
    chrf = sacrebleu.corpus_chrf(hypotheses, [[getattr(p, target) for p in pairs]]).score
    assert chrf >= CHRF_FLOOR, f"chrF {chrf:.1f} on 50 short test sentences {source}->{target}: {hypotheses[:5]}"


def test_every_committed_gate_record_names_the_recipe_a_fresh_export_writes(exported_shipped: Path) -> None:
    """model/shipped/variants.json holds the BLEU gate per provider (the CPU's here; a CUDA record needs
    `python -m server.gates.variants --provider cuda` on a GPU node): each record is trusted only for the recipe it
    measured, so every variant it gated must name exactly what `python -m export` writes today, else
    `--variant auto` would fall back to fp32 on that provider with a warning."""
    command = [sys.executable, "-m", "export", "--model-dir", str(exported_shipped), "--variants", "fp32,int8,fp16"]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    records = json.loads((exported_shipped / VARIANTS_FILE).read_text())
    assert "cpu" in records
    for provider, record in records.items():
        for variant, gated in record["variants"].items():
            written = read_metadata(exported_shipped / "onnx" / variant).recipe
            assert gated["recipe"] == written, (provider, variant)
