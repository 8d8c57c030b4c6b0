"""A configuration mistake ends `translate-server` before it serves: exit status 2 and one true line on stderr,
naming what is wrong (no usage dump, no traceback, no gRPC log line before it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.serving import ROOT


@contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port another program listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def start(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "server.edge.main", "--host", "127.0.0.1", "--metrics-port", "-1", *flags]
    environ = {**os.environ, **(env or {})}
    return subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120, check=False)


def mistakes(tmp_path: Path) -> dict[str, tuple[list[str], dict[str, str], str]]:
    """Each mistake: its flags, its environment, and what its one line says."""
    (tmp_path / "a-file").write_text("not a model\n")
    (tmp_path / "empty").mkdir()
    missing, a_file, empty = tmp_path / "missing", tmp_path / "a-file", tmp_path / "empty"
    no_model = "holds no model: no exported graphs (onnx/<variant>/) and no config.json or model.safetensors to build"
    return {
        "missing model dir": (["--model-dir", str(missing)], {}, f"model directory {missing} does not exist"),
        "model dir is a file": (["--model-dir", str(a_file)], {}, f"model directory {a_file} is a file, not a dir"),
        "models dir is a file": (["--models-dir", str(a_file)], {}, f"models directory {a_file} is a file, not a"),
        "empty model dir": (["--model-dir", str(empty)], {}, f"model directory {empty} {no_model}"),
        "bad variable": ([], {"TRANSLATE_PORT": "http"}, "TRANSLATE_PORT='http'"),
        "bad value": (["--max-slots", "-1"], {}, "max_slots must be >= 0"),
        "bad flag": (["--provider", "tpu"], {}, "argument --provider: invalid choice: 'tpu'"),
    }


@pytest.mark.parametrize(
    "case",
    ["missing model dir", "model dir is a file", "models dir is a file", "empty model dir", "bad variable",
     "bad value", "bad flag"],
)  # fmt: skip
def test_a_configuration_mistake_exits_2_with_one_line_naming_it(tmp_path: Path, case: str) -> None:
    """Broken before: a file named by --model-dir "did not exist", a missing or empty directory exited 1 after
    the start's log lines, an empty one's line named an exception class and an export that cannot help, a bad
    variable exited 1, a bad flag printed forty flags of usage."""
    flags, env, says = mistakes(tmp_path)[case]
    done = start("--port", "0", *flags, env=env)
    assert (done.returncode, len(done.stderr.splitlines())) == (2, 1), done.stderr
    assert done.stderr.startswith("translate-server: ") and says in done.stderr, done.stderr
    assert "Error:" not in done.stderr and "python -m export" not in done.stderr  # no exception class, no advice


def test_a_taken_port_exits_2_naming_the_port_without_grpcs_own_line() -> None:
    """Broken before: gRPC's own error line came first, then ours, and the exit status was 1."""
    with taken_port() as port:
        done = start("--port", str(port))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"translate-server: could not bind 127.0.0.1:{port}: the port is in use "
                                        "(another server?)"]  # fmt: skip
