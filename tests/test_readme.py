"""The README's first two commands are the ones a fresh machine runs, CI runs the second verbatim, and the
rest stays a user's page: short, every server flag in its configuration table, every link alive."""

from __future__ import annotations

import re
from pathlib import Path

from server.edge.flags import build_parser, env_name

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme_commands() -> list[str]:
    """The commands of the README's first shell block, comments dropped."""
    block = re.search(r"```(?:bash|sh)\n(.*?)```", README.read_text(), re.S)
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


def test_readme_stays_short() -> None:
    assert len(README.read_text().splitlines()) <= 300, "depth goes to docs/"


def test_the_configuration_table_lists_every_server_flag_and_its_variable() -> None:
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `--")]
    table = "\n".join(rows)
    flags = [opt for action in build_parser({})._actions for opt in action.option_strings if opt.startswith("--")]
    missing = [flag for flag in flags if flag != "--help" and f"`{flag}`" not in table]
    assert not missing, f"README's configuration table lacks {missing}"
    # --no-X of a switch --X reads --X's variable
    negated = {flag for flag in flags if flag.startswith("--no-") and f"--{flag[5:]}" in flags}
    variables = {env_name(flag.removeprefix("--")) for flag in flags if flag != "--help" and flag not in negated}
    assert not [v for v in sorted(variables) if f"`{v}`" not in table]


def test_relative_links_in_the_readme_and_docs_point_at_files() -> None:
    for page in (README, *sorted((ROOT / "docs").glob("*.md"))):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"
