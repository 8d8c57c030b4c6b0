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


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page (code blocks skipped; a repeated heading gets -1, -2...)."""
    found: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6} (.+)", line)):
            base = anchor = slug(heading.group(1))
            n = 0
            while anchor in found:
                n += 1
                anchor = f"{base}-{n}"
            found.add(anchor)
    return found


def anchored_links() -> list[tuple[str, Path, str]]:
    """(where, target page, anchor) for every markdown link with an anchor in the README and docs/, and every
    docs/X.md#anchor in the server's code."""
    links = []
    for page in (README, *sorted((ROOT / "docs").glob("*.md"))):
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            links.append((str(page.relative_to(ROOT)), page.parent / target if target else page, anchor))
    for source in sorted((ROOT / "server").rglob("*.py")):
        for target, anchor in re.findall(r"(docs/\w+\.md)#([\w-]+)", source.read_text()):
            links.append((str(source.relative_to(ROOT)), ROOT / target, anchor))
    return links


def test_every_anchor_a_link_names_is_a_heading_of_its_page() -> None:
    assert slug("The levers at opus-mt-de-en's shape on one H100") == "the-levers-at-opus-mt-de-ens-shape-on-one-h100"
    assert slug("`--max-queue` and deadlines") == "--max-queue-and-deadlines"
    links = anchored_links()
    assert any(where.startswith("server/") for where, _, _ in links) and len(links) > 10
    dead = [
        f"{where} -> {target.relative_to(ROOT)}#{anchor}"
        for where, target, anchor in links
        if not target.exists() or anchor not in anchors(target)
    ]
    assert not dead, f"links to headings that do not exist: {dead}"


def test_every_test_the_docs_name_exists() -> None:
    """docs/reliability.md and the other pages name the test behind each guarantee: each must still be there."""
    missing = []
    for page in (README, *sorted((ROOT / "docs").glob("*.md"))):
        for module, name in re.findall(r"(tests/\w+\.py)::(\w+)", page.read_text()):
            source = ROOT / module
            if not source.exists() or not re.search(rf"def {name}\(", source.read_text()):
                missing.append(f"{page.name}: {module}::{name}")
    assert not missing, missing
