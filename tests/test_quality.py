"""Lint, format and type checks run as tests, so CI and the README's test command enforce them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["model", "export", "server", "bench", "tests"]


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install -e '.[dev]')")
def test_ruff_lint_and_format_are_clean() -> None:
    lint = run("ruff", "check", *PACKAGES)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = run("ruff", "format", "--check", *PACKAGES)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy_is_clean() -> None:
    result = run(sys.executable, "-m", "mypy", *PACKAGES)
    assert result.returncode == 0, result.stdout + result.stderr
