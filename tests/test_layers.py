"""Layers import downward only: the model-directory contract at the bottom, export/ never above server/, the
decoding core free of grpc, onnxruntime and prometheus. Checked on every import statement, nested ones too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package (a folder or a module path under ROOT) -> top-level names it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "model": ("server", "export", "bench", "grpc", "onnxruntime", "prometheus_client"),
    "model/directory.py": ("torch", "onnxruntime", "server", "export"),
    "model/config.py": ("torch",),
    "model/tokenizer.py": ("torch",),
    "model/marian_tokenizer.py": ("torch",),
    "export": ("server", "bench", "grpc", "prometheus_client"),
    "server": ("export", "bench"),
    "server/core": (
        "grpc",
        "grpc_health",
        "grpc_reflection",
        "onnxruntime",
        "prometheus_client",
        "torch",
        "server.edge",
        "server.backend",
        "server.client",
    ),
    "server/backend": ("grpc", "prometheus_client", "torch", "server.edge", "server.client"),
    "server/edge": ("torch", "server.client.cli"),  # the health check dials in as clients do: client.channels
    "server/client": ("torch", "onnxruntime", "prometheus_client", "server.core", "server.backend", "server.edge"),
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


def test_the_check_sees_nested_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from server.edge import main\n    import onnxruntime as ort\n")
    assert imported_modules(module) == {"server.edge", "onnxruntime"}
