"""A model directory with weights and no graphs is built when the server loads it, and then served."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from model.files import CONFIG_FILE
from server.edge.config import ServerConfig
from server.edge.loading import StartupError, load_model


def config_for(model_dir: Path) -> ServerConfig:
    return ServerConfig(model_dirs=(model_dir,), variant="fp32", provider="cpu", max_slots=4, threads=1)


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
    assert loaded.description.available_variants == ["fp32", "int8", "fp16"]
    assert "built the graphs of" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="server.edge.loading"):
        load_model(config_for(model_dir), model_dir)  # built once: the next start finds them
    assert "building" not in caplog.text


def test_a_build_that_fails_stops_the_start_with_its_reason(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = weights_only(tiny_model_dir, tmp_path)
    cfg = json.loads((model_dir / CONFIG_FILE).read_text())
    (model_dir / CONFIG_FILE).write_text(json.dumps(cfg | {"vocab_size": cfg["vocab_size"] + 3}))
    with pytest.raises(StartupError, match=r"building the graphs of .* failed: export: error: .*tokenizer"):
        load_model(config_for(model_dir), model_dir)
