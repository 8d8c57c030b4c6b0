"""HTML and XML as a flat list of tokens whose raw texts, joined, are the input byte for byte.

The standard library's `html.parser` reads the markup: it reads malformed input (but for a few
declarations, see `_events`), keeps entities unexpanded when told (`convert_charrefs=False`), and
says where each construct begins (`getpos`); entities are left to the caller (`html.unescape` of a
text's raw span). A token's raw text runs from where its construct begins to where the next one
does, so nothing the parser skips or buffers is lost; what follows a tag's closing `>` inside that
span becomes a text token of its own.
"""

from __future__ import annotations

import bisect
import enum
import re
from dataclasses import dataclass
from html.parser import HTMLParser


class Kind(enum.Enum):
    START = "start"  # an opening tag, `<a href="x">`
    END = "end"  # a closing tag, `</a>`
    VOID = "void"  # a self-closed tag, `<br/>`, `<x />`
    TEXT = "text"  # character data, entities and character references still escaped
    OTHER = "other"  # a comment, declaration, processing instruction or CDATA section


@dataclass(frozen=True)
class Token:
    kind: Kind
    raw: str  # exactly as in the input
    name: str = ""  # tag name, lowercased (START, END, VOID)
    attrs: tuple[tuple[str, str | None], ...] = ()  # names lowercased, values unescaped (START, VOID)


@dataclass(frozen=True)
class _Event:
    start: int  # offset in the input where the construct begins
    kind: Kind
    name: str
    attrs: tuple[tuple[str, str | None], ...]
    tag_length: int  # length of a start tag's own text; 0 for the others


class _Recorder(HTMLParser):
    """Records where each construct begins and what it is; the raw spans are cut afterwards."""

    def __init__(self, base: int, line_starts: list[int]) -> None:
        super().__init__(convert_charrefs=False)
        self.events: list[_Event] = []
        self._base = base  # where the part of the input this parser reads begins in the input
        self._line_starts = line_starts  # the input's: 0 and the offset after each "\n" (the parser counts by \n)
        self._next_line = bisect.bisect_right(line_starts, base)  # the first line that starts after `base`
        self._ends: _NextMatch | None = None  # searches for the true ends of processing instructions and doctypes

    def position(self) -> int:
        """Where in the input the construct being read begins."""
        line, column = self.getpos()
        return (self._base if line == 1 else self._line_starts[self._next_line + line - 2]) + column

    def _add(self, kind: Kind, name: str = "", attrs: list[tuple[str, str | None]] | None = None) -> None:
        tag = len(self.get_starttag_text() or "") if kind in (Kind.START, Kind.VOID) else 0
        self.events.append(_Event(self.position(), kind, name, tuple(attrs or ()), tag))

    def parse_pi(self, i: int) -> int:
        """A processing instruction to its "?>" (`<?php if ($n > 0): ?>`), not the first ">" as the parser reads it:
        a "<!--" or a quote inside would otherwise start a construct that swallows the rest of the document."""
        end = self._next(_PI_END, i + 2)
        if end < 0:
            return int(super().parse_pi(i))  # an SGML-style `<?target data>`
        self.handle_pi(self.rawdata[i + 2 : end - 2])
        return end

    def parse_html_declaration(self, i: int) -> int:
        """A doctype to the "]>" after its internal subset (`<!DOCTYPE d [<!ENTITY w "<b>x</b>">]>`), not the first
        ">"; any other declaration as the parser reads it."""
        rawdata = self.rawdata
        if rawdata[i : i + 9].lower() == "<!doctype":
            first_close = rawdata.find(">", i + 9)
            subset = rawdata.find("[", i, first_close) if first_close >= 0 else -1
            if subset >= 0 and (end := self._next(_SUBSET_END, subset)) >= 0:
                self.handle_decl(rawdata[i + 2 : end - 1])
                return end
        return int(super().parse_html_declaration(i))

    def _next(self, pattern: re.Pattern[str], start: int) -> int:
        """The end of `pattern`'s first match at or after `start` in what the parser reads; -1 where none."""
        if self._ends is None or self._ends.text is not self.rawdata:
            self._ends = _NextMatch(self.rawdata)
        return self._ends.after(pattern, start)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._add(Kind.START, tag, attrs)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._add(Kind.VOID, tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        self._add(Kind.END, tag)

    def handle_data(self, data: str) -> None:
        if not self.events or self.events[-1].kind is not Kind.TEXT:  # text runs on to the next construct
            self._add(Kind.TEXT)

    def handle_comment(self, data: str) -> None:
        self._add(Kind.OTHER)

    def handle_entityref(self, name: str) -> None:  # references are text to us
        self.handle_data(name)

    def handle_charref(self, name: str) -> None:
        self.handle_data(name)

    def handle_decl(self, decl: str) -> None:  # declarations, processing instructions, CDATA: kept like comments
        self._add(Kind.OTHER)

    def handle_pi(self, data: str) -> None:
        self._add(Kind.OTHER)

    def unknown_decl(self, data: str) -> None:
        self._add(Kind.OTHER)


def tokens(text: str) -> list[Token]:
    """`text` as tokens; `"".join(t.raw for t in tokens(text)) == text` for every string."""
    events = [e for e in _events(text) if e.start < len(text)]
    if not events:
        return [Token(Kind.TEXT, text)] if text else []
    out = [Token(Kind.TEXT, text[: events[0].start])] if events[0].start > 0 else []
    ends = [e.start for e in events[1:]] + [len(text)]
    for event, end in zip(events, ends, strict=True):
        if end > event.start:
            out += _cut(event, text[event.start : end])
    return _merge_text(out)


def _events(text: str) -> list[_Event]:
    """What the parser finds in `text`, in order.

    The parser reads "&" only to report references, which are text to us, and a stray "&#" would make it
    read the rest of the input as text: it reads a copy with "&" as "_" (the same length; the raw spans
    come from `text` itself). The copy has U+FFFD for NUL, as a browser's tokenizer reads it in a tag
    (`<b` NUL `>` is a tag, never text for the model), and for each character Python's `\\s` takes for
    whitespace and HTML's tokenizer for part of a name or value (`\\v`, U+00A0...): a tag splits into
    attributes where a browser splits it. A marked section it does not know (`<![ x [`, anything but CDATA
    and its like and `<![if ...]>`) would make it raise AssertionError: the copy has "_" for that "<" too,
    so it is text. Should another construct raise, that "<" becomes text and a new parser reads on after it.

    The parser is fed the input and never closed: a construct that does not end before the input does
    (`<a href="x`, `<!-- note`, a script with no end tag) is left unread, and it and all after it are one
    OTHER event, copied as they came, as a browser shows none of it as text. Closing would read it as text
    one character at a time, each time searching the rest of the input for its end: the time would grow
    with the square of the input.
    """
    readable = _UNKNOWN_SECTION.sub("_![", text.translate(_AS_THE_PARSER_READS))
    line_starts = [0, *(m.end() for m in re.finditer("\n", text))]
    events: list[_Event] = []
    base = 0
    while True:
        recorder = _Recorder(base, line_starts)
        try:
            recorder.feed(readable[base:])
        except AssertionError:  # it may have moved on inside the construct: that begins at the last "<"
            failed_at = max(base, readable.rfind("<", base, recorder.position() + 1))
            events += [e for e in recorder.events if e.start < failed_at]
            events.append(_Event(failed_at, Kind.TEXT, "", (), 0))
            base = failed_at + 1
            continue
        unread = len(text) - len(recorder.rawdata)  # where the construct cut short by the input's end begins
        tail = [_Event(unread, Kind.OTHER, "", (), 0)] if unread < len(text) else []
        return events + recorder.events + tail


# What the parser reads for "&", NUL and the characters it would take for whitespace where HTML does not (see _events)
_NOT_HTML_SPACE = "\v\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(
    map(chr, range(0x2000, 0x200B))
)
_AS_THE_PARSER_READS = str.maketrans({"&": "_", "\0": "\ufffd", **dict.fromkeys(_NOT_HTML_SPACE, "\ufffd")})
# A marked section the parser knows by its keyword; any other "<![" makes it raise
_UNKNOWN_SECTION = re.compile(r"<!\[(?!(?:temp|cdata|ignore|include|rcdata|if|else|endif)(?![-_.a-zA-Z0-9]))", re.I)
_PI_END = re.compile(r"\?>")  # a processing instruction's true end
_SUBSET_END = re.compile(r"\]\s*>")  # a doctype's, after its internal subset


class _NextMatch:
    """The end of the first match of a pattern at or after an offset, each search reused while the offsets
    asked for stay before the match it found: a thousand `<?` with no `?>` after them cost one search, not a
    thousand searches to the end of the input."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._found: dict[re.Pattern[str], tuple[int, int, int]] = {}  # pattern -> (from, match start, end)

    def after(self, pattern: re.Pattern[str], start: int) -> int:
        """The end of the first match starting at or after `start`; -1 when there is none."""
        known = self._found.get(pattern)
        if known is not None and known[0] <= start and (known[1] < 0 or start <= known[1]):
            return known[2]
        match = pattern.search(self.text, start)
        self._found[pattern] = (start, match.start(), match.end()) if match else (start, -1, -1)
        return match.end() if match else -1


def _cut(event: _Event, raw: str) -> list[Token]:
    """The event's token, and what follows its tag inside its span as text."""
    if event.kind in (Kind.START, Kind.VOID):
        length = event.tag_length or len(raw)
    elif event.kind is Kind.END:
        length = raw.find(">") + 1 or len(raw)
    else:
        return [Token(event.kind, raw)]
    tag = Token(event.kind, raw[:length], event.name, event.attrs)
    return [tag, Token(Kind.TEXT, raw[length:])] if length < len(raw) else [tag]


def _merge_text(items: list[Token]) -> list[Token]:
    """Neighbouring text tokens as one, joined once per run (a stray "<" is a text token of its own)."""
    merged: list[Token] = []
    run: list[str] = []  # raw texts of the text tokens since the last other token
    for token in [*items, None]:
        if token is not None and token.kind is Kind.TEXT:
            run.append(token.raw)
            continue
        if run:
            merged.append(Token(Kind.TEXT, "".join(run)))
            run = []
        if token is not None:
            merged.append(token)
    return merged
