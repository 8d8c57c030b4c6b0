"""Sentence splitting that keeps every character of the input, so translations reassemble exactly.

Texts are cut at line breaks first, which always end a sentence (a title line has no full stop), then
into sentences by the rule their language gets (`rule_for`, logged at startup for every served source):
- pysbd's rules for the languages it has (`PYSBD_LANGUAGES`, by ISO 639-1 code, whatever code the model
  writes: `fra` and `fr` both get pysbd's French). Its Arabic and Persian rules also cut at commas and
  colons; those cuts are dropped, as a clause is not a sentence to a translation model.
- everywhere else, `PUNCTUATION`: a cut after sentence-final marks, Latin `.!?…` before whitespace and
  a character that is no lowercase letter, and with or without whitespace after the full stops and
  question marks of CJK, Devanagari (danda), Arabic, Ethiopic, Armenian, Myanmar and Khmer, closing
  quotes and brackets kept with their sentence. A script without such marks (Thai) is cut at line
  breaks only; a line over the per-sentence token limit is translated in parts (server.text.clauses).
A text becomes `pieces` (sentences, stripped of whitespace and of the format characters around them: bidi
marks and isolates) and `separators` (what is kept as it is around them),
with `join(pieces, separators) == text` for every text: the server translates the pieces and joins
the translations with the original separators, so line breaks and spacing survive translation.

Only a sentence with a letter or a digit is a piece. One without (punctuation, symbols, emoji,
control characters, "...", "---") has nothing for the model to translate, which would invent words
for it; it stays in the separators and so comes back verbatim.

Splitting takes time linear in the text: pysbd's rules cost more per character the longer the line
they read (a line of ". " or "Dr. " repeated), so pysbd reads a line in windows of at most
`PYSBD_WINDOW_CHARS` (`windows`: cut at the ends the PUNCTUATION rule finds, else at a space), a text
or line without a letter or digit never reaches it, nor does a run of `LETTERLESS_RUN_CHARS` or more
characters without one (such a run ends the sentence before it). Each window is a `checkpoint`: a
call that has ended stops splitting there.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass

import pysbd
from pysbd.languages import LANGUAGE_CODES

from model.languages import iso639_1
from server.text.checkpoints import checkpoint

_LINE_BREAK = re.compile(r"\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")  # what str.splitlines splits on
# What pysbd cuts at or after: its sentence punctuation, the parenthesis of list items ("a)", "1)"),
# the ellipsis, and the marks it writes into its own working copy of the text. A line with none of
# them before its last character is one sentence to pysbd, which costs far more to say so.
_MAY_CUT = frozenset(".!?)\u3002\uff0e\uff01\uff1f\u2026\u0238\u0239\u2609\u2608\u2607\u2604\u2668\u261d\u222f&\u2702")
PYSBD_LANGUAGES = frozenset(LANGUAGE_CODES)  # ISO 639-1 codes pysbd has rules for
PUNCTUATION = "punctuation"  # the rule of every other language
_CLAUSE_MARKS = frozenset(",:\u060c")  # pysbd's Arabic and Persian cut after these too; such cuts are dropped
_CUTS_CLAUSES = frozenset({"ar", "fa"})
_CLOSERS = "\"'\u00bb\u2019\u201d\u300d\u300f\uff09\u3011\u3009\u300b)\\]}"
# Sentence ends without rules: Latin marks before whitespace and no lowercase letter; the others anywhere.
_LATIN_END = re.compile(rf"[.!?\u2026\u203c\u2047-\u2049]+[{_CLOSERS}]*(?=\s)")
_SCRIPT_END = re.compile(
    "[\u3002\uff01\uff1f\uff61\u0964\u0965\u061f\u06d4\u1362\u1367\u1368\u0589\u104a\u104b\u17d4\u17d5]+"
    rf"[{_CLOSERS}]*"
)
# What still belongs to a sentence pysbd ends before it: more sentence marks and the quotes that close it
# (its Chinese and Japanese rules cut a quoted sentence before its closing quote, and a doubled mark in two).
_SENTENCE_TAIL = re.compile(
    "[.!?\u2026\u3002\uff01\uff1f\uff61\u0964\u0965\u061f\u06d4\u1362\u1367\u1368\u0589\u104a\u104b\u17d4\u17d5]*"
    rf"[{_CLOSERS}]*"
)
_PER_THREAD = threading.local()  # holds each thread's {language: pysbd.Segmenter}
# The most characters pysbd reads at once: a window's cost grows faster than its length, so a line is
# fed in windows of this size at most (a longer line is rare: a paragraph without line breaks)
PYSBD_WINDOW_CHARS = 1000
# A run of this many characters without a letter or digit (rules, dot leaders, punctuation noise) is
# never fed to pysbd: it is kept verbatim between the sentences around it. It begins after whitespace,
# so the marks that end the sentence before it stay with that sentence.
LETTERLESS_RUN_CHARS = 64
_LETTERLESS_RUN = re.compile(rf"(?:^|(?<=\s))[\W_]{{{LETTERLESS_RUN_CHARS},}}")
_NEXT_VISIBLE = re.compile(r"\s*(\S)")  # the first character after whitespace


@dataclass(frozen=True)
class Split:
    """A text as sentences and the whitespace between them."""

    pieces: list[str]  # sentences without whitespace or format characters around them, in order; each `translatable`
    separators: list[str]  # len(pieces) + 1 runs of whitespace and untranslatable text around the pieces


def join(pieces: list[str], separators: list[str]) -> str:
    """separators[0] + pieces[0] + separators[1] + ... + pieces[-1] + separators[-1]."""
    if len(separators) != len(pieces) + 1:
        raise ValueError(f"need {len(pieces) + 1} separators for {len(pieces)} pieces, got {len(separators)}")
    out = [separators[0]]
    for piece, sep in zip(pieces, separators[1:], strict=True):
        out += [piece, sep]
    return "".join(out)


def translatable(text: str) -> bool:
    """Whether `text` holds a letter or a digit (Unicode categories L and N): else there is nothing to translate."""
    return any(char.isalnum() for char in text)


def _segmenter(language: str) -> pysbd.Segmenter:
    """This thread's segmenter for `language`.

    One per thread, not per process: `Segmenter.segment` keeps its input on the instance and finds
    its sentences in it, so two threads sharing one locate their sentences in each other's text.
    """
    segmenters: dict[str, pysbd.Segmenter] = _PER_THREAD.__dict__.setdefault("segmenters", {})
    if language not in segmenters:
        # clean=False: pysbd must not rewrite the text, we locate its sentences in the original
        segmenters[language] = pysbd.Segmenter(language=language, clean=False)
    return segmenters[language]


def rule_for(language: str) -> str:
    """The sentence rule `language` (any code a model or client writes) gets: pysbd's by ISO 639-1, else PUNCTUATION."""
    code = iso639_1(language)
    return code if code in PYSBD_LANGUAGES else PUNCTUATION


def split(text: str, language: str) -> Split:
    """Split `text` (in `language`, any code: its rule is `rule_for(language)`) into sentences and separators."""
    checkpoint()
    if not translatable(text):  # nothing to translate: no rule needs to read it
        return Split([], [text])
    cuts = sorted(set(_line_cuts(text)) | set(_sentence_cuts(text, rule_for(language))))
    pieces: list[str] = []
    separators: list[str] = []
    pending = ""  # whitespace since the last piece
    start = 0
    for end in [*cuts, len(text)]:
        chunk = text[start:end]
        start = end
        first, last = _inner(chunk)
        core = chunk[first:last]
        if not translatable(core):
            pending += chunk
            continue
        lead, trail = chunk[:first], chunk[last:]
        separators.append(pending + lead)
        pieces.append(core)
        pending = trail
    separators.append(pending)
    return Split(pieces, separators)


def _inner(chunk: str) -> tuple[int, int]:
    """Where `chunk` begins and ends without the whitespace and format characters (Cf) around it: bidi marks and
    isolates that wrap a string (Android's BidiFormatter writes U+2068 ... U+2069) stay around its translation."""
    first, last = 0, len(chunk)
    while first < last and _edge(chunk[first]):
        first += 1
    while last > first and _edge(chunk[last - 1]):
        last -= 1
    return first, last


def _edge(char: str) -> bool:
    return char.isspace() or unicodedata.category(char) == "Cf"


def _line_cuts(text: str) -> list[int]:
    return [m.end() for m in _LINE_BREAK.finditer(text)]


def _sentence_cuts(text: str, rule: str) -> list[int]:
    """End offsets of the rule's sentences found in the original text, line by line.

    A segment pysbd altered (and so cannot be found) adds no cut: its text stays in a neighbouring
    piece, so nothing is ever lost.
    """
    cuts: list[int] = []
    line_start = 0
    for line_end in [*_line_cuts(text), len(text)]:
        line = text[line_start:line_end]
        if rule == PUNCTUATION:
            cuts += [line_start + cut for cut in _punctuation_cuts(line)]
        elif translatable(line):
            cuts += [line_start + cut for cut in _windowed_pysbd_cuts(line, rule)]
        line_start = line_end
    return cuts


def _windowed_pysbd_cuts(line: str, language: str) -> list[int]:
    """End offsets of pysbd's sentences in `line`, read a window at a time (`windows`); each window ends one."""
    cuts: list[int] = []
    for start, end in windows(line):
        window = line[start:end]
        if not translatable(window):  # a letterless run: nothing in it is a piece
            pass
        elif _one_sentence(window, language):
            cuts.append(start + len(window.rstrip()))  # where pysbd's one segment would end
        else:
            checkpoint()
            cuts += [start + cut for cut in _pysbd_cuts(window, language)]
        cuts.append(end)
    return cuts


def windows(line: str) -> Iterator[tuple[int, int]]:
    """(start, end) spans that cover `line` in order: its runs of LETTERLESS_RUN_CHARS or more characters without
    a letter or digit, each alone, and the text between them in spans of at most PYSBD_WINDOW_CHARS."""
    start = 0
    for run in _LETTERLESS_RUN.finditer(line):
        yield from _text_windows(line, start, run.start())
        yield run.start(), run.end()
        start = run.end()
    yield from _text_windows(line, start, len(line))


def _text_windows(line: str, start: int, stop: int) -> Iterator[tuple[int, int]]:
    """line[start:stop] in spans of at most PYSBD_WINDOW_CHARS, each ending at the last sentence end the
    PUNCTUATION rule finds in it, else after its last space, else at its limit."""
    ends = [start + end for end in _punctuation_cuts(line[start:stop])]
    next_end = 0  # the first of `ends` past `start`
    while stop - start > PYSBD_WINDOW_CHARS:
        limit = start + PYSBD_WINDOW_CHARS
        cut = 0
        while next_end < len(ends) and ends[next_end] <= limit:
            cut = max(cut, ends[next_end]) if ends[next_end] > start else cut
            next_end += 1
        if not cut:
            cut = line.rfind(" ", start + 1, limit) + 1 or limit
        yield start, cut
        start = cut
    if start < stop:
        yield start, stop


def _pysbd_cuts(line: str, language: str) -> list[int]:
    """End offsets in `line` of the sentences pysbd finds there, each taking the marks and closing quotes that
    follow it (`_SENTENCE_TAIL`)."""
    cuts: list[int] = []
    cursor = 0
    taken = ""  # what the last cut took from the head of the segment after it
    for segment in _segmenter(language).segment(line):
        text = segment.strip()
        text, taken = (text[len(taken) :] if taken and text.startswith(taken) else text), ""
        found = line.find(text, cursor) if text else -1
        if found >= 0:
            end = found + len(text)
            clause = language in _CUTS_CLAUSES and line[end - 1] in _CLAUSE_MARKS
            cursor = end if clause else _after_tail(line, end)
            taken = line[end:cursor]
            if not clause or not line[cursor:].strip():  # a clause's cut is dropped, but not the line's end
                cuts.append(cursor)
    return cuts


def _after_tail(text: str, at: int) -> int:
    """Where the sentence marks and closing quotes that begin at `at` end (`at` where there are none)."""
    found = _SENTENCE_TAIL.match(text, at)
    return found.end() if found else at


def _punctuation_cuts(line: str) -> list[int]:
    """End offsets in `line` of sentences ended by a sentence-final mark (the PUNCTUATION rule)."""
    latin = {m.end() for m in _LATIN_END.finditer(line) if _starts_sentence(line, m.end())}
    return sorted(latin | {m.end() for m in _SCRIPT_END.finditer(line)})


def _starts_sentence(line: str, at: int) -> bool:
    """Whether the text after a Latin full stop at `at` can begin a sentence: something follows the whitespace
    there, and not in lowercase."""
    found = _NEXT_VISIBLE.match(line, at)
    return found is not None and not found.group(1).islower()


def _one_sentence(line: str, language: str) -> bool:
    """Whether pysbd would return `line` (which holds text) as a single sentence: nothing it cuts at
    (here or in `language`'s own punctuation) comes before the last character, and that one is no list
    item's parenthesis."""
    core = line.strip()
    return bool(core) and core[-1] != ")" and _may_cut(language).isdisjoint(core[:-1])


def _may_cut(language: str) -> frozenset[str]:
    marks = _MAY_CUT_BY_LANGUAGE.get(language)
    if marks is None:
        marks = _MAY_CUT | frozenset(getattr(LANGUAGE_CODES[language], "Punctuations", ()))
        _MAY_CUT_BY_LANGUAGE[language] = marks
    return marks


_MAY_CUT_BY_LANGUAGE: dict[str, frozenset[str]] = {}
