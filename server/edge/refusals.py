"""Every way the edge refuses a Translate request as invalid, each with the words of its message.

A rule's check raises `Refusal.X.error(...)` with the fields its message names; `server.edge.errors` maps the
InvalidRequest it gives to INVALID_ARGUMENT. The rules of decoding options are the core's
(`server.core.work.check_options`), shared with offline callers.
"""

from __future__ import annotations

from enum import Enum, unique

from server.edge.errors import InvalidRequest


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

    def error(self, **fields: object) -> InvalidRequest:
        """The refusal with its fields filled in, to raise (or hand to a call's `refuse`)."""
        return InvalidRequest(self.value.format(**fields))
