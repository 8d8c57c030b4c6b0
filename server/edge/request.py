"""A Translate request as the servicer hands it on: typed once (`server.edge.messages.from_pb`), its codes
trimmed and its enums checked; routing, detection and splitting read this, never the client's message.

Checks that need a model (decoding options against its limits, the pair against its languages) are made once
the request is routed (`server.edge.convert`, `server.edge.backends`); the checks of the request alone are here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from server.edge.refusals import Refusal
from server.text.documents import Refuse, RequestLimits, TextRefused
from server.text.markup import TextType
from server.text.placeholders import Placeholders
from server.text.terms import Term

# Longer than any language code (a BCP-47 tag with a variant and an extension stays under 40) or model name (a hub id
# with its `@sha`): refused before routing, which caches what it sees and echoes codes in its messages.
MAX_LANGUAGE_CODE_CHARS = 64
MAX_MODEL_NAME_CHARS = 256
UNDETERMINED = ("auto", "und")  # a source left to detection, as an empty one is (`und`: BCP-47's "undetermined")


@dataclass(frozen=True)
class CallOptions:
    """How the client asks for its texts to be translated (TranslationOptions), typed."""

    source_language: str = ""  # the client's code, trimmed; "" leaves it to detection (also `auto`, `und`, `und-*`)
    target_language: str = ""  # the client's code, trimmed; routing matches both to a model's codes
    model: str = ""  # the model's name, trimmed; "" = whichever serves the pair best
    beam_size: int | None = None  # None: the model's default, within the server's widest beam
    length_penalty: float | None = None  # None: the model's default for the direction
    max_output_len: int = 0  # 0 = the model's default
    num_hypotheses: int | None = None  # None: 1
    return_scores: bool = False
    stream_tokens: bool = False  # partial sentences while decoding (TranslateStream only)
    text_type: TextType = TextType.TEXT  # how the texts are read: plain, HTML or XML
    placeholders: Placeholders = Placeholders.KEEP  # what becomes of the texts' placeholders
    # Terms the translation must use: the request's inline entries, then its stored glossary's whose source no inline
    # entry has (`server.edge.glossary_terms`), each trimmed and checked; () for none. The stored glossary's id stays
    # at the servicer, which puts its terms here before routing.
    glossary: tuple[Term, ...] = ()


@dataclass(frozen=True)
class TranslateCall:
    """A Translate request: its texts and options, typed and trimmed."""

    texts: tuple[str, ...]  # as the client sent them, in its order
    options: CallOptions
    allow_partial: bool = False  # a text refused alone comes back as its own error (TranslateRequest.allow_partial)

    def at(self, indices: list[int]) -> TranslateCall:
        """The request with only its texts at `indices`."""
        if indices == list(range(len(self.texts))):
            return self
        return replace(self, texts=tuple(self.texts[i] for i in indices))


def client_code(name: str, value: str, limit: int) -> str:
    """A language code or model name as routing reads it: within `limit` characters, trimmed of whitespace."""
    if len(value) > limit:
        raise Refusal.CODE_TOO_LONG.error(name=name, length=len(value), limit=limit, begins=value[:20])
    return value.strip()


def source_code(value: str) -> str:
    """The client's source code, trimmed; "" where it asks for detection (`auto`, `und`, `und-Latn`, any case)."""
    source = client_code("source_language", value, MAX_LANGUAGE_CODE_CHARS)
    lowered = source.lower()
    return "" if lowered in UNDETERMINED or lowered.startswith(("und-", "und_")) else source


def check_texts(call: TranslateCall, limits: RequestLimits, refuse: Refuse | None = None) -> list[int]:
    """The positions of the request's texts within the limits on their number and length; InvalidRequest naming
    the first over, or with `refuse`, each text over its length refused alone. An HTML or XML document is bounded
    as a whole here and by the text it translates once parsed (`server.text.markup_documents`)."""
    texts = call.texts
    if not texts:
        raise Refusal.NO_TEXTS.error(max_texts=limits.max_texts)
    if len(texts) > limits.max_texts:
        raise Refusal.TOO_MANY_TEXTS.error(texts=len(texts), max_texts=limits.max_texts)
    markup = call.options.text_type is not TextType.TEXT
    limit = limits.max_markup_chars_per_text if markup else limits.max_chars_per_text
    kept: list[int] = []
    for index, text in enumerate(texts):
        if len(text) <= limit:
            kept.append(index)
            continue
        what = "document" if markup else "text"
        refusal = Refusal.TEXT_TOO_LONG.error(index=index, chars=len(text), limit=limit, what=what)
        if refuse is None:
            raise refusal
        refuse(TextRefused(index, refusal))
    return kept
