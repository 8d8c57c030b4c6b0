"""Exporter: graphs are valid, have no If node, carry metadata; bad input exits non-zero clearly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest

from export.__main__ import main
from model.artifact import CONFIG_FILE, WEIGHTS_FILE, weights_sha256
from server.metadata import MetadataError, available_variants, choose_variant, read_metadata


@pytest.fixture(scope="module")
def exported(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("export") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    assert main(["--model-dir", str(model_dir), "--variants", "fp32,int8,fp16"]) == 0
    return model_dir


def test_all_variants_exported_without_if(exported: Path) -> None:
    assert available_variants(exported) == ["fp32", "int8", "fp16"]
    for variant in ("fp32", "int8", "fp16"):
        for name in ("encoder.onnx", "decoder_step.onnx"):
            graph = onnx.load(str(exported / "onnx" / variant / name))
            assert "If" not in {n.op_type for n in graph.graph.node}


def test_metadata_records_source(exported: Path) -> None:
    meta = read_metadata(exported / "onnx" / "fp16")
    assert meta.variant == "fp16" and meta.dtype == "float16" and meta.opset == 18
    assert meta.source_sha256 == weights_sha256(exported)
    assert meta.tag_ids == {"en": 4, "de": 5}
    assert meta.spec().vocab_size == meta.model_config["vocab_size"]


def test_choose_variant_respects_bleu_gate(exported: Path) -> None:
    assert choose_variant(exported, "auto", "cpu") == "fp32"  # no variants.json: nothing passed
    (exported / "variants.json").write_text(json.dumps({"variants": {"int8": {"passed": True}}}))
    try:
        assert choose_variant(exported, "auto", "cpu") == "int8"
        assert choose_variant(exported, "auto", "cuda") == "fp32"
        assert choose_variant(exported, "fp16", "cpu") == "fp16"
    finally:
        (exported / "variants.json").unlink()


def test_mismatched_metadata_is_rejected(exported: Path, tmp_path: Path) -> None:
    bad = tmp_path / "fp32"
    shutil.copytree(exported / "onnx" / "fp32", bad)
    data = json.loads((bad / "metadata.json").read_text())
    data["n_heads"] += 1
    (bad / "metadata.json").write_text(json.dumps(data))
    with pytest.raises(MetadataError, match="disagrees"):
        read_metadata(bad)
    (bad / "encoder.onnx").unlink()
    with pytest.raises(MetadataError, match=r"missing encoder\.onnx"):
        read_metadata(bad)


def test_missing_weights_exit_nonzero(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    (tmp_path / "m" / WEIGHTS_FILE).unlink()
    assert main(["--model-dir", str(tmp_path / "m")]) == 2
    assert f"missing {WEIGHTS_FILE}" in capsys.readouterr().err


def test_mismatched_config_exit_nonzero(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / CONFIG_FILE).read_text())
    cfg["vocab_size"] += 3
    (tmp_path / "m" / CONFIG_FILE).write_text(json.dumps(cfg))
    assert main(["--model-dir", str(tmp_path / "m")]) == 2
    assert "does not match the tokenizer" in capsys.readouterr().err


def test_unsupported_opset_exit_nonzero(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model-dir", str(tiny_model_dir), "--opset", "9"]) == 2
    assert "unsupported opset 9" in capsys.readouterr().err


def test_bleu_gate_scores_and_times_every_variant(exported: Path) -> None:
    from export.variants import main as variants_main

    assert variants_main(["--model-dir", str(exported), "--limit", "3", "--beam-size", "2"]) == 0
    try:
        record = json.loads((exported / "variants.json").read_text())
    finally:
        (exported / "variants.json").unlink()
    variants = record["variants"]
    assert set(variants) == {"fp32", "int8", "fp16"} and variants["fp32"]["passed"] is True
    for scores in variants.values():
        assert scores["step_ms_1_rows"] > 0 and scores["step_ms_64_rows"] > 0
        within = all(scores[d] >= variants["fp32"][d] - record["gate_bleu"] for d in ("de-en", "en-de"))
        assert scores["passed"] == within
