"""DeepL's glossary entry formats read into entries: TSV (`source<TAB>target` per line) and CSV (`source,target` or
`source,target,source_language,target_language` per line, fields quoted as RFC 4180 writes them).

Only the format is checked here, each problem named by its line: a line holds two terms and nothing else. What a
term may hold is the edge's rule (`server.edge.glossary_terms`), the same for entries however they arrive.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass

# DeepL's line ends. Other separators (U+2028, form feed) stay inside a term, whose rules refuse them by name.
LINE_BREAK = re.compile(r"\r\n|\n|\r")
CSV_FIELDS = "2 (source,target) or 4 (source,target,source_language,target_language)"


@dataclass(frozen=True)
class FileEntry:
    """One entry of a glossary file."""

    line: int  # where it starts, counted from 1
    source: str  # trimmed of the whitespace around it
    target: str  # trimmed alike
    languages: tuple[str, str] | None = None  # a CSV line's own source and target languages, trimmed; None: unsaid


class GlossaryFileError(ValueError):
    """A line that breaks its format; the message names its line."""

    def __init__(self, line: int, problem: str) -> None:
        super().__init__(f"line {line} {problem}")
        self.line = line
        self.problem = problem


def read_tsv(text: str, comments: bool = False) -> Iterator[FileEntry]:
    """The entries of TSV `text` in order, read as they are asked for; blank lines skipped, and with `comments`
    the lines whose first character other than whitespace is `#`."""
    for number, line in enumerate(LINE_BREAK.split(text), 1):
        if not line.strip() or (comments and line.lstrip().startswith("#")):
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            tabs = f"{len(fields) - 1} tabs" if len(fields) > 1 else "no tab"
            raise GlossaryFileError(number, f"has {tabs}; an entry is source<TAB>target, one tab between two terms")
        yield _entry(number, fields[0], fields[1])


def read_csv(text: str) -> Iterator[FileEntry]:
    """The entries of CSV `text` in order, read as they are asked for; blank lines skipped. A quoted field may span
    lines (RFC 4180); its entry is named by the line it starts on."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True, skipinitialspace=True)
    start = 1
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as error:
            raise GlossaryFileError(start, f"is not CSV as RFC 4180 writes it ({error})") from None
        number, start = start, reader.line_num + 1
        if len(fields) < 2 and not "".join(fields).strip():  # a blank line, not a line of empty fields
            continue
        if len(fields) not in (2, 4):
            raise GlossaryFileError(number, f"has {len(fields)} fields; a CSV entry has {CSV_FIELDS}")
        languages = (fields[2].strip(), fields[3].strip()) if len(fields) == 4 else None
        yield _entry(number, fields[0], fields[1], languages)


def _entry(line: int, source: str, target: str, languages: tuple[str, str] | None = None) -> FileEntry:
    """A line's entry, its terms trimmed; a line without one of its terms is no entry."""
    source, target = source.strip(), target.strip()
    for side, term in (("source", source), ("target", target)):
        if not term:
            raise GlossaryFileError(line, f"has no {side} term")
    return FileEntry(line, source, target, languages)
