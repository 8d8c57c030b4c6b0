"""Structured logs (server/edge/logs.py): one access record per call, with the request id the client sees."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from server.edge.flags import parse_config
from server.edge.logs import ACCESS_LOGGER, JsonFormatter, TextFormatter, configure_logging, log_call, request_id
from server.proto.translation.v1 import translation_pb2 as pb
from tests.serving import (
    FAKE_DESCRIPTION,
    ROOT,
    RunningServer,
    fake_model,
    request,
    running_server,
    server_config,
    status_of,
)

TEXTS = ["Das Haus ist groß. Er wartete.", "Geheimpolizei"]
FIELDS = {
    "request_id", "method", "model", "pair", "status", "duration_ms", "texts", "sentences", "input_tokens",
    "output_tokens", "queue_wait_ms",
}  # fmt: skip


@pytest.fixture()
def served(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(fake_model(tiny_model_dir), server_config()) as running:
        yield running


def access_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    """Each access record as its JSON line reads."""
    records = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    return [json.loads(JsonFormatter().format(r)) for r in records]


def test_a_call_writes_one_json_access_record_with_the_clients_request_id_and_no_text(
    served: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    reply, call = served.stub.Translate.with_call(request(TEXTS), metadata=(("x-request-id", "client-42"),))
    assert ("x-request-id", "client-42") in call.trailing_metadata()
    (record,) = access_records(caplog)
    assert set(record) == FIELDS | {"time", "level", "logger", "pid", "message"}
    assert record["request_id"] == "client-42" and record["method"] == "Translate" and record["status"] == "OK"
    assert (record["model"], record["pair"], record["texts"]) == (FAKE_DESCRIPTION.name, "de-en", 2)
    assert record["sentences"] == sum(r.sentences for r in reply.results) == 3
    assert record["input_tokens"] == sum(r.input_tokens for r in reply.results)
    assert record["output_tokens"] == sum(r.output_tokens for r in reply.results)
    assert 0 <= float(record["queue_wait_ms"]) <= float(record["duration_ms"])  # type: ignore[arg-type]
    line = JsonFormatter().format(next(r for r in caplog.records if r.name == ACCESS_LOGGER))
    assert not any(word in line for word in ("Haus", "Geheimpolizei", *(r.translation for r in reply.results)))


def test_a_refused_call_gets_a_new_request_id_in_its_status_and_its_record(
    served: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    with pytest.raises(grpc.RpcError) as raised:
        served.stub.Translate(request(TEXTS, target="fr"), metadata=(("x-request-id", "not a plain id"),))
    error = raised.value
    assert isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    sent = dict(error.trailing_metadata() or ())["x-request-id"]
    assert len(sent) == 32 and sent != "not a plain id"  # replaced: it goes into logs
    (record,) = access_records(caplog)
    assert (record["request_id"], record["status"], record["sentences"]) == (sent, "INVALID_ARGUMENT", 0)
    assert record["detail"] == error.details()  # what the client was told: why, for the operator too
    assert str(record["detail"]).startswith("unsupported language pair 'de' -> 'fr'")
    served.stub.ListModels(pb.ListModelsRequest())
    assert [r["method"] for r in access_records(caplog)] == ["Translate", "ListModels"]


def test_request_ids_are_kept_when_plain_and_made_otherwise() -> None:
    assert request_id([("x-request-id", "4bf92f35-77b3.a")]) == "4bf92f35-77b3.a"
    for bad in ("", "x" * 129, "a b", "é"):
        assert request_id([("x-request-id", bad)]) != bad
    assert request_id(None) != request_id(None)


def test_log_format_json_writes_one_object_per_line_and_text_a_readable_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", "json")
        log_call({"request_id": "r1", "status": "OK", "sentences": 2})
        logging.getLogger("server.edge.main").info("serving %s", "shipped")
        configure_logging("INFO", "text")
        log_call({"request_id": "r2", "status": "OK"})
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    lines = capsys.readouterr().err.splitlines()
    access, plain = json.loads(lines[0]), json.loads(lines[1])
    assert (access["request_id"], access["sentences"], access["message"], access["logger"]) == (
        "r1",
        2,
        "call",
        ACCESS_LOGGER,
    )
    assert plain["message"] == "serving shipped" and plain["level"] == "INFO"
    assert lines[2].endswith("translation.access: request_id=r2 status=OK")


def test_a_text_record_is_one_line_whatever_its_strings_hold(capsys: pytest.CaptureFixture[str]) -> None:
    """A client's string with a line break, NUL or line separator in a text record is escaped, so it cannot start a
    forged line; a traceback stays readable, indented below its record. (Broken before: the detail below wrote a
    second line that read as the server's own ERROR.)"""
    forged = "pair de\n2026-11-29 06:00:00,000 ERROR forged: disk full\x00\u2028"
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", "text")
        log_call({"request_id": "r1", "status": "INVALID_ARGUMENT", "detail": forged})
        try:
            raise ValueError("line one\nline two")
        except ValueError:
            logging.getLogger("server.edge.errors").exception("Translate failed")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    lines = capsys.readouterr().err.split("\n")[:-1]
    records = [line for line in lines if not line.startswith(" ")]  # a record's own line starts at the margin
    assert len(records) == 2 and records[1].endswith("Translate failed")
    assert records[0].endswith("detail=pair de\\n2026-11-29 06:00:00,000 ERROR forged: disk full\\x00\\u2028")
    trace = lines[lines.index(records[1]) + 1 :]
    assert trace[0] == "    Traceback (most recent call last):" and trace[-2:] == [
        "    ValueError: line one",
        "    line two",
    ]


def test_a_secret_in_a_text_never_reaches_the_log(served: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    """A run with no space to split at (a key, a token) over the token limit is translated in parts between
    characters, and neither its answer's access record nor a refusal's names any of it. (Broken before: the run was
    refused and its first 16 characters were in the record, both formats.)"""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    secret = "sk_live_4eC39HqLyjWDarjtT1zdp7dc"
    text = f"Mein API-Schlüssel: {secret}" + "Qx9" * 200
    for method in (served.stub.Translate, lambda r: list(served.stub.TranslateStream(r))):
        method(request([text]))
        error = status_of(lambda: method(request([text, "x" * 10_001])))  # noqa: B023
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT and secret[:8] not in error.details
    records = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert [fields["status"] for fields in access_records(caplog)] == ["OK", "INVALID_ARGUMENT"] * 2
    lines = [formatter.format(r) for r in records for formatter in (TextFormatter(), JsonFormatter())]
    assert not any(secret[:8] in line for line in lines)


def test_a_clients_language_code_is_quoted_as_sent(served: RunningServer) -> None:
    """The code in the refusal is the client's own string, its line break shown, not a line of the message."""
    forged = "de\n2026-11-29 06:00:00,000 ERROR forged: disk full"
    error = status_of(lambda: served.stub.Translate(request(["Hallo"], source=forged)))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details.startswith(f"unsupported language pair {forged!r} -> 'en'; supported pairs: ")


def test_a_model_on_two_engines_is_logged_as_served_once(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Broken before: one "serving" line per engine, which read as two models."""
    caplog.set_level(logging.INFO, logger="server.edge.server")
    with running_server([fake_model(tiny_model_dir), fake_model(tiny_model_dir)], server_config()):
        pass
    serving = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"serving {FAKE_DESCRIPTION.name} ")]
    assert serving == [f"serving {FAKE_DESCRIPTION.name} (fp32, fake, 2 engines): de-en, en-de"]


def test_the_log_format_is_text_unless_json_is_asked_for() -> None:
    assert parse_config([], {}).observability.log_format == "text"
    assert parse_config(["--log-format", "json"], {}).observability.log_format == "json"
    assert parse_config([], {"TRANSLATE_LOG_FORMAT": "JSON"}).observability.log_format == "json"
    with pytest.raises(SystemExit):
        parse_config(["--log-format", "xml"], {})


def test_huggingface_hubs_own_stderr_handler_is_dropped_even_before_it_is_imported() -> None:
    """The server adopts huggingface_hub's logger before a fetch imports the module that adds a plain stderr
    handler: that handler must not appear afterwards, or `--log-format json` gets plain lines beside its JSON.
    (Broken once on purpose, importing only the top-level package: the handler came back at the fetch's import.)"""
    pytest.importorskip("huggingface_hub", reason="the [import] extra's: the light loop installs none of it")
    script = (
        "import logging, sys\n"
        "from server.edge.logs import adopt_library_loggers\n"
        "assert 'huggingface_hub' not in sys.modules\n"
        "adopt_library_loggers('huggingface_hub')\n"
        "from huggingface_hub import HfApi, snapshot_download\n"
        "print(len(logging.getLogger('huggingface_hub').handlers))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "0", result.stderr
