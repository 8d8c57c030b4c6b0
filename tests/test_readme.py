"""The README's first two commands are the ones a fresh machine runs, and CI runs the second verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The commands of the README's first shell block, comments dropped."""
    block = re.search(r"```(?:bash|sh)\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md must start with a shell block holding the install/serve and test commands"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_starts_with_serve_and_test_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert "translate-server" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci
