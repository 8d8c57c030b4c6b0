"""The markup tests under every other `html.parser` this machine's Pythons carry.

The lexer (server/text/markup_lexer.py) reads markup with the standard library's `html.parser`, whose reading of
malformed markup changes in security releases (CPython's 2025 fixes read `</ b>` as a bogus comment, end a
script at `</script/>`, and buffer what `feed` cannot parse yet). The images run other interpreters than the
tests do (the CPU image python.org's latest 3.12, the CUDA image Ubuntu's), so the tests of tests/test_markup.py
and tests/test_markup_fidelity.py run again with each system Python's `html` package and `_markupbase` module in
front of the running one's: same minor version only, so that nothing but the parser changes. Debian's security
updates carry the 2025 parser
(`apt-get install libpython3.11-stdlib`, which .ci/run does).
"""

from __future__ import annotations

import filecmp
import html.parser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNING = Path(html.parser.__file__).resolve()
VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"
SYSTEM_LIBS = (Path("/usr/lib"), Path("/usr/local/lib"))
MARKUP_TESTS = ("tests/test_markup.py", "tests/test_markup_fidelity.py")  # the ones whose markup the parser reads


def other_stdlibs() -> list[Path]:
    """Standard libraries of this Python's minor version whose html.parser is not the running one's."""
    found = []
    for lib in SYSTEM_LIBS:
        stdlib = lib / VERSION
        parser = stdlib / "html" / "parser.py"
        readable = parser.is_file() and (stdlib / "_markupbase.py").is_file() and parser.resolve() != RUNNING
        if readable and not filecmp.cmp(parser, RUNNING, shallow=False):
            found.append(stdlib)
    return found


@pytest.mark.parametrize("stdlib", other_stdlibs() or [None], ids=str)
def test_the_markup_tests_hold_under_another_python_s_html_parser(stdlib: Path | None, tmp_path: Path) -> None:
    if stdlib is None:
        pytest.skip(f"no other {VERSION} html.parser on this machine (Debian: apt-get install libpython3.11-stdlib)")
    shadow = tmp_path / "stdlib"
    shutil.copytree(stdlib / "html", shadow / "html", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stdlib / "_markupbase.py", shadow / "_markupbase.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)])}
    probe = [sys.executable, "-c", "import html.parser, _markupbase; print(html.parser.__file__, _markupbase.__file__)"]
    loaded = subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout
    assert loaded.split() == [str(shadow / "html" / "parser.py"), str(shadow / "_markupbase.py")], loaded
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MARKUP_TESTS]
    done = subprocess.run(tests, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"under {stdlib}'s html.parser:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
