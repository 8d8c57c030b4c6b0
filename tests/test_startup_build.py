"""A model directory with weights and no graphs is built when the server loads it, and then served."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from model.files import CONFIG_FILE
from server.edge.config import EnginesConfig, ModelsConfig, ServerConfig
from server.edge.loading import StartupError, graphs_served, load_model


def config_for(model_dir: Path, variant: str = "fp32") -> ServerConfig:
    return ServerConfig(
        models=ModelsConfig(model_dirs=(model_dir,)),
        engines=EnginesConfig(variant=variant, provider="cpu", max_slots=4, threads=1),
    )


def weights_only(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model without graphs (the session's copy may hold some other tests exported)."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir, ignore=shutil.ignore_patterns("onnx"))
    assert not (model_dir / "onnx").exists()
    return model_dir


def test_missing_graphs_are_built_at_load_and_logged(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = weights_only(tiny_model_dir, tmp_path)
    with caplog.at_level(logging.INFO, logger="server.edge.loading"):
        loaded = load_model(config_for(model_dir), model_dir)
    assert loaded.description.variant == "fp32"
    assert loaded.description.available_variants == ["fp32"]  # what --variant fp32 serves, nothing more
    assert "built the graphs of" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="server.edge.loading"):
        load_model(config_for(model_dir), model_dir)  # built once: the next start finds them
    assert "building" not in caplog.text


def test_graphs_of_an_older_export_format_are_built_again_at_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A checkout that kept its graphs across a change of the model-directory format starts on rebuilt graphs
    (the README's first command), not on a refusal naming the export command."""
    model_dir = weights_only(tiny_model_dir, tmp_path)
    load_model(config_for(model_dir), model_dir)
    metadata = model_dir / "onnx" / "fp32" / "metadata.json"
    metadata.write_text(json.dumps(json.loads(metadata.read_text()) | {"format_version": 1}))
    loaded = load_model(config_for(model_dir), model_dir)
    assert loaded.description.variant == "fp32"
    assert json.loads(metadata.read_text())["format_version"] != 1


def test_a_build_that_fails_stops_the_start_with_its_reason(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = weights_only(tiny_model_dir, tmp_path)
    cfg = json.loads((model_dir / CONFIG_FILE).read_text())
    (model_dir / CONFIG_FILE).write_text(json.dumps(cfg | {"vocab_size": cfg["vocab_size"] + 3}))
    with pytest.raises(StartupError, match=r"building the graphs of .* failed: export: error: .*tokenizer"):
        load_model(config_for(model_dir), model_dir)


def gate_record(model_dir: Path, provider: str, variant: str) -> None:
    """A variants.json recording `variant` as having passed `provider`'s gate."""
    record = {provider: {"variants": {"fp32": {"passed": True}, variant: {"passed": True}}}}
    (model_dir / "variants.json").write_text(json.dumps(record))


def test_a_first_start_on_cpu_builds_what_the_cpu_serves_and_no_fp16(tiny_model_dir: Path, tmp_path: Path) -> None:
    """auto on CPU serves int8 where its gate passed, else fp32: the build writes those, never the fp16 graphs
    only CUDA serves. Broken before: every variant was built, fp16 too (the shipped model's cost 128 MB)."""
    model_dir = weights_only(tiny_model_dir, tmp_path)
    gate_record(model_dir, "cpu", "int8")
    load_model(config_for(model_dir, variant="auto"), model_dir)
    assert sorted(p.name for p in (model_dir / "onnx").iterdir()) == ["fp32", "int8"]


def test_the_graphs_a_start_serves_follow_the_variant_the_provider_and_its_gate(tmp_path: Path) -> None:
    assert graphs_served(tmp_path, "auto", "cpu") == graphs_served(tmp_path, "auto", "cuda") == ["fp32"]  # no gate
    assert graphs_served(tmp_path, "fp16", "cpu") == ["fp16"]  # asked for: built alone, wherever it runs
    assert graphs_served(tmp_path, "int8", "cpu") == ["int8"]
    assert graphs_served(tmp_path, "fp32", "cuda") == ["fp32"]
    gate_record(tmp_path, "cuda", "fp16")
    assert graphs_served(tmp_path, "auto", "cuda") == ["fp32", "fp16"]
    assert graphs_served(tmp_path, "auto", "cpu") == ["fp32"]  # the CUDA gate says nothing of int8 on a CPU
    gate_record(tmp_path, "cpu", "int8")
    assert graphs_served(tmp_path, "auto", "cpu") == ["fp32", "int8"]
    shipped = Path(__file__).resolve().parents[1] / "model" / "shipped"
    assert graphs_served(shipped, "auto", "cpu") == ["fp32", "int8"]
    assert graphs_served(shipped, "auto", "cuda") == ["fp32", "fp16"]
