"""Protobuf at the edge: validate requests into typed objects and turn results back into messages.

Nothing past the servicer sees a protobuf object; nothing here knows of the engine's threads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from model.directory import DEFAULT_LENGTH_PENALTY, EVERY_DIRECTION, direction_name, direction_names
from server.core.documents import PartialSentence, Refuse, RequestLimits, TextRefused, TextTranslation
from server.core.markup import TextType
from server.core.placeholders import Placeholders
from server.core.runner import ModelSpec
from server.core.tag_placement import TagPlacement
from server.core.work import DecodeOptions, check_options
from server.edge.errors import InvalidRequest, status_for
from server.edge.language_info import any_to_any_to_pb, language_codes, pairs_to_pb
from server.edge.routing import LanguageRoute
from server.proto.translation.v1 import translation_pb2 as pb

DEFAULT_BEAM_SIZE = 4
TEXT_TYPES = {pb.TEXT_TYPE_TEXT: TextType.TEXT, pb.TEXT_TYPE_HTML: TextType.HTML, pb.TEXT_TYPE_XML: TextType.XML}
PLACEHOLDERS = {pb.PLACEHOLDERS_KEEP: Placeholders.KEEP, pb.PLACEHOLDERS_OFF: Placeholders.OFF}
TAG_PLACEMENTS = {TagPlacement.NONE: pb.TAG_PLACEMENT_NONE, TagPlacement.PROPORTIONAL: pb.TAG_PLACEMENT_PROPORTIONAL}


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

    @property
    def lang_pair(self) -> str:
        return direction_name(self.source_lang, self.target_lang)


# Longer than any language code (a BCP-47 tag with a variant and an extension stays under 40) or model name (a hub id
# with its `@sha`): refused before routing, which caches what it sees and echoes codes in its messages.
MAX_LANGUAGE_CODE_CHARS = 64
MAX_MODEL_NAME_CHARS = 256
UNDETERMINED = ("auto", "und")  # a source left to detection, as an empty one is (`und`: BCP-47's "undetermined")


def normalize_codes(options: pb.TranslationOptions) -> None:
    """Check the lengths of the request's language codes and model name, trim their whitespace, and clear a
    source that asks for detection (`auto`, `und`, any case): what routing and detection read after."""
    for name, limit in (
        ("source_language", MAX_LANGUAGE_CODE_CHARS),
        ("target_language", MAX_LANGUAGE_CODE_CHARS),
        ("model", MAX_MODEL_NAME_CHARS),
    ):
        value = getattr(options, name)
        if len(value) > limit:
            raise InvalidRequest(
                f"options.{name} is {len(value):,} characters long, over the limit of {limit}"
                f" (it begins {value[:20]!r})"
            )
        setattr(options, name, value.strip())
    source = options.source_language.lower()
    if source in UNDETERMINED or source.startswith(("und-", "und_")):  # `und-Latn`: undetermined, in Latin script
        options.source_language = ""


def parse_request(
    request: pb.TranslateRequest,
    route: LanguageRoute,
    spec: ModelSpec,
    limits: RequestLimits,
    model: ModelDescription,
) -> TranslateJob:
    """Validate a TranslateRequest for the model pair its languages were routed to; raise InvalidRequest
    naming the field and the limit it breaks.

    The model's defaults (length penalty by direction, beam width, output limit) fill in what it leaves unset.
    """
    texts = list(request.texts)
    check_texts(texts, limits, request.options.text_type)
    source, target = route.source, route.target
    pair_default = model.length_penalty_for(source, target)
    options = replace(
        _parse_options(request.options, spec, limits, model, pair_default), forced_first=forced_first(spec, target)
    )
    text_type = TEXT_TYPES.get(request.options.text_type)
    if text_type is None:
        raise InvalidRequest(f"options.text_type must be TEXT, HTML or XML, got {request.options.text_type}")
    placeholders = PLACEHOLDERS.get(request.options.placeholders)
    if placeholders is None:
        raise InvalidRequest(f"options.placeholders must be KEEP or OFF, got {request.options.placeholders}")
    return TranslateJob(
        texts,
        source,
        target,
        route.sentence_language,
        options,
        request.options.return_scores,
        text_type,
        allow_partial=request.allow_partial,
        placeholders=placeholders,
    )


def forced_first(spec: ModelSpec, target: str) -> int | None:
    """The target's code as the first generated token where the model forces it (NLLB, M2M100), else None."""
    return spec.tag_ids[target] if spec.forced_bos else None


def check_texts(
    texts: list[str], limits: RequestLimits, text_type: pb.TextType.ValueType, refuse: Refuse | None = None
) -> list[int]:
    """The positions of the request's texts within the limits on their number and length; InvalidRequest naming
    the first over, or with `refuse`, each text over its length refused alone. An HTML or XML document is bounded
    as a whole here and by the text it translates once parsed (`server.core.markup_documents`)."""
    if not texts:
        raise InvalidRequest(f"the request has no texts; send 1 to {limits.max_texts} in `texts`")
    if len(texts) > limits.max_texts:
        raise InvalidRequest(f"the request has {len(texts)} texts, over the limit of {limits.max_texts}")
    markup = text_type in (pb.TEXT_TYPE_HTML, pb.TEXT_TYPE_XML)
    limit = limits.max_markup_chars_per_text if markup else limits.max_chars_per_text
    kept: list[int] = []
    for index, text in enumerate(texts):
        if len(text) <= limit:
            kept.append(index)
            continue
        what = "document" if markup else "text"
        refusal = InvalidRequest(
            f"texts[{index}] has {len(text)} characters, over the limit of {limit} per {what}; split it across requests"
        )
        if refuse is None:
            raise refusal
        refuse(TextRefused(index, refusal))
    return kept


def _parse_options(
    options: pb.TranslationOptions,
    spec: ModelSpec,
    limits: RequestLimits,
    model: ModelDescription,
    default_length_penalty: float,
) -> DecodeOptions:
    """The request's options with the model's defaults for what it leaves unset, checked by the one set of
    rules (`server.core.work.check_options`)."""
    # The default fits the server: one with fewer slots than the default decodes unset beams narrower.
    beam = options.beam_size if options.HasField("beam_size") else min(model.default_beam_size, limits.max_beam_size)
    requested = DecodeOptions(
        beam_size=beam,
        length_penalty=options.length_penalty if options.HasField("length_penalty") else default_length_penalty,
        max_output_len=options.max_output_len,
        num_hypotheses=options.num_hypotheses if options.HasField("num_hypotheses") else 1,
        stream_tokens=options.stream_tokens,
    )
    check_options(requested, limits.max_beam_size, spec.max_target_len)
    default_limit = min(model.default_max_output_len, spec.max_target_len)
    return replace(requested, max_output_len=requested.max_output_len or default_limit)


def text_result_to_pb(result: TextTranslation, job: TranslateJob) -> pb.TextResult:
    message = pb.TextResult(
        index=result.index,
        translation=result.translation,
        input_tokens=result.input_tokens,
        output_tokens=result.output_tokens,
        sentences=result.sentences,
        tag_placement=TAG_PLACEMENTS[result.tag_placement],
    )
    if job.options.num_hypotheses > 1 or job.return_scores:
        for text, score in result.hypotheses:
            hypothesis = message.hypotheses.add(text=text)
            if job.return_scores:
                hypothesis.score = score
    return message


def refusal_to_pb(refusal: TextRefused) -> pb.TextResult:
    """A text refused alone: its position and its refusal as the call's status would have carried it."""
    code, message = status_for(refusal.error)
    return pb.TextResult(index=refusal.index, error=pb.TextError(code=code.value[0], message=message))


def partial_to_pb(partial: PartialSentence) -> pb.PartialTranslation:
    return pb.PartialTranslation(
        text_index=partial.text_index,
        sentence_index=partial.sentence_index,
        text=partial.text,
        finished=partial.finished,
    )


def model_info_to_pb(model: ModelDescription, spec: ModelSpec, limits: RequestLimits) -> pb.ModelInfo:
    return pb.ModelInfo(
        name=model.name,
        languages=language_codes(spec.directions),
        pairs=pairs_to_pb(spec.directions, model.target_tags),
        any_to_any=any_to_any_to_pb(spec.directions),
        limits=pb.Limits(
            max_texts_per_request=limits.max_texts,
            max_chars_per_text=limits.max_chars_per_text,
            max_sentences_per_request=limits.max_sentences,
            max_source_tokens=spec.max_source_len,
            max_output_len=spec.max_target_len,
            max_beam_size=limits.max_beam_size,
            max_message_bytes=limits.max_response_bytes,
            max_markup_depth=limits.max_markup_depth,
            max_markup_units=limits.max_markup_units,
            max_markup_chars_per_text=limits.max_markup_chars_per_text,
        ),
        variant=model.variant,
        available_variants=model.available_variants,
        provider=model.provider,
        opset=model.opset,
        model_sha256=model.model_sha256,
        revision=model.revision,
        dtype=model.dtype,
        default_length_penalty={
            name: model.default_length_penalty.get(name, DEFAULT_LENGTH_PENALTY)
            for name in direction_names(spec.directions)
        },
        default_beam_size=min(model.default_beam_size, limits.max_beam_size),
        default_max_output_len=min(model.default_max_output_len, spec.max_target_len),
    )
