"""Glossary terms: a source phrase and the target phrase its translation must use.

The edge finds each entry's source in a sentence and hands the decoder the target's token ids as a constraint
(`server.core.constraints`); the terms themselves are plain strings, as the client or a stored glossary gives them.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache

from model.tokenizer import TextTokenizer


@dataclass(frozen=True)
class Term:
    """One glossary entry: wherever `source` stands in a text as a whole word (or words), its translation holds
    `target` verbatim."""

    source: str
    target: str


@dataclass(frozen=True)
class TermMatch:
    """A glossary term found in a sentence: where its source stands."""

    term: Term
    start: int
    end: int


class TermIndex:
    """A glossary ready to search sentences: entries by the first word of their source, so that a sentence is
    checked only against the terms whose first word it holds (a 10,000-entry glossary costs a dictionary lookup per
    word, not a search per entry). Terms in scripts written without spaces (Chinese, Japanese, Thai, Lao, Khmer,
    Burmese) and terms that start with no word character are searched in every sentence."""

    def __init__(self, terms: tuple[Term, ...]) -> None:
        self.terms = terms
        self._by_word: dict[str, list[Term]] = {}
        self._everywhere: list[Term] = []
        for term in dict.fromkeys(terms):  # an entry listed twice is one term
            word = _WORD.match(term.source)
            if word is None or _unspaced(term.source):
                self._everywhere.append(term)
            else:
                self._by_word.setdefault(word.group(), []).append(term)

    def find(self, sentence: str) -> list[TermMatch]:
        """The terms whose source stands in `sentence`, in order: whole words (a term in a script written without
        spaces anywhere), case as the entry spells it; where two overlap the longer wins, then the earlier."""
        candidates = [*self._everywhere]
        for word in dict.fromkeys(_WORD.findall(sentence)):
            candidates += self._by_word.get(word, ())
        found: list[TermMatch] = []
        for term in candidates:
            bounded = not _unspaced(term.source)
            start = sentence.find(term.source)
            while start >= 0:
                end = start + len(term.source)
                if not bounded or (
                    _edge_ok(sentence, start - 1, term.source[0]) and _edge_ok(sentence, end, term.source[-1])
                ):
                    found.append(TermMatch(term, start, end))
                start = sentence.find(term.source, start + 1)
        taken: list[TermMatch] = []
        for match in sorted(found, key=lambda m: (m.start - m.end, m.start)):  # longest first, then leftmost
            if all(match.end <= other.start or other.end <= match.start for other in taken):
                taken.append(match)
        return sorted(taken, key=lambda m: m.start)


_WORD = re.compile(r"\w+")
# Scripts written without spaces between words: a term there is a run of characters, not a word.
_UNSPACED = re.compile(r"[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


def _unspaced(text: str) -> bool:
    return _UNSPACED.search(text) is not None


def _edge_ok(sentence: str, at: int, inner: str) -> bool:
    """Whether the character at `at` (just outside a match) ends a word there: no word character continues one that
    the term's edge character `inner` is part of."""
    if at < 0 or at >= len(sentence) or not _word_char(inner):
        return True
    return not _word_char(sentence[at])


def _word_char(char: str) -> bool:
    """A letter, digit, underscore or combining mark (a vowel sign of Hindi, Bengali, Thai is part of its word)."""
    return char.isalnum() or char == "_" or unicodedata.category(char).startswith("M")


@lru_cache(maxsize=64)
def term_index(terms: tuple[Term, ...]) -> TermIndex:
    """The index of a request's glossary; the same glossary (a stored one, reused by many calls) is indexed once."""
    return TermIndex(terms)


def occurrences(text: str, target: str) -> int:
    """How many times `target` stands in `text`, not overlapping."""
    return text.count(target) if target else 0


def target_ids(tokenizer: TextTokenizer, target: str) -> tuple[int, ...]:
    """The target's token ids as the decoder writes them mid-sentence; empty where the vocabulary cannot spell the
    target back verbatim (a character it lacks, a form its normalisation changes): such a term is not forced."""
    ids = tokenizer.encode_target(target)[:-1]  # without EOS
    return tuple(ids) if ids and tokenizer.decode(ids) == " ".join(target.split()) else ()
