"""Texts to sentence sources and sentence results back to texts: the request's shape around the engine.

The engine sees one flat list of sentences per request; this module remembers which text and which
position each sentence came from, and joins finished sentences with their text's original
whitespace. A text with nothing to translate (no letter or digit: blank, punctuation, symbols,
control characters) has no sentences, never reaches the engine and comes back unchanged, with one
hypothesis (itself, score 0) and zero tokens and sentences.

The model sees a sentence without its control characters (Unicode Cc: NUL, ESC, DEL, C1) and format
characters (Cf: zero-width space, bidi marks, soft hyphens, BOM, word joiner): the tokenizer has no
pieces for most of them, so they would reach the model as unknown tokens; removed, a word they were
inside ("Haus\u00adtür") is the word again. Tabs and other whitespace controls stay, and so do the
zero-width non-joiner and joiner (U+200C, U+200D), which Persian, Hindi, Bengali, Malayalam and other
scripts need to spell words correctly (in Persian, "mi\u200cxâham", I want, is spelt with one).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field

from model.tokenizer import TextTokenizer
from server.core.beam import Hypothesis
from server.core.splitter import Split, join, split
from server.core.tag_placement import Boundaries, TagPlacement


class TextLimitError(ValueError):
    """A request text breaks a documented limit; the message names the text, the limit and what to do.

    `logged` is the message for the server's logs: the same, less any excerpt of the client's text it quotes
    (the access log holds no text of a request)."""

    def __init__(self, message: str, logged: str | None = None) -> None:
        super().__init__(message)
        self.logged = message if logged is None else logged


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
    split: Split  # sentences and the whitespace around them
    sources: list[list[int]]  # tag + pieces + EOS, one per sentence of `split`


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
) -> list[PreparedText]:
    """Split and tokenize every text; reject (never truncate) anything over a limit, naming the text by `names`
    (a markup document's units are named by their document)."""
    prepared: list[PreparedText] = []
    sentences = 0
    for index, text in enumerate(texts):
        parts = split(text, source_lang)
        sentences += len(parts.pieces)
        if sentences > limits.max_sentences:
            raise TextLimitError(
                f"the request splits into more than {limits.max_sentences} sentences (limit reached at "
                f"{names(index)}); send fewer or shorter texts per request"
            )
        sources = [tokenizer.encode_source(model_text(piece), target_lang) for piece in parts.pieces]
        for position, ids in enumerate(sources):
            if len(ids) > max_tokens:
                too_long = (
                    f"{names(index)} sentence {position} is {len(ids)} tokens long, over the limit of {max_tokens} "
                    "tokens per sentence (tag and end token included); "
                )
                piece = parts.pieces[position]
                raise TextLimitError(too_long + _shorter(piece, quoted=True), too_long + _shorter(piece, quoted=False))
        prepared.append(PreparedText(index, parts, sources))
    return prepared


def _shorter(sentence: str, quoted: bool) -> str:
    """What to do with a sentence over the token limit: split it, or, where a run of it has no space to split at (a
    URL, a hash, encoded data), keep that run out of what is translated; `quoted`: the run's start shown, for the
    client (never for the log: such runs are often tokens and keys)."""
    longest = max(sentence.split(), key=len, default="")
    if len(longest) * 2 < len(sentence):
        return "split it into shorter sentences"
    begins = f"{longest[:16]!r}...: " if quoted else ""
    return (
        f"{len(longest)} of its characters have no space to split at ({begins}a URL, code or encoded data?); send"
        ' such runs apart from the text to translate (in HTML, inside translate="no")'
    )


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

    def __post_init__(self) -> None:
        for slot, text in enumerate(self.texts):
            n = len(text.sources)
            self._pending.append(_Pending(text, [None] * n, [0] * n, n))
            self._where += [(slot, position) for position in range(n)]

    @property
    def sources(self) -> list[list[int]]:
        """Every sentence of the request in order: what the engine decodes."""
        return [ids for text in self.texts for ids in text.sources]

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
        )

    def _nth(self, text: PreparedText, results: list[list[Hypothesis]], rank: int) -> tuple[str, float, Boundaries]:
        """The text's rank-th hypothesis (each sentence's rank-th best, or its last if it has fewer), its score and
        its sentences' boundaries."""
        chosen = [r[min(rank, len(r) - 1)] for r in results]
        pieces = [self.tokenizer.decode(list(h.tokens)) for h in chosen]
        translation = join(pieces, text.split.separators)
        return translation, sum(h.normalized for h in chosen), sentence_boundaries(text.split, pieces)


def sentence_boundaries(parts: Split, translated: list[str]) -> Boundaries:
    """Where each sentence of `parts` and of its translation (`translated`, joined with the same separators) starts
    and ends."""
    pairs: list[tuple[int, int]] = []
    source = target = 0
    for separator, piece, translation in zip(parts.separators[:-1], parts.pieces, translated, strict=True):
        source, target = source + len(separator), target + len(separator)
        pairs.append((source, target))
        source, target = source + len(piece), target + len(translation)
        pairs.append((source, target))
    return tuple(pairs)
