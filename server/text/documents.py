"""Texts to sentence sources and sentence results back to texts: the request's shape around the engine.

The engine sees one flat list of sentences per request; this module remembers which text and which
position each sentence came from, and joins finished sentences with their text's original
whitespace. A text with nothing to translate (no letter or digit: blank, punctuation, symbols,
control characters) has no sentences, never reaches the engine and comes back unchanged, with one
hypothesis (itself, score 0) and zero tokens and sentences.

A sentence over the model's source token limit is translated in parts, never refused: cut at clause
boundaries, then at whitespace, then between characters (server.text.clauses). Each part is a sentence
to the engine and to the counts of the result, and the parts' translations are joined with the
whitespace that stood at each cut, or a space after a CJK comma into a script written with spaces.

The model sees a sentence without its control characters (Unicode Cc: NUL, ESC, DEL, C1) and format
characters (Cf: zero-width space, bidi marks, soft hyphens, BOM, word joiner): the tokenizer has no
pieces for most of them, so they would reach the model as unknown tokens; removed, a word they were
inside ("Haus\u00adtür") is the word again. Tabs and other whitespace controls stay, and so do the
zero-width non-joiner and joiner (U+200C, U+200D), which Persian, Hindi, Bengali, Malayalam and other
scripts need to spell words correctly (in Persian, "mi\u200cxâham", I want, is spelt with one).
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from model.tokenizer import TextTokenizer
from server.core.beam import Hypothesis
from server.text.clauses import Encode, Parts, UncuttableError, cut, joints
from server.text.splitter import Split, join, split
from server.text.tag_placement import Boundaries, TagPlacement
from server.text.terms import Term, TermIndex, occurrences, target_ids


class TextLimitError(ValueError):
    """A request text breaks a documented limit; the message names the text (by its place, never quoting it), the
    limit and what to do."""


@dataclass(frozen=True)
class RequestLimits:
    """Documented per-request limits (mirrored in the proto comments and ListModels)."""

    max_texts: int = 256  # texts in one request
    max_chars_per_text: int = 10_000  # characters (code points) in one text
    max_sentences: int = 512  # sentences in one request after splitting
    max_beam_size: int = 8  # widest beam a request may ask for
    max_response_bytes: int = 16 * 1024 * 1024  # the server's gRPC send limit, for one Translate response
    max_markup_depth: int = 256  # HTML/XML: elements open inside one another
    max_markup_units: int = 512  # HTML/XML: units (blocks and translated attributes) in one request
    # HTML/XML: characters of one document, markup included (a web page's markup is most of it); the text it
    # translates counts against max_chars_per_text
    max_markup_chars_per_text: int = 100_000


@dataclass(frozen=True)
class PreparedText:
    """One request text, split and tokenized."""

    index: int  # position in the request
    split: Split  # sentences (one over the token limit as its parts) and the whitespace around them
    sources: list[list[int]]  # tag + pieces + EOS, one per piece of `split`
    terms: list[tuple[Term, ...]] = field(default_factory=list)  # per piece: the glossary terms found in it; [] none


@dataclass(frozen=True)
class TermsUsed:
    """A text's glossary terms: found in its source, and used by its translation."""

    requested: int = 0
    applied: int = 0

    def __add__(self, other: TermsUsed) -> TermsUsed:
        return TermsUsed(self.requested + other.requested, self.applied + other.applied)


@dataclass(frozen=True)
class TextTranslation:
    """The finished translation of one request text."""

    index: int  # position in the request
    hypotheses: list[tuple[str, float]]  # (text, summed normalised score), best first; never empty
    input_tokens: int  # source tokens over the text's sentences
    output_tokens: int  # tokens of the best hypothesis over the text's sentences
    sentences: int  # sentences translated
    tag_placement: TagPlacement = TagPlacement.NONE  # HTML/XML: how inline tags reached the translation
    # Per hypothesis: (offset in the text, offset in the translation) where each sentence starts and ends, in
    # order; markup keeps a tag that stood at a sentence's edge at that sentence's edge. Empty for a blank text.
    boundaries: tuple[Boundaries, ...] = ()
    terms: TermsUsed = TermsUsed()  # its glossary terms, found and used

    @property
    def translation(self) -> str:
        return self.hypotheses[0][0]


@dataclass(frozen=True)
class PartialSentence:
    """Output so far of one sentence (streaming)."""

    text_index: int  # position of the text in the request
    sentence_index: int  # position of the sentence in its text
    text: str  # detokenized output so far, or the final best hypothesis
    finished: bool


@dataclass(frozen=True)
class TextRefused:
    """A text refused alone (the request allows partial results): the request's other texts are still translated."""

    index: int  # position in the request
    error: Exception  # what refusing the whole request would have raised: a TextLimitError, or the edge's own


Refuse = Callable[[TextRefused], None]  # takes one text's refusal; where a caller passes none, the refusal is raised


def request_text(index: int) -> str:
    """How a limit's message names text `index` of a request."""
    return f"texts[{index}]"


def prepare_texts(
    texts: list[str],
    source_lang: str,
    target_lang: str,
    tokenizer: TextTokenizer,
    limits: RequestLimits,
    max_tokens: int,
    names: Callable[[int], str] = request_text,
    on_cut: Callable[[int], None] | None = None,
    model_source: str | None = None,
    refuse: Refuse | None = None,
    glossary: TermIndex | None = None,
) -> list[PreparedText]:
    """Split and tokenize every text, a sentence over `max_tokens` as its parts (server.text.clauses); reject (never
    truncate) anything over a limit, naming the text by `names` (a markup document's units are named by their
    document). `on_cut` is told the parts of each sentence cut, once every text is prepared. `model_source`: the
    model's code of the source language, which the tokenizer writes where its scheme does (NLLB, M2M100). `refuse`
    takes a text over a limit, which is then left out (its sentences uncounted); without it, the limit is raised.
    `glossary`: the terms each piece's translation must use, found in the text the model reads."""
    prepared: list[PreparedText] = []
    sentences = 0
    cuts: list[int] = []  # parts of each sentence cut
    encode = partial(source_ids, tokenizer, target_lang, model_source)
    for index, text in enumerate(texts):
        try:
            parts = split(text, source_lang)
            counted = _counted(sentences + len(parts.pieces), limits, names(index))
            fitted = _Fitted(parts, [encode(piece) for piece in parts.pieces], [])
            if any(len(ids) > max_tokens for ids in fitted.sources):
                fitted = _fitted(parts, fitted.sources, encode, max_tokens, names(index))
                counted = _counted(counted + len(fitted.split.pieces) - len(parts.pieces), limits, names(index))
        except TextLimitError as err:
            if refuse is None:
                raise
            refuse(TextRefused(index, err))
            continue
        sentences, cuts = counted, cuts + fitted.cuts
        terms = [] if glossary is None else [_found(glossary, piece) for piece in fitted.split.pieces]
        prepared.append(PreparedText(index, fitted.split, fitted.sources, terms))
    if on_cut is not None:
        for count in cuts:
            on_cut(count)
    return prepared


def _found(glossary: TermIndex, piece: str) -> tuple[Term, ...]:
    return tuple(match.term for match in glossary.find(model_text(piece)))


def source_ids(tokenizer: TextTokenizer, target_lang: str, model_source: str | None, text: str) -> list[int]:
    """The ids the model reads for `text` from `model_source` toward `target_lang`."""
    return tokenizer.encode_source(model_text(text), target_lang, model_source)


def _counted(sentences: int, limits: RequestLimits, name: str) -> int:
    """`sentences`, the request's so far (parts of a cut sentence each count), if within the limit."""
    if sentences > limits.max_sentences:
        raise TextLimitError(
            f"the request splits into more than {limits.max_sentences} sentences (limit reached at "
            f"{name}); send fewer or shorter texts per request"
        )
    return sentences


@dataclass(frozen=True)
class _Fitted:
    split: Split  # a text's sentences, each over the limit as its parts
    sources: list[list[int]]  # per piece of `split`
    cuts: list[int]  # parts of each sentence cut


def _fitted(parts: Split, sources: list[list[int]], encode: Encode, max_tokens: int, name: str) -> _Fitted:
    """A text's sentences with each over `max_tokens` replaced by its parts, the whitespace at each cut kept."""
    pieces, separators, fitted, cuts = [], [parts.separators[0]], [], []
    for position, (piece, ids, after) in enumerate(zip(parts.pieces, sources, parts.separators[1:], strict=True)):
        over = len(ids) > max_tokens
        sentence = _cut(piece, encode, max_tokens, f"{name} sentence {position}") if over else _whole(piece, ids)
        separators[-1] += sentence.split.separators[0]
        separators += [*sentence.split.separators[1:-1], sentence.split.separators[-1] + after]
        pieces += sentence.split.pieces
        fitted += sentence.sources
        cuts += [len(sentence.sources)] if over else []
    return _Fitted(Split(pieces, separators), fitted, cuts)


def _whole(sentence: str, ids: list[int]) -> Parts:
    return Parts(Split([sentence], ["", ""]), [ids])


def _cut(sentence: str, encode: Encode, max_tokens: int, name: str) -> Parts:
    try:
        return cut(sentence, encode, max_tokens)
    except UncuttableError as err:
        raise TextLimitError(f"{name} cannot be cut into parts of at most {max_tokens} tokens: {err}") from err


SPELLING_FORMAT_CHARACTERS = frozenset("\u200c\u200d")  # zero-width non-joiner and joiner: part of the spelling


def model_text(sentence: str) -> str:
    """`sentence` without its control and format characters (Cc, Cf) other than whitespace and the joiners
    scripts spell with: what the model sees."""
    if sentence.isprintable():  # the common case: no Cc or Cf at all
        return sentence
    return "".join(c for c in sentence if _model_sees(c)).strip()


def _model_sees(char: str) -> bool:
    return char.isspace() or char in SPELLING_FORMAT_CHARACTERS or unicodedata.category(char) not in ("Cc", "Cf")


@dataclass
class _Pending:
    text: PreparedText
    results: list[list[Hypothesis] | None]  # per sentence; None until it is done
    input_tokens: list[int]
    remaining: int


@dataclass
class Assembler:
    """Maps the engine's flat sentence indices back to texts; finishes a text when its last sentence is done."""

    tokenizer: TextTokenizer
    texts: list[PreparedText]
    num_hypotheses: int
    _where: list[tuple[int, int]] = field(default_factory=list)  # flat sentence index -> (text slot, position)
    _pending: list[_Pending] = field(default_factory=list)
    _targets: dict[str, tuple[int, ...]] = field(default_factory=dict)  # a term's target ids, by its target

    def __post_init__(self) -> None:
        for slot, text in enumerate(self.texts):
            n = len(text.sources)
            self._pending.append(_Pending(text, [None] * n, [0] * n, n))
            self._where += [(slot, position) for position in range(n)]

    @property
    def sources(self) -> list[list[int]]:
        """Every sentence of the request in order: what the engine decodes."""
        return [ids for text in self.texts for ids in text.sources]

    def terms(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Per sentence of `sources`, the target ids of each glossary term found in it (`DecodeOptions.terms`); empty
        where no sentence has any."""
        found = [terms for text in self.texts for terms in (text.terms or [()] * len(text.sources))]
        if not any(found):
            return ()
        return tuple(tuple(self._target_ids(term.target) for term in terms) for terms in found)

    def _target_ids(self, target: str) -> tuple[int, ...]:
        if target not in self._targets:
            self._targets[target] = target_ids(self.tokenizer, target)
        return self._targets[target]

    def blank_texts(self) -> list[TextTranslation]:
        """Texts without sentences (nothing to translate), finished at once with their text unchanged."""
        return [self._finish(p) for p in self._pending if p.remaining == 0]

    def partial(self, sentence_index: int, tokens: tuple[int, ...], finished: bool) -> PartialSentence:
        slot, position = self._where[sentence_index]
        return PartialSentence(self.texts[slot].index, position, self.tokenizer.decode(list(tokens)), finished)

    def sentence_done(
        self, sentence_index: int, hypotheses: list[Hypothesis], input_tokens: int
    ) -> TextTranslation | None:
        """Record a finished sentence; return its text's translation if that was the text's last sentence."""
        if not hypotheses:
            raise ValueError(f"sentence {sentence_index} finished without hypotheses")
        slot, position = self._where[sentence_index]
        pending = self._pending[slot]
        if pending.results[position] is not None:
            raise ValueError(f"sentence {sentence_index} finished twice")
        pending.results[position] = hypotheses
        pending.input_tokens[position] = input_tokens
        pending.remaining -= 1
        return self._finish(pending) if pending.remaining == 0 else None

    def _finish(self, pending: _Pending) -> TextTranslation:
        text = pending.text
        results = [r for r in pending.results if r is not None]
        if not results:
            original = join(text.split.pieces, text.split.separators)
            return TextTranslation(text.index, [(original, 0.0)], 0, 0, 0)
        count = min(self.num_hypotheses, max(len(r) for r in results))
        ranked = [self._nth(text, results, rank) for rank in range(count)]
        output_tokens = sum(len(r[0].tokens) for r in results)
        return TextTranslation(
            text.index,
            [(translation, score) for translation, score, _ in ranked],
            sum(pending.input_tokens),
            output_tokens,
            len(results),
            boundaries=tuple(boundaries for _, _, boundaries in ranked),
            terms=self._terms_used(text, results),
        )

    def _terms_used(self, text: PreparedText, results: list[list[Hypothesis]]) -> TermsUsed:
        """How many of the text's glossary terms its sentences' best translations use as often as their sources."""
        if not any(text.terms):
            return TermsUsed()
        requested = applied = 0
        for terms, result in zip(text.terms, results, strict=True):
            if not terms:
                continue
            translation = self.tokenizer.decode(list(result[0].tokens))
            for target, needed in Counter(term.target for term in terms).items():
                requested += needed
                applied += min(needed, occurrences(translation, target))
        return TermsUsed(requested, applied)

    def _nth(self, text: PreparedText, results: list[list[Hypothesis]], rank: int) -> tuple[str, float, Boundaries]:
        """The text's rank-th hypothesis (each sentence's rank-th best, or its last if it has fewer), its score and
        its sentences' boundaries."""
        chosen = [r[min(rank, len(r) - 1)] for r in results]
        pieces = [self.tokenizer.decode(list(h.tokens)) for h in chosen]
        between = joints(text.split, pieces)
        translation = join(pieces, between)
        return translation, sum(h.normalized for h in chosen), sentence_boundaries(text.split, pieces, between)


def sentence_boundaries(parts: Split, translated: list[str], between: list[str] | None = None) -> Boundaries:
    """Where each sentence of `parts` and of its translation (`translated`, joined with `between`, else with the
    same separators) starts and ends."""
    pairs: list[tuple[int, int]] = []
    source = target = 0
    joined = parts.separators if between is None else between
    for separator, joint, piece, translation in zip(
        parts.separators[:-1], joined[:-1], parts.pieces, translated, strict=True
    ):
        source, target = source + len(separator), target + len(joint)
        pairs.append((source, target))
        source, target = source + len(piece), target + len(translation)
        pairs.append((source, target))
    return tuple(pairs)
