"""`translate --glossary FILE` and `--glossary-id ID`: the file's entries reach the server with the request, and a
file the command cannot send exits 2 naming its line before anything is sent."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.client.cli import build_parser, run
from server.edge.config import ModelsConfig
from server.edge.loading import LoadedModel
from server.proto.translation.v1 import translation_pb2 as pb
from server.text.terms import Term
from tests.serving import RunningServer, fake_model, running_server, server_config
from tests.test_glossary_api import HandedOn

CLI = [sys.executable, "-m", "server.client.cli"]
UNREACHABLE = "localhost:1"  # nothing listens: a refusal before sending never notices


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    from tests.tiny import build_tiny_tokenizer

    directory = tmp_path_factory.mktemp("glossary_cli_tokenizer")
    build_tiny_tokenizer(directory)
    return fake_model(directory)


@pytest.fixture
def served(model: LoadedModel, tmp_path: Path) -> Iterator[RunningServer]:
    with running_server(model, server_config(models=ModelsConfig(cache_dir=tmp_path / "cache"))) as running:
        yield running


def cli(server: str, *args: str) -> tuple[int, str, str]:
    parsed = build_parser().parse_args(["--server", server, "--source", "de", "--target", "en", *args])
    out, err = io.StringIO(), io.StringIO()
    code = run(parsed, ["Das Haus ist groß."], out, err)
    return code, out.getvalue(), err.getvalue()


def test_the_files_entries_reach_the_server_with_the_request(served: RunningServer, tmp_path: Path) -> None:
    handed = HandedOn(served)
    glossary = tmp_path / "terms.tsv"
    glossary.write_bytes("\ufeff# product names\nHaus\thome\r\n\n  # indented comment\nBahnhof \t station\n".encode())
    code, out, err = cli(served.address, "--glossary", str(glossary))
    assert (code, err) == (0, "") and out.count("\n") == 1
    (call,) = handed.calls
    assert call.options.glossary == (Term("Haus", "home"), Term("Bahnhof", "station"))


def test_a_stored_glossary_by_id_and_a_file_together(served: RunningServer, tmp_path: Path) -> None:
    handed = HandedOn(served)
    stored = served.stub.CreateGlossary(
        pb.CreateGlossaryRequest(name="n", source_language="de", target_language="en", entries_text="Haus\thouse\n")
    )
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("Haus\thome\nHof\tyard\n")
    assert cli(served.address, "--glossary-id", stored.glossary_id)[0] == 0
    assert cli(served.address, "--glossary", str(glossary), "--glossary-id", stored.glossary_id)[0] == 0
    assert [call.options.glossary for call in handed.calls] == [
        (Term("Haus", "house"),),
        (Term("Haus", "home"), Term("Hof", "yard")),  # the file's entry wins over the stored one
    ]


def test_a_refused_term_is_the_servers_status_and_its_message(served: RunningServer, tmp_path: Path) -> None:
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("Haus\t" + "h" * 300 + "\n")
    code, out, err = cli(served.address, "--glossary", str(glossary))
    assert (code, out) == (3, "")
    assert (
        err == "translate: INVALID_ARGUMENT: options.glossary[0] target is 300 characters long, over the limit of 256\n"
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"Haus\thome\nBahnhof station\n",
            "line 2 has no tab; an entry is source<TAB>target, one tab between two terms",
        ),
        (b"Haus\thome\tmaison\n", "line 1 has 2 tabs; an entry is source<TAB>target, one tab between two terms"),
        (b"# terms\n\nHaus\t\n", "line 3 has no target term"),
        (b"Haus\thome\nGr\xf6\xdfe\tsize\n", "line 2 is not valid UTF-8 (byte 0xf6); convert the file to UTF-8"),
    ],
)
def test_a_bad_line_exits_2_naming_it_before_anything_is_sent(tmp_path: Path, content: bytes, message: str) -> None:
    glossary = tmp_path / "terms.tsv"
    glossary.write_bytes(content)
    assert cli(UNREACHABLE, "--glossary", str(glossary)) == (2, "", f"translate: --glossary {glossary} {message}\n")


def test_a_missing_file_exits_2_from_the_command_line(tmp_path: Path) -> None:
    missing = tmp_path / "none.tsv"
    args = ["--server", UNREACHABLE, "--source", "de", "--target", "en", "--glossary", str(missing), "Haus"]
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"translate: --glossary {missing}: No such file or directory\n"
