"""Splitting takes work linear in the text (server/text/splitter.py): pysbd never reads a text or run without a
letter or digit, reads each character at most once, and never more than PYSBD_WINDOW_CHARS at a time; a
checkpoint between windows stops a split whose call has ended. Work is counted, never timed."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.text import splitter
from server.text.checkpoints import CallEnded, checkpoints
from server.text.splitter import PYSBD_WINDOW_CHARS, join, split

# Punctuation and symbols, with the units of the reported texts among them
SYMBOLS = st.sampled_from(
    list(".,;:!?-()[]\"'/\\*&%$#@+=<>|~^_ \t" + "\u2026\u2014\u2013\u00ab\u00bb\u00a1\u00bf\u3002\uff01\uff1f")
)
LETTERLESS_UNIT = st.one_of(
    st.sampled_from(["-. ", ". ", "., ", "). ", "... ", "?! ", "-", " "]),
    st.text(SYMBOLS, min_size=1, max_size=4),
)
# Units with a letter or digit among the punctuation: each makes many short sentences, or abbreviations
LETTERED_UNIT = st.one_of(
    st.sampled_from(["a-. ", "Dr. ", "a). ", "A. ", "1. ", "a.b.", "(a) ", "Nr. 5. ", "z. B. "]),
    st.tuples(st.text(SYMBOLS, min_size=1, max_size=3), st.sampled_from("aZ7ßж")).map("".join),
)


def repeated(unit: st.SearchStrategy[str], longest: int) -> st.SearchStrategy[str]:
    """A unit repeated to a length up to `longest`."""
    return st.tuples(unit, st.integers(1, longest)).map(lambda p: (p[0] * (p[1] // len(p[0]) + 1))[: p[1]])


def counting_pysbd(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every line or window pysbd is given, in order."""
    fed: list[int] = []
    real: Callable[[str, str], list[int]] = splitter._pysbd_cuts

    def counted(line: str, language: str) -> list[int]:
        fed.append(len(line))
        return real(line, language)

    monkeypatch.setattr(splitter, "_pysbd_cuts", counted)
    return fed


@settings(max_examples=60, deadline=None)
@given(text=repeated(LETTERLESS_UNIT, 10_000), language=st.sampled_from(["de", "en", "fr", "ar"]))
def test_a_text_without_a_letter_or_digit_never_reaches_pysbd(text: str, language: str) -> None:
    with pytest.MonkeyPatch.context() as patch:
        fed = counting_pysbd(patch)
        parts = split(text, language)
    assert fed == []
    assert parts.pieces == [] and join(parts.pieces, parts.separators) == text


@settings(max_examples=60, deadline=None)
@given(
    text=st.one_of(
        repeated(LETTERED_UNIT, 6_000),
        st.tuples(repeated(LETTERED_UNIT, 3_000), repeated(LETTERLESS_UNIT, 3_000)).map("".join),
        st.tuples(repeated(LETTERLESS_UNIT, 3_000), repeated(LETTERED_UNIT, 3_000)).map("".join),
    ),
    language=st.sampled_from(["de", "en", "fr", "ar"]),
)
def test_pysbd_reads_each_character_at_most_once_and_a_bounded_window_at_a_time(text: str, language: str) -> None:
    with pytest.MonkeyPatch.context() as patch:
        fed = counting_pysbd(patch)
        parts = split(text, language)
    assert all(length <= PYSBD_WINDOW_CHARS for length in fed), max(fed)
    assert sum(fed) <= len(text)
    assert join(parts.pieces, parts.separators) == text


def test_a_long_letterless_run_inside_a_line_is_kept_verbatim_and_never_fed() -> None:
    text = "Das Haus ist groß. " + "-. " * 200 + "Er wartete lange."
    with pytest.MonkeyPatch.context() as patch:
        fed = counting_pysbd(patch)
        parts = split(text, "de")
    assert parts.pieces == ["Das Haus ist groß.", "Er wartete lange."]
    assert sum(fed) <= len(text) - 3 * 200 + 3  # the run's characters are not among those fed
    assert join(parts.pieces, parts.separators) == text


def test_a_paragraph_longer_than_a_window_splits_as_its_sentences_alone_do() -> None:
    sentences = [
        f"Die Regierung hat in {city} ein neues Gesetz zur Förderung erneuerbarer Energien beschlossen, das im"
        " kommenden Jahr in Kraft treten soll."
        for city in ["Berlin", "Bonn", "Köln", "Mainz", "Kiel"] * 8
    ]
    paragraph = " ".join(sentences)
    assert len(paragraph) > 4 * PYSBD_WINDOW_CHARS
    assert split(paragraph, "de").pieces == sentences


def test_a_split_stops_at_a_checkpoint_once_its_call_has_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    fed = counting_pysbd(monkeypatch)
    passed = 0

    def ended_after_two() -> None:
        nonlocal passed
        passed += 1
        if passed > 2:
            raise CallEnded(deadline_passed=True)

    text = "Der Hund schläft im Garten, und die Katze sitzt auf dem Dach. " * 200  # many windows
    with checkpoints(ended_after_two), pytest.raises(CallEnded):
        split(text, "de")
    assert len(fed) <= 2
