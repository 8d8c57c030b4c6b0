"""Protobuf at the edge: a Translate request into its typed call (`from_pb`), a CreateGlossary request into the
glossary to store (`new_glossary_from_pb`), and results and glossaries back into messages.

The servicer calls these and nothing past it sees a protobuf object; the client's message is only read.
"""

from __future__ import annotations

from model.directory import DEFAULT_LENGTH_PENALTY, direction_names
from server.core.runner import ModelSpec
from server.edge.convert import ModelDescription, TranslateJob
from server.edge.errors import status_for
from server.edge.glossaries import Glossary, GlossaryInfo, NewGlossary
from server.edge.glossary_terms import inline_terms, new_glossary
from server.edge.language_info import any_to_any_to_pb, language_codes, pairs_to_pb
from server.edge.refusals import Refusal
from server.edge.request import (
    MAX_LANGUAGE_CODE_CHARS,
    MAX_MODEL_NAME_CHARS,
    CallOptions,
    TranslateCall,
    client_code,
    source_code,
)
from server.edge.request_parts import DetectedSource, JobPart
from server.proto.translation.v1 import translation_pb2 as pb
from server.text.documents import PartialSentence, RequestLimits, TextRefused, TextTranslation
from server.text.markup import TextType
from server.text.placeholders import Placeholders
from server.text.tag_placement import TagPlacement

TEXT_TYPES = {pb.TEXT_TYPE_TEXT: TextType.TEXT, pb.TEXT_TYPE_HTML: TextType.HTML, pb.TEXT_TYPE_XML: TextType.XML}
PLACEHOLDERS = {pb.PLACEHOLDERS_KEEP: Placeholders.KEEP, pb.PLACEHOLDERS_OFF: Placeholders.OFF}
TAG_PLACEMENTS = {TagPlacement.NONE: pb.TAG_PLACEMENT_NONE, TagPlacement.PROPORTIONAL: pb.TAG_PLACEMENT_PROPORTIONAL}
ENTRIES_FORMATS = {pb.ENTRIES_FORMAT_TSV: "TSV", pb.ENTRIES_FORMAT_CSV: "CSV"}  # keys of glossary_terms.ENTRY_FORMATS


def from_pb(request: pb.TranslateRequest) -> TranslateCall:
    """The request as its typed call: codes within their lengths and trimmed, a source that asks for detection
    cleared, text type and placeholders known; InvalidRequest naming the field otherwise."""
    return TranslateCall(tuple(request.texts), _options_from_pb(request.options), request.allow_partial)


def _options_from_pb(options: pb.TranslationOptions) -> CallOptions:
    source = source_code(options.source_language)
    target = client_code("target_language", options.target_language, MAX_LANGUAGE_CODE_CHARS)
    model = client_code("model", options.model, MAX_MODEL_NAME_CHARS)
    if (text_type := TEXT_TYPES.get(options.text_type)) is None:
        raise Refusal.TEXT_TYPE.error(value=options.text_type)
    if (placeholders := PLACEHOLDERS.get(options.placeholders)) is None:
        raise Refusal.PLACEHOLDERS.error(value=options.placeholders)
    return CallOptions(
        source_language=source,
        target_language=target,
        model=model,
        beam_size=options.beam_size if options.HasField("beam_size") else None,
        length_penalty=options.length_penalty if options.HasField("length_penalty") else None,
        max_output_len=options.max_output_len,
        num_hypotheses=options.num_hypotheses if options.HasField("num_hypotheses") else None,
        return_scores=options.return_scores,
        stream_tokens=options.stream_tokens,
        text_type=text_type,
        placeholders=placeholders,
        glossary=inline_terms((entry.source, entry.target) for entry in options.glossary),
    )


def new_glossary_from_pb(request: pb.CreateGlossaryRequest) -> NewGlossary:
    """The glossary a CreateGlossary request asks to store, checked; InvalidRequest naming the field or entry."""
    if (text_format := ENTRIES_FORMATS.get(request.entries_format)) is None:
        raise Refusal.ENTRIES_FORMAT.error(value=request.entries_format)
    listed = [(entry.source, entry.target) for entry in request.entries]
    languages = (request.source_language, request.target_language)
    return new_glossary(request.name, languages, listed, request.entries_text, text_format)


def glossary_to_pb(glossary: Glossary) -> pb.Glossary:
    """A stored glossary with its entries (GetGlossary)."""
    message = glossary_info_to_pb(glossary.info)
    message.entries.extend(pb.GlossaryEntry(source=term.source, target=term.target) for term in glossary.terms)
    return message


def glossary_info_to_pb(info: GlossaryInfo) -> pb.Glossary:
    """A stored glossary without its entries (CreateGlossary, ListGlossaries)."""
    message = pb.Glossary(
        glossary_id=info.glossary_id,
        name=info.name,
        source_language=info.source_language,
        target_language=info.target_language,
        entry_count=info.entry_count,
    )
    message.creation_time.FromDatetime(info.created)
    return message


def text_result_to_pb(result: TextTranslation, job: TranslateJob, detected: DetectedSource | None) -> pb.TextResult:
    """A text's translation (hypotheses and scores where the job asked for them; its detected source, if any)."""
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
    if detected is not None:
        message.detected_source_language = detected.language
        message.detected_language_confidence = detected.confidence
    return message


def part_result_to_pb(part: JobPart, result: TextTranslation) -> pb.TextResult:
    """A part's translated text as its result in the response, at its place in the request."""
    answered, detected = part.answered(result)
    return text_result_to_pb(answered, part.job, detected)


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
