"""Shared fixtures: tiny random models built once per test session in a temp dir; the light loop's modules.

Nothing here imports torch: `python -m pytest -m light` runs where it is not installed (docs/testing.md)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from model.files import SHIPPED_DIR, WEIGHTS_FILE

# The light loop (`-m light`, docs/testing.md): the server's tests that need no torch, but for those that start
# the server as a process (marked `process`)
LIGHT_MODULES = frozenset({
    "test_bad_input.py", "test_beam.py", "test_config.py", "test_connections.py",
    "test_engine.py", "test_languages.py", "test_logs.py", "test_markup_serving.py", "test_metrics.py",
    "test_preparation.py", "test_process_reports.py", "test_scheduler.py", "test_servicer.py",
    "test_working_batch.py",
})  # fmt: skip
LIGHT = "light"  # the marker, and the mark expression that collects only LIGHT_MODULES


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`-m light` never imports the other test modules: they may need torch, and importing them is slow."""
    light_only = config.getoption("markexpr") == LIGHT
    if light_only and collection_path.name.startswith("test_") and collection_path.name not in LIGHT_MODULES:
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in LIGHT_MODULES and item.get_closest_marker("process") is None:
            item.add_marker(LIGHT)


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
    flags = ["--variants", "fp32,int8", "--capturable-fp32", *int8_args_for_this_cpu()]
    assert export(["--model-dir", str(out), *flags]) == 0
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


@pytest.fixture(scope="session")
def exported_shipped(shipped_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the shipped model with its fp32 graphs built fresh (the tree's onnx/ may be of another build)."""
    from tests.serving import export_tiny_onnx

    model_dir = tmp_path_factory.mktemp("shipped") / "model"
    shutil.copytree(shipped_model_dir, model_dir, ignore=shutil.ignore_patterns("onnx"))
    export_tiny_onnx(model_dir)
    return model_dir
