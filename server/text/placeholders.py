"""Placeholders in a text to translate: what a program fills in later, found so that it comes back verbatim.

Recognised, each by a strict rule so that prose is never taken for one:
- printf and Python's %-formatting: `%s`, `%d`, `%1$s`, `%.*s`, `%-10lu`, `%5.2f`, `%(name)s`. A percent sign
  that follows a number (`50%`, `100 %ige`), `%%` (printf's own percent sign), a space flag (`50 % off`) and a
  Windows variable (`%APPDATA%`) are text.
- Braces of .NET, Python's str.format and ICU: `{0}`, `{name}`, `{user.name}`, `{0,-10:N2}`, `{0!r}`; an ICU
  argument with its type (`{count, plural, one {# item} other {# items}}`, `{n, number}`) is kept whole, nested
  braces included, when they balance. A brace with a space after it (`{ prose }`), one that never closes, and
  .NET's doubled braces (`{{0}}`, literal braces) are text.
- Mustache and Handlebars: `{{name}}`, `{{ user.name }}`, `{{#items}}`, `{{/items}}`, `{{{html}}}`.
- Shell and JavaScript template variables: `${name}`, `${user.name}`.

The scan is one pass: each candidate (`%`, `{`, `$`) is tried once against anchored patterns that stop at the
first character they cannot take, and ICU's nesting is read from one table of matching braces.
"""

from __future__ import annotations

import enum
import re
from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate


class Placeholders(enum.Enum):
    """What the service does with the placeholders of a text it translates."""

    KEEP = "keep"  # each comes back verbatim, exactly once, placed as an inline tag is (the default)
    OFF = "off"  # none is looked for: the model reads them as text


_POSITION = r"[1-9]\d*\$"
_PRINTF = re.compile(
    r"%(?:\([A-Za-z_]\w*\)|" + _POSITION + r")?"  # Python's mapping key, or an argument's position
    r"[-+#0']*"  # flags; a space is none of them, so `50 % off` stays text
    r"(?:\d+|\*(?:" + _POSITION + r")?)?"  # width
    r"(?:\.(?:\d+|\*(?:" + _POSITION + r")?)?)?"  # precision
    r"(?:hh|ll|I64|I32|[hlLqjzZtI])?"  # length
    r"[diouxXeEfFgGaAcspn@]"  # conversion; `@` is Objective-C's object
)
_WINDOWS_VARIABLE = re.compile(r"%[A-Z_][A-Z0-9_]+%")
_NUMBER_BEFORE = re.compile(r"\d[ \u00a0\u202f]?$")  # `50%`, `50 %`, with a no-break space too
_NAME = r"[^\W\d]\w*"
_FIELD = r"(?:\d+|" + _NAME + r")(?:\." + _NAME + r"|\[\w+\])*"  # `0`, `name`, `user.name`, `0[key]`
_BRACE = re.compile(r"\{" + _FIELD + r"(?:,-?\d+)?(?:![rsa])?(?::[^{}\s]*)?\}")
_ICU = re.compile(
    r"\{(?:\d+|" + _NAME + r")\s*,\s*"
    r"(?:plural|selectordinal|select|number|date|time|duration|ordinal|spellout|choice)\s*[,}]"
)
_MUSTACHE = re.compile(
    r"\{\{\{\s*" + _NAME + r"(?:\." + _NAME + r")*\s*\}\}\}"
    r"|\{\{\s*[#/^&>]?\s*" + _NAME + r"(?:[.-]\w+)*\s*\}\}"
)
_SHELL = re.compile(r"\$\{" + _NAME + r"(?:\." + _NAME + r")*\}")
_CANDIDATE = re.compile(r"[%{$]")


def spans(text: str) -> list[tuple[int, int]]:
    """The (start, end) of every placeholder in `text`, in order, none overlapping."""
    found: list[tuple[int, int]] = []
    closing: dict[int, int] | None = None  # ICU: the `}` that closes each `{`, read once when first needed
    at = 0
    while (candidate := _CANDIDATE.search(text, at)) is not None:
        start = candidate.start()
        if text[start] == "%":
            end, skip = _percent(text, start)
        elif text[start] == "$":
            end, skip = _matched(_SHELL, text, start), start + 1
        else:
            if closing is None and _ICU.match(text, start):
                closing = _closing_braces(text)
            end, skip = _brace(text, start, closing or {}), start + 1
        if end > start:
            found.append((start, end))
        at = max(end, skip)
    return found


def text_and_placeholders(text: str) -> list[tuple[str, bool]]:
    """`text` in order as its runs of text and its placeholders, each with whether it is a placeholder; no piece
    is empty, and together they are `text`."""
    out: list[tuple[str, bool]] = []
    done = 0
    for start, end in spans(text):
        out += [(text[done:start], False)] if start > done else []
        out.append((text[start:end], True))
        done = end
    return [*out, (text[done:], False)] if done < len(text) else out


def holds_placeholders(text: str) -> bool:
    return bool(spans(text))


def without_placeholders(text: str) -> tuple[str, Callable[[int], int]]:
    """`text` with its placeholders removed, and where each offset of `text` lands in what is left (one inside
    a placeholder goes to where it stood)."""
    found = spans(text)
    if not found:
        return text, int
    kept = [text[end:start] for (_, end), (start, _) in zip([(0, 0), *found], [*found, (len(text), 0)], strict=True)]
    ends = [end for _, end in found]
    removed = [0, *accumulate(end - start for start, end in found)]  # characters removed before each span

    def moved(offset: int) -> int:
        before = bisect_right(ends, offset)  # placeholders that end at or before `offset`
        inside = max(0, offset - found[before][0]) if before < len(found) else 0
        return offset - removed[before] - inside

    return "".join(kept), moved


def _percent(text: str, start: int) -> tuple[int, int]:
    """A printf placeholder's end at `start` (`start` when none), and where the scan goes on."""
    if text.startswith("%%", start):
        return start, start + 2
    if (variable := _WINDOWS_VARIABLE.match(text, start)) is not None:
        return start, variable.end() - 1  # its closing `%` may open a placeholder
    if _NUMBER_BEFORE.search(text, max(0, start - 2), start):
        return start, start + 1
    return _matched(_PRINTF, text, start), start + 1


def _brace(text: str, start: int, closing: dict[int, int]) -> int:
    """The end of a brace placeholder at `start`, `start` when none."""
    if (end := _matched(_MUSTACHE, text, start)) > start:
        return end
    if _ICU.match(text, start):
        return closing[start] + 1 if start in closing else start
    end = _matched(_BRACE, text, start)
    doubled = text[start - 1 : start] == "{" or text[end : end + 1] == "}"  # .NET's `{{0}}`: literal braces
    return start if doubled else end


def _matched(pattern: re.Pattern[str], text: str, start: int) -> int:
    match = pattern.match(text, start)
    return start if match is None else match.end()


def _closing_braces(text: str) -> dict[int, int]:
    """For each `{` of `text` that a `}` closes, that `}`'s offset."""
    closing: dict[int, int] = {}
    opened: list[int] = []
    for offset, char in enumerate(text):
        if char == "{":
            opened.append(offset)
        elif char == "}" and opened:
            closing[opened.pop()] = offset
    return closing
