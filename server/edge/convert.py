"""A typed call on the model pair it was routed to: its job, the model's defaults filling in what it leaves unset
and its decoding options checked against the model's limits; and what the server knows of each model it serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from model.directory import DEFAULT_LENGTH_PENALTY, EVERY_DIRECTION, direction_name
from server.core.runner import ModelSpec
from server.core.work import DecodeOptions, check_options
from server.edge.request import CallOptions, TranslateCall
from server.edge.routing import LanguageRoute
from server.text.documents import RequestLimits
from server.text.markup import TextType
from server.text.placeholders import Placeholders
from server.text.terms import Term

DEFAULT_BEAM_SIZE = 4


@dataclass(frozen=True)
class ModelDescription:
    """What ListModels reports about the served model, gathered once at load time."""

    name: str  # model directory name, e.g. "shipped", or the hub id it was built from
    variant: str  # exported variant in use: fp32, int8 or fp16
    available_variants: list[str]  # variants exported for this model
    provider: str  # onnxruntime execution provider in use
    opset: int  # ONNX opset of the graphs
    model_sha256: str  # hash of the source weights the graphs were exported from
    dtype: str  # weight dtype of the variant
    # Length penalty a request gets when it sets none, by direction ("de-en"), or "*" for every direction of an
    # any-to-any model: decoding.json's value (model.directory.read_length_penalties); `length_penalty_for`.
    default_length_penalty: Mapping[str, float] = field(default_factory=dict)
    # Beam width and output limit a request gets when it sets none: decoding.json's (an imported model's
    # generation defaults, model.directory.read_decoding_defaults), else DEFAULT_BEAM_SIZE and 0 (the
    # source-relative limit, model.config.default_output_limit).
    default_beam_size: int = DEFAULT_BEAM_SIZE
    default_max_output_len: int = 0
    target_tags: Mapping[str, str] = field(default_factory=dict)  # tag text by target code, e.g. {"pob": ">>pob<<"}
    revision: str = ""  # the hub commit sha (or a transformers directory's content hash) it was built from

    def length_penalty_for(self, source: str, target: str) -> float:
        """The direction's default: its own, else every direction's (an any-to-any model's), else the default."""
        every = self.default_length_penalty.get(EVERY_DIRECTION, DEFAULT_LENGTH_PENALTY)
        return self.default_length_penalty.get(direction_name(source, target), every)


@dataclass(frozen=True)
class TranslateJob:
    """A validated request: its texts, languages and decoding options."""

    texts: list[str]
    source_lang: str  # the model's code (model.languages matched the client's to it)
    target_lang: str  # the model's code: its tag, if the model has tags
    sentence_lang: str  # whose sentence rules split the texts (server.edge.routing.LanguageRoute)
    options: DecodeOptions  # stream_tokens as asked; the unary method turns it off
    return_scores: bool
    text_type: TextType = TextType.TEXT  # how the texts are read: plain, HTML or XML
    allow_partial: bool = False  # a text over a limit of its own is refused alone (TranslateRequest.allow_partial)
    placeholders: Placeholders = Placeholders.KEEP  # what becomes of the texts' placeholders
    glossary: tuple[Term, ...] = ()  # terms the translations must use where the texts hold their sources

    @property
    def lang_pair(self) -> str:
        return direction_name(self.source_lang, self.target_lang)


def parse_request(
    call: TranslateCall,
    route: LanguageRoute,
    spec: ModelSpec,
    limits: RequestLimits,
    model: ModelDescription,
) -> TranslateJob:
    """The call's job on the model pair its languages were routed to; InvalidRequest (InvalidWorkError) naming the
    option and the limit it breaks.

    The model's defaults (length penalty by direction, beam width, output limit) fill in what it leaves unset.
    """
    options = call.options
    source, target = route.source, route.target
    pair_default = model.length_penalty_for(source, target)
    decode = replace(
        _decode_options(options, spec, limits, model, pair_default), forced_first=forced_first(spec, target)
    )
    return TranslateJob(
        list(call.texts),
        source,
        target,
        route.sentence_language,
        decode,
        options.return_scores,
        options.text_type,
        allow_partial=call.allow_partial,
        placeholders=options.placeholders,
        glossary=options.glossary,
    )


def forced_first(spec: ModelSpec, target: str) -> int | None:
    """The target's code as the first generated token where the model forces it (NLLB, M2M100), else None."""
    return spec.tag_ids[target] if spec.forced_bos else None


def _decode_options(
    options: CallOptions,
    spec: ModelSpec,
    limits: RequestLimits,
    model: ModelDescription,
    default_length_penalty: float,
) -> DecodeOptions:
    """The request's options with the model's defaults for what it leaves unset, checked by the one set of
    rules (`server.core.work.check_options`)."""
    # The default fits the server: one with fewer slots than the default decodes unset beams narrower.
    beam = min(model.default_beam_size, limits.max_beam_size) if options.beam_size is None else options.beam_size
    requested = DecodeOptions(
        beam_size=beam,
        length_penalty=default_length_penalty if options.length_penalty is None else options.length_penalty,
        max_output_len=options.max_output_len,
        num_hypotheses=1 if options.num_hypotheses is None else options.num_hypotheses,
        stream_tokens=options.stream_tokens,
    )
    check_options(requested, limits.max_beam_size, spec.max_target_len)
    default_limit = min(model.default_max_output_len, spec.max_target_len)
    return replace(requested, max_output_len=requested.max_output_len or default_limit)
