"""Shared fixtures: tiny random models built once per test session in a temp dir."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from model.artifact import SHIPPED_DIR, WEIGHTS_FILE


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny model artifact (config, fp32 safetensors, tokenizer)."""
    from tests.tiny import build_tiny_artifact

    return build_tiny_artifact(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_exported_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its fp32 and int8 ONNX exports under onnx/; tests copy it before changing it.

    int8 is made with the recipe that stays close on this CPU (8-bit with VNNI, 7-bit without).
    """
    from export.__main__ import main as export

    out = tmp_path_factory.mktemp("tiny_exported") / "model"
    shutil.copytree(tiny_model_dir, out)
    assert export(["--model-dir", str(out), "--variants", "fp32,int8", *int8_args_for_this_cpu()]) == 0
    return out


def int8_args_for_this_cpu() -> list[str]:
    """Export flags for the int8 recipe that stays close to fp32 on this CPU's int8 class."""
    from export.quantize import int8_flags_for
    from model.directory import int8_kernels

    per_channel, _ = int8_flags_for(int8_kernels())
    return ["--int8-7bit"] if per_channel else []


@pytest.fixture(scope="session")
def shipped_model_dir() -> Path:
    if not (SHIPPED_DIR / WEIGHTS_FILE).is_file():
        pytest.fail(f"the shipped model is missing from {SHIPPED_DIR}")
    return SHIPPED_DIR
