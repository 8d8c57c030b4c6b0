"""`translate --glossary FILE`: a glossary file read into the request's inline entries.

The file is UTF-8 (a leading byte-order mark is skipped), one `source<TAB>target` entry per line; blank lines and
lines starting with `#` are skipped. What a term may hold is the server's rule: it refuses a term over its limits
with INVALID_ARGUMENT naming the entry.
"""

from __future__ import annotations

from pathlib import Path

from server.text.glossary_files import GlossaryFileError, read_tsv


class BadGlossaryFile(ValueError):
    """A glossary file the command cannot send; the message names the file and the line."""


def read_glossary(path: Path) -> list[tuple[str, str]]:
    """The (source, target) entries of the TSV file at `path`, in order."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise BadGlossaryFile(f"--glossary {path}: {error.strerror or error}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise BadGlossaryFile(
            f"--glossary {path} line {line} is not valid UTF-8 (byte 0x{raw[error.start]:02x}); convert the file to"
            " UTF-8"
        ) from None
    try:
        return [(entry.source, entry.target) for entry in read_tsv(text.removeprefix("\ufeff"), comments=True)]
    except GlossaryFileError as error:
        raise BadGlossaryFile(f"--glossary {path} {error}") from None
