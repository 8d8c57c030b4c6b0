"""Token ids of ONNX greedy and beam-4 decoding equal the PyTorch reference (model/decode.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from export.__main__ import main
from export.parity import compare_decoding
from model.artifact import load_artifact
from server.runtime import OnnxRunner
from tests.tiny import TINY_PAIRS


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("parity") / "model"
    shutil.copytree(tiny_model_dir, out)
    assert main(["--model-dir", str(out), "--variants", "fp32"]) == 0
    return out


@pytest.mark.parametrize("beam_size", [1, 4])
def test_decoding_ids_identical(model_dir: Path, beam_size: int) -> None:
    from model.tokenizer import Tokenizer

    tok = Tokenizer(model_dir / "tokenizer.model")
    sources = [tok.encode_source(de, "en") for de, _ in TINY_PAIRS[:6]] + [
        tok.encode_source(en, "de") for _, en in TINY_PAIRS[:6]
    ]
    runner = OnnxRunner(model_dir / "onnx" / "fp32", max_slots=12, intra_op_threads=1)
    report = compare_decoding(load_artifact(model_dir), runner, sources, beam_size=beam_size, max_len=20)
    assert report.identical == report.total == len(sources)


@pytest.mark.shipped
def test_shipped_parity(shipped_model_dir: Path, tmp_path: Path) -> None:
    """The shipped weights, exported afresh (graphs are never committed), agree with PyTorch."""
    import shutil

    from export.__main__ import main as export_main
    from export.parity import main as parity_main

    model_dir = tmp_path / "shipped"
    shutil.copytree(shipped_model_dir, model_dir, ignore=shutil.ignore_patterns("onnx"))
    assert export_main(["--model-dir", str(model_dir), "--variants", "fp32"]) == 0
    assert parity_main(["--model-dir", str(model_dir), "--limit", "20"]) == 0
