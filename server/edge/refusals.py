"""Every way the edge refuses a request, each with the words of its message.

A rule's check raises `Refusal.X.error(...)` with the fields its message names; `server.edge.errors` maps the
InvalidRequest it gives to INVALID_ARGUMENT. A glossary id that names none is `not_found` (NOT_FOUND), a full
glossary store `unmet` (FAILED_PRECONDITION). The rules of decoding options are the core's
(`server.core.work.check_options`), shared with offline callers.
"""

from __future__ import annotations

from enum import Enum, unique

from server.edge.errors import FailedPrecondition, InvalidRequest, NotFound


@unique
class Refusal(Enum):
    """A refusal's message template (str.format fields); the members are the edge's validation errors."""

    # server.edge.request: the request as the client sent it
    CODE_TOO_LONG = "options.{name} is {length:,} characters long, over the limit of {limit} (it begins {begins!r})"
    TEXT_TYPE = "options.text_type must be TEXT, HTML or XML, got {value}"
    PLACEHOLDERS = "options.placeholders must be KEEP or OFF, got {value}"
    NO_TEXTS = "the request has no texts; send 1 to {max_texts} in `texts`"
    TOO_MANY_TEXTS = "the request has {texts} texts, over the limit of {max_texts}"
    TEXT_TOO_LONG = (
        "texts[{index}] has {chars} characters, over the limit of {limit} per {what}; split it across requests"
    )
    # server.edge.backends: the model and language pair it asks for
    UNKNOWN_MODEL = "unknown model {model!r}; this server serves {served}"
    NO_TARGET = "options.target_language is required; {pairs}"
    AMBIGUOUS = "{ambiguous}; {pairs}"
    SAME_LANGUAGE = (
        "source_language {source!r} and target_language {target!r} are the same language; name the"
        " language to translate into as target_language ({pairs})"
    )
    UNSUPPORTED_PAIR = "unsupported language pair {source!r} -> {target!r}; {nearest}{pairs}"
    NO_MODEL_INTO_TARGET = "no served model translates into target_language {target!r}; {pairs}"
    # server.edge.request_parts: a source left to detection
    NO_DETECTION = "source detection is not available on this server; set options.source_language"
    UNDECIDED = (
        "cannot tell the language of {texts} (no language ahead of the others by {margin}, and"
        " no other text of the request told); set options.source_language"
    )
    INDISTINCT = (
        "{texts} detected as {language!r}, which stands for {languages} among the served"
        " languages; detection cannot tell them apart: set options.source_language"
    )
    DETECTED_UNROUTED = "{texts} detected as {language!r} (confidence >= {confidence:.2f}): {refusal}"
    # server.edge.glossary_terms: glossary entries, names and languages, however they arrive
    TOO_MANY_ENTRIES = "{field} holds more than {limit:,} entries, the limit {per}"
    NO_ENTRIES = "the glossary has no entries; give 1 to {limit:,} in `entries` or `entries_text`"
    ENTRIES_TWICE = "give the entries once, in `entries` or in `entries_text`, not in both"
    ENTRIES_FORMAT = "entries_format must be TSV or CSV, got {value}"
    ENTRIES_LINE = "entries_text ({format}) {error}"
    LINE_LANGUAGES = (
        "entries_text line {line} is a {languages} entry, in a {glossary} glossary; leave a line's languages out or"
        " give the glossary's"
    )
    TERM_EMPTY = "{where} {side} is empty; a glossary term holds text"
    TOO_LONG = "{field} is {chars:,} characters long, over the limit of {limit}"
    CONTROL_CHARACTER = (
        "{field} holds {character}, a tab, line break or other control character; it must be one line of text"
    )
    DUPLICATE_SOURCE = "{where} source {source!r} is the source of {first} too; a glossary holds each source term once"
    NO_NAME = "name is empty; a glossary is named in 1 to {limit} characters"
    GLOSSARY_LANGUAGE = "{field} is required: the language of the glossary's {side} terms (not auto)"
    UNKNOWN_LANGUAGE = "{field} {code!r} is no language code; write it as a request's language is (de, pt-BR, deu)"
    GLOSSARY_SAME_LANGUAGE = (
        "source_language {source!r} and target_language {target!r} are the same language; a glossary maps the terms"
        " of one language to another's"
    )
    GLOSSARY_NEEDS_SOURCE = (
        "options.glossary_id needs options.source_language: glossary {glossary_id} holds {language!r} terms, and"
        " detection cannot choose a glossary"
    )
    GLOSSARY_LANGUAGES = (
        "glossary {glossary_id} is {glossary_source!r} -> {glossary_target!r}; the request asks for {source!r} ->"
        " {target!r}: give a glossary of the request's languages"
    )
    # server.edge.glossaries: the stored glossaries
    GLOSSARY_ID = "{field} {begins!r} is no glossary id: an id is the 36-character UUID that CreateGlossary returns"
    UNKNOWN_GLOSSARY = "no glossary {glossary_id} is stored (never created, or deleted); ListGlossaries lists them"
    STORE_FULL = "{count:,} glossaries are stored, the limit; delete one (DeleteGlossary) before creating another"

    def error(self, **fields: object) -> InvalidRequest:
        """The refusal with its fields filled in, to raise (or hand to a call's `refuse`)."""
        return InvalidRequest(self.value.format(**fields))

    def not_found(self, **fields: object) -> NotFound:
        """The refusal as NOT_FOUND: what the request names is not there."""
        return NotFound(self.value.format(**fields))

    def unmet(self, **fields: object) -> FailedPrecondition:
        """The refusal as FAILED_PRECONDITION: the request is sound, the server's state refuses it until it changes."""
        return FailedPrecondition(self.value.format(**fields))
