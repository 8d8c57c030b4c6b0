"""Layers import downward only: the model-directory contract at the bottom, export/ never above server/, the
decoding core free of grpc, onnxruntime, prometheus and text processing. Checked on every import statement,
nested ones too."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from tests.no_torch import run_without_torch

ROOT = Path(__file__).resolve().parents[1]

# model/'s training code (torch): the model-directory contract below it never imports it
TRAINING = "model.training"

# the transport, the runtime and the export: what neither the decoding core nor text processing imports
RUNTIME = ("export", "grpc", "grpc_health", "grpc_reflection", "onnxruntime", "prometheus_client", "torch")

# package (a folder or a module path under ROOT) -> top-level names it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "model": ("server", "export", "bench", "grpc", "onnxruntime", "prometheus_client"),
    # the model-directory contract and languages: torch-free, apart from training
    "model/directory.py": ("torch", "onnxruntime", "server", "export", TRAINING),
    "model/files.py": ("torch", TRAINING),
    "model/data.py": ("torch", TRAINING),  # the held-out sets' TSV, read by server.gates and bench
    "model/config.py": ("torch", TRAINING),
    "model/languages.py": ("torch", TRAINING),
    "model/directions.py": ("torch", TRAINING),
    "model/tokenizer.py": ("torch", TRAINING),
    "model/marian_tokenizer.py": ("torch", TRAINING),
    "model/m2m_tokenizer.py": ("torch", TRAINING),
    "export": ("server", "bench", "grpc", "prometheus_client"),
    # export/importers/files.py alone imports torch, and only to read a pytorch_model.bin
    # (test_no_torch_to_build_or_serve)
    "export/hf.py": ("torch",),
    "export/importers/registry.py": ("torch",),
    "export/importers/marian.py": ("torch",),
    "export/importers/m2m_100.py": ("torch",),
    "export/builder": ("torch",),
    "export/__main__.py": ("torch",),
    "export/quantize.py": ("torch",),
    "export/kv_ops.py": ("torch",),
    # the server fetches and builds hub models through export/ (one layer down), never bench/ or torch
    "server": ("bench", "torch"),
    "server/core": (
        *RUNTIME,
        "server.text",
        "server.edge",
        "server.backend",
        "server.processes",
        "server.client",
    ),
    # text processing before and after decoding (markup, splitting, documents): above the decoding core, which
    # never imports it, and as free of the transport and the runtime
    "server/text": (
        *RUNTIME,
        "server.edge",
        "server.backend",
        "server.processes",
        "server.client",
    ),
    # the onnxruntime runners: below the engine processes that open them, never reaching up into them
    "server/backend": (
        "export",
        "grpc",
        "prometheus_client",
        "torch",
        "server.text",
        "server.processes",
        "server.edge",
        "server.client",
    ),
    # engine processes and their links: above the runners, whose modules alone load onnxruntime, and below the
    # edge, as free of the transport and the metrics
    "server/processes": (
        "export",
        "grpc",
        "onnxruntime",
        "prometheus_client",
        "torch",
        "server.text",
        "server.edge",
        "server.client",
    ),
    "server/edge": ("torch", "server.client.cli"),  # the health check dials in as clients do: client.channels
    "server/client": (
        "torch",
        "onnxruntime",
        "prometheus_client",
        "server.core",
        "server.backend",
        "server.processes",
        "server.edge",
    ),
}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def files_of(package: str) -> list[Path]:
    path = ROOT / package
    return [path] if path.is_file() else sorted(p for p in path.rglob("*.py") if "proto" not in p.parts)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layers_import_downward_only(package: str) -> None:
    files = files_of(package)
    assert files, f"{package} has no Python files"
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(imported_modules(path))
        if any(name == banned or name.startswith(f"{banned}.") for banned in FORBIDDEN[package])
    ]
    assert not violations, "\n".join(violations)


def test_no_torch_to_build_or_serve(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Building graphs (python -m export), importing a safetensors Marian, the contract and the server all run
    where torch cannot be imported; the server's modules load without it."""
    from tests.marian_tiny import build_marian_dir

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    hf_dir = build_marian_dir(tmp_path / "hf")
    code = f"""
import export.__main__, export.hf, model.directory, server.edge.main, server.backend.runtime
import server.backend.working_batch, server.processes.engine_process
assert export.__main__.main(["--model-dir", {str(model_dir)!r}, "--variants", "fp32,int8,fp16"]) == 0
assert export.hf.main(["--model", {str(hf_dir)!r}, "--out", {str(tmp_path / "marian")!r}]) == 0
assert export.__main__.main(["--model-dir", {str(tmp_path / "marian")!r}, "--variants", "fp32"]) == 0
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
"""
    result = run_without_torch(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (model_dir / "onnx" / "fp16" / "decoder_step.onnx").is_file()
    assert (tmp_path / "marian" / "onnx" / "fp32" / "decoder_step.onnx").is_file()


def test_a_pickled_checkpoint_without_torch_names_the_extra(tmp_path: Path) -> None:
    from tests.marian_tiny import build_marian_dir

    hf_dir = build_marian_dir(tmp_path / "hf")
    (hf_dir / "model.safetensors").rename(hf_dir / "pytorch_model.bin")
    code = f"""
import export.hf
sys.exit(export.hf.main(["--model", {str(hf_dir)!r}, "--out", {str(tmp_path / "out")!r}]))
"""
    result = run_without_torch(code)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'translate-service[train]'" in lines[0], result.stderr


def test_the_check_sees_nested_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from server.edge import main\n    import onnxruntime as ort\n")
    assert imported_modules(module) == {"server.edge", "onnxruntime"}
