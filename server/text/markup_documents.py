"""A request's texts as the engine's sentences and back, for plain text and for HTML/XML documents.

`prepare_request` gives the servicer one assembler whatever the text type. For markup, each
document's units (server.text.markup) become the texts that are split and tokenized; a document is
finished when its last unit is, and rendered once per hypothesis rank. Partial output names the
document and the sentence's position in it, counted over its units in order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from model.tokenizer import TextTokenizer
from server.core.beam import Hypothesis
from server.text.documents import (
    Assembler,
    PartialSentence,
    PreparedText,
    Refuse,
    RequestLimits,
    TermsUsed,
    TextLimitError,
    TextRefused,
    TextTranslation,
    request_text,
)
from server.text.markup import MarkupDepthError, MarkupDocument, TextType, parse
from server.text.placeholders import Placeholders
from server.text.tag_placement import TagPlacement


class RequestAssembler(Protocol):
    """What the servicer drives: the sentences to decode, and texts as their sentences finish."""

    @property
    def sources(self) -> list[list[int]]: ...

    def terms(self) -> tuple[tuple[tuple[int, ...], ...], ...]: ...  # per sentence, its glossary terms' target ids

    def blank_texts(self) -> list[TextTranslation]: ...

    def partial(self, sentence_index: int, tokens: tuple[int, ...], finished: bool) -> PartialSentence: ...

    def sentence_done(
        self, sentence_index: int, hypotheses: list[Hypothesis], input_tokens: int
    ) -> TextTranslation | None: ...


class Prepare(Protocol):
    """`prepare_texts` with the request's languages, tokenizer and limits bound."""

    def __call__(
        self, texts: list[str], names: Callable[[int], str] = ..., refuse: Refuse | None = ...
    ) -> list[PreparedText]: ...


def prepare_request(
    texts: list[str],
    text_type: TextType,
    prepare: Prepare,  # prepare_texts with the request's languages bound
    tokenizer: TextTokenizer,
    limits: RequestLimits,
    num_hypotheses: int,
    positions: Sequence[int] | None = None,
    refuse: Refuse | None = None,
    placeholders: Placeholders = Placeholders.KEEP,
) -> RequestAssembler:
    """The request's assembler; TextLimitError for a limit broken (depth, units, or prepare's own), naming the
    text by its position in the client's request (`positions[i]` for texts[i]: a request whose source is detected
    runs as one part per language). `refuse` takes each text over a limit (or the one that takes the request past
    it), and the others are prepared. Plain texts whose placeholders are kept are read as documents of one unit
    each, so that their placeholders are placed as inline tags are."""
    at = list(range(len(texts))) if positions is None else list(positions)
    if text_type is TextType.TEXT and placeholders is Placeholders.OFF:
        prepared = prepare(texts, names=lambda index: request_text(at[index]), refuse=refuse)
        return Assembler(tokenizer, prepared, num_hypotheses)
    documents = _documents(texts, text_type, limits, at, refuse, placeholders)
    units = [unit for document in documents.values() for unit in document.units]
    owners = [_named(at[index], place) for index, document in documents.items() for place in document.places]
    refused: list[TextRefused] = []
    prepared = prepare(units, names=owners.__getitem__, refuse=None if refuse is None else refused.append)
    if refuse is not None and refused:
        prepared = _without_refused_units(refused, documents, prepared, refuse)
    return MarkupAssembler(Assembler(tokenizer, prepared, num_hypotheses), documents, num_hypotheses)


def _named(index: int, place: str) -> str:
    """How a limit's message names a unit: by its text, and where in it the unit is (a plain text's one unit has
    no place)."""
    return f"{request_text(index)} ({place})" if place else request_text(index)


def _documents(
    texts: list[str],
    text_type: TextType,
    limits: RequestLimits,
    at: list[int],
    refuse: Refuse | None,
    placeholders: Placeholders,
) -> dict[int, MarkupDocument]:
    """The texts parsed, by index, within the markup limits; one over them refused (from the first that takes the
    request past max_markup_units), or the limit raised where there is no `refuse`."""
    documents: dict[int, MarkupDocument] = {}
    for index, text in enumerate(texts):
        try:
            documents[index] = parse_document(at[index], text, text_type, limits, placeholders)
        except TextLimitError as err:
            if refuse is None:
                raise
            refuse(TextRefused(index, err))
    if (units := sum(len(document.units) for document in documents.values())) <= limits.max_markup_units:
        return documents
    if refuse is None:
        raise _too_many_units(units, limits)
    units = 0
    for index, document in list(documents.items()):
        if units + len(document.units) > limits.max_markup_units:
            refuse(TextRefused(index, _too_many_units(units + len(document.units), limits)))
            del documents[index]
        else:
            units += len(document.units)
    return documents


def _too_many_units(units: int, limits: RequestLimits) -> TextLimitError:
    return TextLimitError(
        f"the request's markup has {units} units to translate (blocks and attributes), over the limit"
        f" of {limits.max_markup_units}; send fewer or shorter documents per request"
    )


def _without_refused_units(
    refused: list[TextRefused], documents: dict[int, MarkupDocument], prepared: list[PreparedText], refuse: Refuse
) -> list[PreparedText]:
    """The documents (in place) less those with a unit `refused`, each refused whole through `refuse`, and the other
    documents' units, numbered anew."""
    owner = [index for index, document in documents.items() for _ in document.units]  # by unit
    for unit in refused:
        if owner[unit.index] in documents:
            refuse(TextRefused(owner[unit.index], unit.error))
            del documents[owner[unit.index]]
    kept = [text for text in prepared if owner[text.index] in documents]
    return [replace(text, index=slot) for slot, text in enumerate(kept)]


def parse_document(
    index: int, text: str, text_type: TextType, limits: RequestLimits, placeholders: Placeholders = Placeholders.KEEP
) -> MarkupDocument:
    """Request text `index` as a document within the markup limits; TextLimitError naming the one it breaks."""
    try:
        document = parse(text, text_type, limits.max_markup_depth, placeholders)
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

    def __init__(self, units: Assembler, documents: Mapping[int, MarkupDocument], num_hypotheses: int) -> None:
        """`documents` by their text's position in the request."""
        self._units = units
        self._num_hypotheses = num_hypotheses
        self._documents = [_Document(d, i, [None] * len(d.units), len(d.units)) for i, d in documents.items()]
        self._owner: list[tuple[int, int]] = []  # unit text -> (document, unit position)
        self._first_sentence: list[int] = []  # unit text -> its first sentence's position in its document
        for slot, document in enumerate(documents.values()):
            sentences = 0
            for position in range(len(document.units)):
                self._owner.append((slot, position))
                self._first_sentence.append(sentences)
                sentences += len(units.texts[len(self._owner) - 1].sources)

    @property
    def sources(self) -> list[list[int]]:
        return self._units.sources

    def terms(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        return self._units.terms()

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
            terms=sum((r.terms for r in results), TermsUsed()),
        )
