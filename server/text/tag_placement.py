"""Where inline tags go in a translated sentence when the model gives no alignment: proportional placement.

A unit's tags sit at character offsets of its source text. Each is moved to the same relative offset
of the translation, then to the nearest word edge there (an opening tag to a word's start, a closing
one to a word's end), never before the tag that preceded it, so every tag keeps its order and the
tag tree is the source's. Two tags that had words between them in the source get at least one word
between them in the translation when it has one left: a link never ends up empty.
"""

from __future__ import annotations

import enum
from bisect import bisect_left, bisect_right
from collections.abc import Sequence

Boundaries = tuple[tuple[int, int], ...]  # (source offset, translation offset) pairs, both non-decreasing


class TagPlacement(enum.Enum):
    """How a result's inline tags were carried into its translation (reported per result)."""

    NONE = "none"  # no tag had to move: plain text, or markup whose units kept their text
    PROPORTIONAL = "proportional"  # the fallback here: relative offsets snapped to word edges


class Edge(enum.Enum):
    OPEN = "open"  # snaps to the start of a word
    CLOSE = "close"  # snaps to the end of a word
    ANY = "any"  # a tag or kept piece with no text of its own here: anywhere but inside a word


_APOSTROPHES = frozenset("'\u2019")


def word_edges(text: str) -> tuple[list[int], list[int], list[int]]:
    """Offsets where a word starts, where one ends (each with 0 and len(text)), and every offset not inside one.
    A word is a run of letters and digits, apostrophes between two of them included (`that's`, `l'homme`, and
    the same with U+2019, the typographic apostrophe), so no tag lands inside a contraction."""
    in_word = [
        char.isalnum()
        or (char in _APOSTROPHES and 0 < i < len(text) - 1 and text[i - 1].isalnum() and text[i + 1].isalnum())
        for i, char in enumerate(text)
    ]
    starts, ends, outside = {0}, {len(text)}, []
    for i in range(len(text) + 1):
        before = i > 0 and in_word[i - 1]
        after = i < len(text) and in_word[i]
        if after and not before:
            starts.add(i)
        if before and not after:
            ends.add(i)
        if not (before and after):
            outside.append(i)
    return sorted(starts), sorted(ends), outside


def place(
    offsets: Sequence[int], edges: Sequence[Edge], source: str, target: str, boundaries: Boundaries = ()
) -> list[int]:
    """The offsets in `target` for tags at `offsets` (non-decreasing) of `source`; non-decreasing too.

    `boundaries` pairs the edges of the source's sentences with their translations' (the server translates a
    unit sentence by sentence, so it knows them): a tag at a sentence's edge goes to the translation's edge, and
    one inside a sentence to the same share of its translation, so `<b>First.</b> Second.` keeps its bold on
    the first sentence however the two sentences' lengths change.

    Every search is a bisection over sorted offsets, so a unit of n tags costs O(n log n): a document of
    thousands of tags renders in milliseconds."""
    starts, ends, outside = word_edges(target)
    choices = {Edge.OPEN: starts, Edge.CLOSE: ends, Edge.ANY: outside}
    fixed = sorted([(0, 0), *boundaries, (len(source), len(target))])
    fixed_at = [s for s, _ in fixed]
    source_words, target_words = _letters_before(source), _letters_before(target)
    placed: list[int] = []
    for index, (offset, edge) in enumerate(zip(offsets, edges, strict=True)):
        floor = placed[-1] if placed else 0
        at = bisect_left(fixed_at, offset)
        if at < len(fixed) and fixed_at[at] == offset:  # a sentence's edge
            placed.append(max(fixed[at][1], floor))
            continue
        (s0, t0), (s1, t1) = fixed[at - 1], fixed[bisect_right(fixed_at, offset)]
        expected = t0 + (offset - s0) * (t1 - t0) / (s1 - s0)
        sorted_choices = choices[edge]
        low, high = bisect_left(sorted_choices, max(t0, floor)), bisect_right(sorted_choices, t1)
        if low >= high:  # none within the sentence: any at or after the floor, else the end
            low, high = bisect_left(sorted_choices, floor), len(sorted_choices)
        if low == high:
            placed.append(len(target))
            continue
        position = _nearest(sorted_choices, low, high, expected)
        words_between = source_words[offset] > source_words[offsets[index - 1]] if index else False
        if words_between and target_words[position] == target_words[floor]:  # a link would end up empty
            after_word = bisect_right(sorted_choices, _first_letter(target_words, floor), low, high)
            position = sorted_choices[after_word] if after_word < high else position
        placed.append(position)
    return placed


def _letters_before(text: str) -> list[int]:
    """counts[i]: how many letters and digits text[:i] holds, so any slice's count is one subtraction."""
    counts = [0]
    for char in text:
        counts.append(counts[-1] + char.isalnum())
    return counts


def _first_letter(counts: list[int], start: int) -> int:
    """The offset of the first letter or digit at or after `start` (len(text) when none)."""
    return bisect_right(counts, counts[start]) - 1


def _nearest(values: list[int], low: int, high: int, expected: float) -> int:
    """The value of values[low:high] (sorted, not empty) nearest to `expected`, the smaller one on a tie."""
    k = bisect_left(values, expected, low, high)
    if k == high:
        return values[high - 1]
    if k > low and expected - values[k - 1] <= values[k] - expected:
        return values[k - 1]
    return values[k]
