"""A request's texts as the engine's sentences and back, for plain text and for HTML/XML documents.

`prepare_request` gives the servicer one assembler whatever the text type. For markup, each
document's units (server.core.markup) become the texts that are split and tokenized; a document is
finished when its last unit is, and rendered once per hypothesis rank. Partial output names the
document and the sentence's position in it, counted over its units in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from model.tokenizer import TextTokenizer
from server.core.beam import Hypothesis
from server.core.documents import (
    Assembler,
    PartialSentence,
    PreparedText,
    RequestLimits,
    TextLimitError,
    TextTranslation,
    request_text,
)
from server.core.markup import MarkupDepthError, MarkupDocument, TextType, parse
from server.core.tag_placement import TagPlacement


class RequestAssembler(Protocol):
    """What the servicer drives: the sentences to decode, and texts as their sentences finish."""

    @property
    def sources(self) -> list[list[int]]: ...

    def blank_texts(self) -> list[TextTranslation]: ...

    def partial(self, sentence_index: int, tokens: tuple[int, ...], finished: bool) -> PartialSentence: ...

    def sentence_done(
        self, sentence_index: int, hypotheses: list[Hypothesis], input_tokens: int
    ) -> TextTranslation | None: ...


class Prepare(Protocol):
    """`prepare_texts` with the request's languages, tokenizer and limits bound."""

    def __call__(self, texts: list[str], names: Callable[[int], str] = ...) -> list[PreparedText]: ...


def prepare_request(
    texts: list[str],
    text_type: TextType,
    prepare: Prepare,  # prepare_texts with the request's languages bound
    tokenizer: TextTokenizer,
    limits: RequestLimits,
    num_hypotheses: int,
    positions: Sequence[int] | None = None,
) -> RequestAssembler:
    """The request's assembler; TextLimitError for a limit broken (depth, units, or prepare's own), naming the
    text by its position in the client's request (`positions[i]` for texts[i]: a request whose source is detected
    runs as one part per language)."""
    at = list(range(len(texts))) if positions is None else list(positions)
    if text_type is TextType.TEXT:
        return Assembler(tokenizer, prepare(texts, names=lambda index: request_text(at[index])), num_hypotheses)
    documents = [parse_document(at[index], text, text_type, limits) for index, text in enumerate(texts)]
    units = [unit for document in documents for unit in document.units]
    if len(units) > limits.max_markup_units:
        raise TextLimitError(
            f"the request's markup has {len(units)} units to translate (blocks and attributes), over the limit"
            f" of {limits.max_markup_units}; send fewer or shorter documents per request"
        )
    owners = [f"texts[{at[index]}] ({place})" for index, document in enumerate(documents) for place in document.places]
    prepared = prepare(units, names=owners.__getitem__)
    return MarkupAssembler(Assembler(tokenizer, prepared, num_hypotheses), documents, num_hypotheses)


def parse_document(index: int, text: str, text_type: TextType, limits: RequestLimits) -> MarkupDocument:
    """Request text `index` as a document within the markup limits; TextLimitError naming the one it breaks."""
    try:
        document = parse(text, text_type, limits.max_markup_depth)
    except MarkupDepthError as err:
        raise TextLimitError(f"texts[{index}]: {err}, the limit; send flatter markup") from err
    if (chars := sum(len(unit) for unit in document.units)) > limits.max_chars_per_text:
        raise TextLimitError(
            f"texts[{index}] has {chars} characters of text to translate (blocks and attributes), over the limit of"
            f" {limits.max_chars_per_text} per text; split the document across requests"
        )
    return document


@dataclass
class _Document:
    markup: MarkupDocument
    index: int  # position in the request
    results: list[TextTranslation | None]  # per unit
    remaining: int


class MarkupAssembler:
    """Units to documents: wraps the Assembler of every document's units, in request order."""

    def __init__(self, units: Assembler, documents: list[MarkupDocument], num_hypotheses: int) -> None:
        self._units = units
        self._num_hypotheses = num_hypotheses
        self._documents = [_Document(d, i, [None] * len(d.units), len(d.units)) for i, d in enumerate(documents)]
        self._owner: list[tuple[int, int]] = []  # unit text -> (document, unit position)
        self._first_sentence: list[int] = []  # unit text -> its first sentence's position in its document
        for slot, document in enumerate(documents):
            sentences = 0
            for position in range(len(document.units)):
                self._owner.append((slot, position))
                self._first_sentence.append(sentences)
                sentences += len(units.texts[len(self._owner) - 1].sources)

    @property
    def sources(self) -> list[list[int]]:
        return self._units.sources

    def blank_texts(self) -> list[TextTranslation]:
        done = [d for unit in self._units.blank_texts() if (d := self._unit_done(unit)) is not None]
        return done + [self._finish(d) for d in self._documents if not d.results]

    def partial(self, sentence_index: int, tokens: tuple[int, ...], finished: bool) -> PartialSentence:
        unit = self._units.partial(sentence_index, tokens, finished)
        slot, _ = self._owner[unit.text_index]
        position = self._first_sentence[unit.text_index] + unit.sentence_index
        return PartialSentence(self._documents[slot].index, position, unit.text, unit.finished)

    def sentence_done(
        self, sentence_index: int, hypotheses: list[Hypothesis], input_tokens: int
    ) -> TextTranslation | None:
        unit = self._units.sentence_done(sentence_index, hypotheses, input_tokens)
        return None if unit is None else self._unit_done(unit)

    def _unit_done(self, unit: TextTranslation) -> TextTranslation | None:
        slot, position = self._owner[unit.index]
        document = self._documents[slot]
        document.results[position] = unit
        document.remaining -= 1
        return self._finish(document) if document.remaining == 0 else None

    def _finish(self, document: _Document) -> TextTranslation:
        results = [r for r in document.results if r is not None]
        count = min(self._num_hypotheses, max((len(r.hypotheses) for r in results), default=1))
        hypotheses, placement = [], TagPlacement.NONE
        for rank in range(count):
            chosen = [r.hypotheses[min(rank, len(r.hypotheses) - 1)] for r in results]
            boundaries = [r.boundaries[min(rank, len(r.boundaries) - 1)] if r.boundaries else () for r in results]
            text, moved = document.markup.render([translation for translation, _ in chosen], boundaries)
            hypotheses.append((text, sum(score for _, score in chosen)))
            if rank == 0 and moved:
                placement = TagPlacement.PROPORTIONAL
        return TextTranslation(
            document.index,
            hypotheses,
            sum(r.input_tokens for r in results),
            sum(r.output_tokens for r in results),
            sum(r.sentences for r in results),
            placement,
        )
