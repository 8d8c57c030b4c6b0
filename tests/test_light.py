"""The light loop (`python -m pytest -m light`: tests/conftest.py LIGHT_MODULES) runs where torch is not
installed: it collects with `import torch` failing, and no light test, nor a helper or fixture it uses, imports
torch or a module that imports it, at the top of a file or inside a function."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from tests.conftest import LIGHT, LIGHT_MODULES
from tests.no_torch import ROOT, run_without_torch

PACKAGES = ("model", "export", "server", "bench", "tests")


@cache
def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(path: Path, nested: bool) -> set[str]:
    """Modules `path` imports, with their parent packages: at import time only, or also inside functions."""
    names: set[str] = set()
    pending: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        if nested or not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            pending.extend(ast.iter_child_nodes(node))
    return {".".join(name.split(".")[:i]) for name in names for i in range(1, name.count(".") + 2)}


@cache
def needs_torch(module: str) -> bool:
    """Importing `module` imports torch: it is torch, or imports one that needs it when it is imported."""
    if module == "torch" or module.startswith("torch."):
        return True
    path = project_modules().get(module)
    return path is not None and any(needs_torch(name) for name in imported(path, nested=False) - {module})


def used_by(module: str) -> set[str]:
    """Every module a test module imports anywhere, through the test helpers it uses (tests.*) transitively."""
    seen, pending, used = set(), [module], set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        found = imported(project_modules()[name], nested=True)
        used |= found
        pending.extend(n for n in found if n.startswith("tests.") and n in project_modules())
    return used


def test_no_light_test_imports_torch() -> None:
    light = ["tests.conftest", *(f"tests.{Path(name).stem}" for name in sorted(LIGHT_MODULES))]
    offenders = {module: sorted(n for n in used_by(module) if needs_torch(n)) for module in light}
    assert {module: names for module, names in offenders.items() if names} == {}


def test_the_check_sees_torch_behind_a_helper_and_inside_a_function(tmp_path: Path) -> None:
    """The check above would pass on any module if it found nothing."""
    assert needs_torch("tests.tiny_torch") and needs_torch("model.training.artifact")
    assert not needs_torch("tests.tiny") and not needs_torch("server.edge.servicer")
    assert "tests.tiny_torch" in used_by("tests.test_tiny")  # imported inside the test function


def test_the_light_loop_collects_without_torch() -> None:
    code = f"import pytest; sys.exit(pytest.main(['-m', {LIGHT!r}, '--collect-only', '-q', '-p', 'no:cacheprovider']))"
    result = run_without_torch(code)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = {line.split("::")[0].removeprefix("tests/") for line in result.stdout.splitlines() if "::" in line}
    assert collected == LIGHT_MODULES
