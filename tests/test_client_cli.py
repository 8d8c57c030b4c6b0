"""The `translate` command against a real server: stdin or arguments in, one translation per line out."""

from __future__ import annotations

import io
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.client import cli as client_cli
from server.client.cli import PROGRESS_MIN_TEXTS, InputError, build_parser, main, make_progress, read_texts, run
from server.edge.loading import LoadedModel
from server.proto.translation.v1 import translation_pb2 as pb
from tests.serving import RunningServer, fake_model, loopback, request, running_server, server_config
from tests.tiny import TINY_PAIRS

CLI = [sys.executable, "-m", "server.client.cli"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    from tests.tiny import build_tiny_tokenizer

    directory = tmp_path_factory.mktemp("cli_tokenizer")
    build_tiny_tokenizer(directory)
    return fake_model(directory)


@pytest.fixture(scope="module")
def served(model: LoadedModel) -> Iterator[RunningServer]:
    with running_server(model, server_config(serving=loopback(host="localhost"))) as running:
        yield running


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def cli(served: RunningServer, *args: str, texts: list[str] | None = None) -> tuple[int, str, str]:
    parsed = build_parser().parse_args(["--server", served.address, "--source", "de", "--target", "en", *args])
    out, err = io.StringIO(), io.StringIO()
    code = run(parsed, texts if texts is not None else read_texts(parsed, []), out, err)
    return code, out.getvalue(), err.getvalue()


def test_prints_one_translation_per_input_line_in_order_across_batches(served: RunningServer) -> None:
    texts = [de for de, _ in TINY_PAIRS] * 4 + ["", "Zwei Sätze. Noch einer."]
    code, out, err = cli(served, "--batch", "7", "--beam-size", "2", texts=texts)
    expected = [r.translation for r in served.stub.Translate(request(texts, beam_size=2)).results]
    assert code == 0 and err == ""
    assert out.split("\n")[:-1] == expected


def test_texts_from_arguments(served: RunningServer) -> None:
    code, out, _ = cli(served, "Das Haus ist groß.", "Geheimpolizei")
    expected = [r.translation for r in served.stub.Translate(request(["Das Haus ist groß.", "Geheimpolizei"])).results]
    assert code == 0 and out.splitlines() == expected


def test_stdin_lines_become_texts() -> None:
    args = build_parser().parse_args(["--source", "de", "--target", "en"])
    assert read_texts(args, [b"eins\n", b"\n", b"zwei\r\n", "groß".encode()]) == ["eins", "", "zwei", "groß"]


def test_input_that_is_not_utf8_names_its_line_or_is_replaced_when_asked() -> None:
    strict = build_parser().parse_args(["--source", "de", "--target", "en"])
    with pytest.raises(
        InputError, match=r"^stdin line 2 is not valid UTF-8 \(byte 0xe4 at byte 3\); .*--errors replace"
    ):
        read_texts(strict, [b"eins\n", b"gr\xe4\xdf\n"])  # Latin-1, not UTF-8
    replace = build_parser().parse_args(["--source", "de", "--target", "en", "--errors", "replace"])
    assert read_texts(replace, [b"gr\xe4\xdf\n", b"ok"]) == ["gr\ufffd\ufffd", "ok"]
    # An argument's bytes reach Python as lone surrogates (surrogateescape), which protobuf cannot encode.
    argument = "Haus \udcff".encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape")
    with pytest.raises(InputError, match=r"^argument 2 is not valid UTF-8 \(byte 0xff at byte 6\)"):
        read_texts(build_parser().parse_args(["--source", "de", "--target", "en", "gut", argument]), [])


@pytest.mark.parametrize("where", ["stdin", "argument"])
def test_the_command_refuses_input_that_is_not_utf8_with_one_line_and_status_2(where: str) -> None:
    """Refused before any connection: no server is needed, and nothing half-translated is printed."""
    command: list[str | bytes] = [*CLI, "--server", "localhost:1", "--source", "de", "--target", "en"]
    if where == "argument":
        command += [b"gut", b"gr\xe4\xdf"]
    done = subprocess.run(command, input=b"gut\ngr\xe4\xdf\n", capture_output=True, timeout=120, check=False)
    name = "stdin line 2" if where == "stdin" else "argument 2"
    assert (done.returncode, done.stdout) == (2, b"")
    assert done.stderr.decode() == (
        f"translate: {name} is not valid UTF-8 (byte 0xe4 at byte 3); "
        "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) or pass --errors replace\n"
    )


def test_errors_replace_translates_the_text_with_replacement_characters(served: RunningServer) -> None:
    args = ["--server", served.address, "--source", "de", "--target", "en", "--errors", "replace"]
    done = subprocess.run([*CLI, *args], input=b"Das Haus\ngr\xe4\xdf\n", capture_output=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    expected = served.stub.Translate(request(["Das Haus", "gr\ufffd\ufffd"])).results
    assert done.stdout.decode().splitlines() == [r.translation for r in expected]


def test_server_errors_exit_non_zero_with_status_and_message(served: RunningServer) -> None:
    parsed = build_parser().parse_args(["--server", served.address, "--source", "de", "--target", "fr", "Hallo"])
    out, err = io.StringIO(), io.StringIO()
    assert run(parsed, ["Hallo"], out, err) == 3  # INVALID_ARGUMENT's gRPC code
    assert err.getvalue().startswith("translate: INVALID_ARGUMENT: unsupported language pair 'de' -> 'fr'")
    assert out.getvalue() == ""


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--beam-size", "0", "must be >= 1, got 0"), ("--max-output-len", "-1", "must be >= 0, got -1"),
     ("--batch", "0", "must be >= 1, got 0"), ("--beam-size", "two", "invalid integer >= 1 value: 'two'"),
     ("--timeout", "0", "must be a number of seconds above 0, got 0"),
     ("--timeout", "-1", "must be a number of seconds above 0, got -1"),
     ("--timeout", "nan", "must be a number of seconds above 0, got nan")],
)  # fmt: skip
def test_out_of_range_counts_are_usage_errors_not_tracebacks(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--source", "de", "--target", "en", flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "dialled"),
    [("localhost", "localhost:50051"), ("10.0.0.7:7000", "10.0.0.7:7000"), ("[::1]", "[::1]:50051"),
     ("[::1]:7000", "[::1]:7000"), ("unix:/run/translate.sock", "unix:/run/translate.sock"),
     ("50051", "localhost:50051"), (":7000", "localhost:7000")],
)  # fmt: skip
def test_a_server_without_a_port_is_dialled_at_the_servers_port(given: str, dialled: str) -> None:
    """gRPC dials 443 for a target without a port: the command fills in translate-server's own. A port alone is
    this machine's (issue 64: `--server 50051` dialled the host "50051")."""
    assert build_parser().parse_args(["--source", "de", "--target", "en", "--server", given]).server == dialled


class ShortStub:
    """A server that closes the stream after the first text's result."""

    def __init__(self, channel: object) -> None:
        pass

    def TranslateStream(self, request: pb.TranslateRequest, **kwargs: object) -> Iterator[pb.TranslateStreamResponse]:
        yield pb.TranslateStreamResponse(result=pb.TextResult(index=0, translation="one"))


def test_a_stream_that_ends_short_exits_1_with_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_cli.pb_grpc, "TranslatorStub", ShortStub)
    parsed = build_parser().parse_args(["--server", "localhost:1", "--source", "de", "--target", "en"])
    out, err = io.StringIO(), io.StringIO()
    assert run(parsed, ["eins", "zwei"], out, err) == 1
    assert out.getvalue() == "one\n"  # what did arrive is printed
    assert err.getvalue() == "translate: the server answered 1 of 2 texts\n"


def test_unreachable_server_is_unavailable(tmp_path: Path) -> None:
    parsed = build_parser().parse_args(
        ["--server", "localhost:1", "--source", "de", "--target", "en", "--timeout", "5"]
    )
    err = io.StringIO()
    assert run(parsed, ["Hallo"], io.StringIO(), err) == 14  # UNAVAILABLE
    assert "UNAVAILABLE" in err.getvalue()


def test_progress_bar_only_on_a_terminal_with_many_texts() -> None:
    from tqdm import tqdm

    terminal = FakeTerminal()
    bar = make_progress(PROGRESS_MIN_TEXTS, terminal)
    assert isinstance(bar, tqdm)
    bar.update(PROGRESS_MIN_TEXTS)
    bar.close()
    assert f"{PROGRESS_MIN_TEXTS}/{PROGRESS_MIN_TEXTS}" in terminal.getvalue()
    assert not isinstance(make_progress(PROGRESS_MIN_TEXTS - 1, FakeTerminal()), tqdm)
    assert not isinstance(make_progress(10_000, io.StringIO()), tqdm)


def test_no_progress_bar_without_tqdm(served: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving install (`pip install .`) has no tqdm: large interactive input still translates, every
    line, and nothing but errors reaches the terminal."""
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` raise ImportError
    texts = ["Das Haus ist groß.", "Leidenschaft"] * (PROGRESS_MIN_TEXTS // 2 + 1)
    out, terminal = io.StringIO(), FakeTerminal()
    args = build_parser({}).parse_args(["--server", served.address, "--source", "de", "--target", "en"])
    assert run(args, texts, out, terminal) == 0
    expected = [r.translation for r in served.stub.Translate(request(texts[:2])).results]
    assert out.getvalue().splitlines() == expected * (len(texts) // 2)
    assert terminal.getvalue() == ""


def test_console_entry_point_reads_stdin(served: RunningServer) -> None:
    lines = ["Das Haus ist groß.", "Leidenschaft"]
    done = subprocess.run(
        [sys.executable, "-m", "server.client.cli", "--server", served.address, "--source", "de", "--target", "en"],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [r.translation for r in served.stub.Translate(request(lines)).results]


def test_auto_source_prints_each_texts_detected_language(served: RunningServer) -> None:
    texts = ["Ich habe heute leider keine Zeit.", "12345"]
    code, out, err = cli(served, "--source", "auto", "--show-detected", texts=texts)
    expected = [r.translation for r in served.stub.Translate(request(texts, "de")).results]
    assert (code, err) == (0, "")
    assert out.splitlines() == [f"de\t{expected[0]}", f"-\t{expected[1]}"]  # numbers: no language to tell


def test_a_missing_target_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--server", "localhost:1", "Hallo"])
    assert exited.value.code == 2


def test_a_reader_that_closes_the_output_ends_the_command_quietly_with_status_0(served: RunningServer) -> None:
    """`translate < file | head -1` (issue 64: a BrokenPipeError traceback). More output than a pipe holds, so the
    command is still writing when the reader goes."""
    lines = b"Das Haus ist gro\xc3\x9f und alt.\n" * 6000
    command = [*CLI, "--server", served.address, "--source", "de", "--target", "en"]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        assert child.stdin is not None and child.stdout is not None and child.stderr is not None
        child.stdin.write(lines)
        child.stdin.close()
        assert child.stdout.readline()  # `head -1`
        child.stdout.close()
        assert child.wait(timeout=120) == 0
        assert child.stderr.read() == b""


def test_ctrl_c_exits_130_with_one_line() -> None:
    """Issue 64: a KeyboardInterrupt traceback of 24 lines. The interrupt comes while the command waits on a server
    that accepts its connection and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(60)
        command = [*CLI, "--server", f"127.0.0.1:{listener.getsockname()[1]}", "--target", "en", "Hallo"]
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
            try:
                connection, _ = listener.accept()  # the command is in its call
                with connection:
                    child.send_signal(signal.SIGINT)
                    out, err = child.communicate(timeout=60)
            finally:
                child.kill()  # a command that ignored the interrupt fails the test instead of hanging it
    assert (child.returncode, out, err) == (130, "", "translate: interrupted\n")
