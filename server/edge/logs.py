"""The server's log lines: text for people (the default) or JSON for log pipelines (`--log-format json`).

Every call to the Translator service writes one access record (`log_call`, logger `translation.access`):
its request id, method, model, language pair, status, duration, texts, sentences, input and output tokens
and the longest queue wait of its sentences; never any text of the request or its translation. In JSON
each record is one object per line, these fields at its top level beside `time` (UTC, ISO 8601), `level`,
`logger`, `pid` and `message`; an exception's traceback goes under `exception`. In text a record's own line has
its control and other unprintable characters escaped (`\\n`, `\\x00`, `\\u2028`), and a traceback below it
is indented line by line, so a client's string (a language code, a status message quoting one) cannot start a
line that reads as a record of its own, nor hide in the log as raw bytes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import re
import sys
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

ACCESS_LOGGER = "translation.access"
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"
_ACCESS = "access"  # the LogRecord attribute that carries an access record's fields
REQUEST_ID_KEY = "x-request-id"  # gRPC metadata that carries a call's request id, both ways
# A client's request id is kept if it is this short and plain (it goes into logs and trailing metadata)
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
TRACE_INDENT = "    "  # before each line of a traceback in text: a record's own line never starts with a space


def escape_unprintable(line: str) -> str:
    """`line` with every character `str.isprintable` refuses (controls, line and paragraph separators, format
    characters) written as its Python escape, as `repr` writes it; printable text, non-ASCII too, stays as it is."""
    if line.isprintable():  # the common case
        return line
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in line)


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT: a record's own line escaped; a traceback or stack below it, each of its lines indented and
    escaped, so that only a record's first line starts at the margin."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_unprintable(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(block: str) -> str:
    return "\n".join(TRACE_INDENT + escape_unprintable(line) for line in block.splitlines())


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, pid, message, an access record's fields, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if access := getattr(record, _ACCESS, None):  # its fields, not their text rendering, are the record
            entry["message"] = "call"
            entry.update(access)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, log_format: str) -> None:
    """The root logger's one handler (stderr), in `log_format`; replaces any handler set before."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)


def adopt_library_loggers(*names: str) -> None:
    """Drop the handlers that libraries add to their own loggers at import (huggingface_hub writes plain lines
    to stderr through one): their records reach the root's handler alone, in the server's format, once. The
    module that adds it (`utils.logging` in huggingface_hub and transformers) is imported first where installed:
    the importers load it only when a model is fetched, which would add the handler after this ran."""
    for name in names:
        with contextlib.suppress(ImportError):
            importlib.import_module(f"{name}.utils.logging")
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True


def log_call(fields: dict[str, Any]) -> None:
    """Write one call's access record: `fields` as JSON keys, and as `key=value` words in the text message."""
    message = " ".join(f"{key}={value}" for key, value in fields.items())
    logging.getLogger(ACCESS_LOGGER).info(message, extra={_ACCESS: fields})


def request_id(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The call's request id: the client's `x-request-id` if it sent one that is short and plain, else a new one."""
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY and isinstance(value, str) and _CLIENT_REQUEST_ID.fullmatch(value):
            return value
    return uuid.uuid4().hex
