"""How many queue places a call holds when it is admitted, counted before its texts are split.

Admission (`Engine.admission`) comes before any splitting or tokenizing, so it needs the request's
sentence count before pysbd gives it. `sentences_to_hold` counts it at C speed: a text's pieces
between sentence punctuation followed by whitespace, and between line breaks, that hold a letter or a
digit. It can count more than pysbd finds ("z. B." is two ends to it, none to pysbd): the places over
the true count are freed when the call submits; a call refused for them met a queue within a few
places of full. Counting fewer (one per text) would admit a whole burst of long texts and refuse it
only after splitting each: every refusal would wait behind that work.
"""

from __future__ import annotations

import re

_PUNCTUATION = r".!?\u2026\u3002\uff01\uff1f"  # ends a sentence where whitespace follows
_CLOSING = r"\"'\u00bb\u201d\u2019)\]"  # quotes and brackets that close the sentence before that whitespace
_LINE_BREAK = r"\n\r\v\f\x1c-\x1e\x85\u2028\u2029"  # always ends a sentence
# A sentence end: punctuation, closing quotes or brackets, whitespace; or line breaks. One character class first
# (the lookbehinds then tell which end it begins), so the regex engine skips to such a character at C speed: two
# alternatives at the top would each be tried at every character of every call's text, on the event loop
_SENTENCE_END = re.compile(
    rf"[{_PUNCTUATION}{_LINE_BREAK}]"
    rf"(?:(?<=[{_PUNCTUATION}])[{_PUNCTUATION}]*[{_CLOSING}]*\s+|(?<=[{_LINE_BREAK}])[{_LINE_BREAK}]*)"
)
_LETTER_OR_DIGIT = re.compile(r"[^\W_]")  # what str.isalnum accepts: a text without one has no sentence


def counted_sentences(text: str) -> int:
    """Sentences `text` appears to hold: its pieces between sentence ends that have a letter or a digit."""
    if not _LETTER_OR_DIGIT.search(text):
        return 0
    return sum(1 for piece in _SENTENCE_END.split(text) if _LETTER_OR_DIGIT.search(piece))


def sentences_to_hold(texts: list[str], max_sentences: int) -> int:
    """Queue places to hold for a request: its counted sentences. Where they exceed the request limit, one
    per text with a letter or a digit (or none, if even that is over it): such a request must get its
    INVALID_ARGUMENT from the splitting, rather than "queue full, retry" while the queue is busy."""
    counted = sum(counted_sentences(text) for text in texts)
    if counted <= max_sentences:
        return counted
    least = sum(1 for text in texts if _LETTER_OR_DIGIT.search(text))
    return least if least <= max_sentences else 0
