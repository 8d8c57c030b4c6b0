"""HTML and XML as a flat list of tokens whose raw texts, joined, are the input byte for byte.

The standard library's `html.parser` reads the markup: it reads malformed input (but for a few
declarations, see `_events`), keeps entities unexpanded when told (`convert_charrefs=False`), and
says where each construct begins (`getpos`); entities are left to the caller (`html.unescape` of a
text's raw span). A token's raw text runs from where its construct begins to where the next one
does, so nothing the parser skips or buffers is lost; what follows a tag's closing `>` inside that
span becomes a text token of its own.
"""

from __future__ import annotations

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

    def __init__(self, text: str, base: int) -> None:
        super().__init__(convert_charrefs=False)
        self.events: list[_Event] = []
        self._base = base  # where `text`, the part of the input this parser reads, begins in the input
        self._line_starts = [0, *(m.end() for m in re.finditer("\n", text))]  # the parser counts lines by \n

    def position(self) -> int:
        """Where in the input the construct being read begins."""
        line, column = self.getpos()
        return self._base + self._line_starts[line - 1] + column

    def _add(self, kind: Kind, name: str = "", attrs: list[tuple[str, str | None]] | None = None) -> None:
        tag = len(self.get_starttag_text() or "") if kind in (Kind.START, Kind.VOID) else 0
        self.events.append(_Event(self.position(), kind, name, tuple(attrs or ()), tag))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._add(Kind.START, tag, attrs)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._add(Kind.VOID, tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        self._add(Kind.END, tag)

    def handle_data(self, data: str) -> None:
        self._add(Kind.TEXT)

    def handle_comment(self, data: str) -> None:
        self._add(Kind.OTHER)

    def handle_entityref(self, name: str) -> None:  # references are text to us
        self._add(Kind.TEXT)

    def handle_charref(self, name: str) -> None:
        self._add(Kind.TEXT)

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
    come from `text` itself). Some malformed declarations (`<![ x [`) make it raise AssertionError: that
    "<" becomes text and a new parser goes on after it, so each character is read about once.
    """
    readable = text.replace("&", "_")
    events: list[_Event] = []
    base = 0
    while True:
        recorder = _Recorder(readable[base:], base)
        try:
            recorder.feed(readable[base:])
            recorder.close()
        except AssertionError:  # it may have moved on inside the construct: that begins at the last "<"
            failed_at = max(base, readable.rfind("<", base, recorder.position() + 1))
            events += [e for e in recorder.events if e.start < failed_at]
            events.append(_Event(failed_at, Kind.TEXT, "", (), 0))
            base = failed_at + 1
            continue
        return _enclosed(text, events + recorder.events)


_SUBSET_END = re.compile(r"\]\s*>")


def _enclosed(text: str, events: list[_Event]) -> list[_Event]:
    """The events with each processing instruction and doctype the parser ended at its first ">" run to its
    true end: `<?app cond="a > b"?>` (and PHP's `<?php if ($n > 0): ?>`) at "?>", `<!DOCTYPE d [<!ENTITY w
    "<b>x</b>">]>` at the "]>" after its internal subset. What the parser read inside becomes part of it; what
    follows its end, up to the next construct, is text."""
    out: list[_Event] = []
    until = 0  # the end of the last construct run to its true end
    for event in events:
        if event.start < until:
            continue
        if out and out[-1].start < until < event.start:  # text between that end and this construct
            out.append(_Event(until, Kind.TEXT, "", (), 0))
        out.append(event)
        if event.kind is Kind.OTHER:
            until = max(until, _enclosure_end(text, event.start))
    if out and out[-1].start < until < len(text):
        out.append(_Event(until, Kind.TEXT, "", (), 0))
    return out


def _enclosure_end(text: str, start: int) -> int:
    """Where a processing instruction or a doctype with an internal subset beginning at `start` ends; 0 for
    anything else, or for one that never ends (the parser's reading stands)."""
    if text.startswith("<?", start):
        end = text.find("?>", start + 2)
        return end + 2 if end >= 0 else 0
    if text[start : start + 9].upper() == "<!DOCTYPE":
        subset, first_close = text.find("[", start), text.find(">", start)
        if 0 <= subset < first_close:
            match = _SUBSET_END.search(text, subset)
            return match.end() if match else 0
    return 0


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
    merged: list[Token] = []
    for token in items:
        if token.kind is Kind.TEXT and merged and merged[-1].kind is Kind.TEXT:
            merged[-1] = Token(Kind.TEXT, merged[-1].raw + token.raw)
        else:
            merged.append(token)
    return merged
