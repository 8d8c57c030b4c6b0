"""A sentence over the model's source limit as parts that each fit: translated in parts, never refused.

The cuts are chosen greedily, each part as long as fits: at clause boundaries first (a comma, semicolon
or colon before whitespace, a spaced dash or an em dash, and CJK's full-width comma, semicolon and colon,
its enumeration comma and Arabic's comma and semicolon, which need no whitespace after them), then,
inside a clause that alone is too long, at whitespace, and inside a run without whitespace (a URL,
encoded data, a script written without spaces) between characters, never before a combining mark. Each
part keeps the marks that end it; `join(split.pieces, split.separators)` is the sentence. The parts'
translations are joined with the whitespace at each cut (`joints`), and with a space after a mark that
needs none (a CJK comma) where the translation after it is written with spaces.

Segments are encoded once per level to choose the cuts and each part once more to check it, so the work is
linear in the sentence; a part whose tokens the segments underestimated is cut again at the next level.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

from server.text.markup_render import spaced_word
from server.text.splitter import Split, translatable

Encode = Callable[[str], list[int]]  # a text to the ids the model reads (tag and EOS included)
Span = tuple[int, int, list[int]]  # a part's start and end in the sentence, and its ids

# Where a clause ends: Latin marks and dashes before whitespace (never "1,000" or "1990-2000"), an em dash,
# and the CJK and Arabic marks with or without whitespace; a cut falls after the whitespace that follows
_UNSPACED_MARKS = "\uff0c\uff1b\uff1a\u3001\u060c\u061b"  # clause marks no whitespace need follow
_CLAUSE_END = re.compile(rf"(?:[,;:]|\s[-\u2013\u2014])\s+|[\u2014{_UNSPACED_MARKS}]\s*")
_WHITESPACE = re.compile(r"\s+")
_LEVELS = (_CLAUSE_END, _WHITESPACE)  # coarsest first; after the last, cuts fall between characters


class UncuttableError(ValueError):
    """Even one character of the sentence is over the limit: no cut makes it fit."""


@dataclass(frozen=True)
class Parts:
    """A sentence as parts that each fit."""

    split: Split  # the parts, and the whitespace at each cut and around any run left untranslated
    sources: list[list[int]]  # each part's ids, as `Encode` gives them


@dataclass(frozen=True)
class _Fit:
    encode: Encode
    limit: int  # most ids of a part
    overhead: int  # ids of an empty text: what every part adds (tag, EOS)


def cut(sentence: str, encode: Encode, limit: int) -> Parts:
    """`sentence` (over `limit` ids by `encode`) as parts of at most `limit` ids; UncuttableError where none fit."""
    fit = _Fit(encode, limit, len(encode("")))
    if fit.limit <= fit.overhead:
        raise UncuttableError(f"a part needs more than {limit} tokens")
    spans = _fitted(sentence, 0, len(sentence), fit, 0)
    ends = [0, *(edge for start, end, _ in spans for edge in (start, end)), len(sentence)]
    separators = [sentence[ends[i] : ends[i + 1]] for i in range(0, len(ends), 2)]
    return Parts(Split([sentence[start:end] for start, end, _ in spans], separators), [ids for *_, ids in spans])


def _fitted(text: str, start: int, end: int, fit: _Fit, level: int) -> list[Span]:
    """text[start:end], which does not fit, as spans that do: cut at `_LEVELS[level]` or finer."""
    if level == len(_LEVELS):
        return _by_characters(text, start, end, fit)
    cuts = [found.end() for found in _LEVELS[level].finditer(text, start, end) if start < found.end() < end]
    if not cuts:
        return _fitted(text, start, end, fit, level + 1)
    bounds = [start, *cuts, end]
    sizes = [len(fit.encode(text[a:b])) - fit.overhead for a, b in pairwise(bounds)]
    spans: list[Span] = []
    for a, b in _groups(bounds, sizes, fit.limit - fit.overhead):
        spans += _fitting(text, a, b, fit, level + 1)
    return spans


def _groups(bounds: list[int], sizes: list[int], budget: int) -> list[tuple[int, int]]:
    """The segments between `bounds` joined greedily while their `sizes` sum to at most `budget`."""
    groups: list[tuple[int, int]] = []
    first, total = 0, 0
    for i, size in enumerate(sizes):
        if i > first and total + size > budget:
            groups.append((bounds[first], bounds[i]))
            first, total = i, 0
        total += size
    groups.append((bounds[first], bounds[-1]))
    return groups


def _fitting(text: str, start: int, end: int, fit: _Fit, level: int) -> list[Span]:
    """text[start:end] without its edge whitespace as one span if it fits, else cut at `level` or finer; no span
    where it has nothing to translate (it stays between its neighbours' translations as it is)."""
    start, end = _trimmed(text, start, end)
    if not translatable(text[start:end]):
        return []
    ids = fit.encode(text[start:end])
    return [(start, end, ids)] if len(ids) <= fit.limit else _fitted(text, start, end, fit, level)


def _trimmed(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def _by_characters(text: str, start: int, end: int, fit: _Fit) -> list[Span]:
    """text[start:end] cut between characters, each part sized by the last part's ids per character."""
    spans: list[Span] = []
    size = end - start
    while start < end:
        size = min(size, end - start)
        ids = fit.encode(text[start : start + size])
        while len(ids) > fit.limit:
            if size == 1:
                raise UncuttableError(f"one character alone is over {fit.limit} tokens")
            shrunk = size * (fit.limit - fit.overhead) // (len(ids) - fit.overhead)
            size = _character_end(text, start, start + max(1, min(size - 1, shrunk))) - start
            ids = fit.encode(text[start : start + size])
        spans += _fitting(text, start, start + size, fit, len(_LEVELS))
        start += size
    return spans


def _character_end(text: str, start: int, at: int) -> int:
    """`at`, or earlier where it falls before a combining mark, so a character keeps its marks (never `start`)."""
    while at - 1 > start and at < len(text) and unicodedata.combining(text[at]):
        at -= 1
    return at


def joints(split: Split, translations: list[str]) -> list[str]:
    """The separators `translations` (of `split.pieces`) are joined with: `split.separators`, and a space at a cut
    with none after a mark that needs none (a CJK comma) where the next translation is written with spaces."""
    return [" " if _spaced_cut(split, translations, i) else between for i, between in enumerate(split.separators)]


def _spaced_cut(split: Split, translations: list[str], i: int) -> bool:
    """Whether separator `i` is empty after a mark that needs no whitespace and the translations around it have
    none at their edges, the first letter or digit after it of a script that puts spaces between its words."""
    if not 0 < i < len(split.pieces) or split.separators[i]:
        return False
    before, after = translations[i - 1], translations[i]
    if not split.pieces[i - 1].endswith(tuple(_UNSPACED_MARKS)) or not before or not after or before[-1].isspace():
        return False
    first = next((char for char in after if char.isalnum()), "")
    return not after[0].isspace() and spaced_word(first)
