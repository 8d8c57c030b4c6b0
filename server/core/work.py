"""The rules decoding work must meet, each in exactly one function.

The edge checks a request with them once, before anything is queued (`server.edge.convert`, and
`server.text.documents.prepare_texts` for the sources it tokenizes); offline callers check their work with
the same functions (`server.core.offline.translate_ids`). The engine, its process boundary and the scheduler
trust what they are given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from model.directory import MAX_LENGTH_PENALTY, ModelSpec


class InvalidWorkError(ValueError):
    """Work that can never run as asked (the caller's input, not a bug); the message names the rule."""


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode every sentence of one request."""

    beam_size: int = 4  # K: slots each sentence holds; 1 = greedy
    length_penalty: float = 1.0  # hypotheses rank by score / length ** length_penalty
    max_output_len: int = 0  # most generated tokens, EOS included; 0 = 3 x source tokens + 10 (output_limit)
    num_hypotheses: int = 1  # best hypotheses returned per sentence, <= beam_size
    stream_tokens: bool = False  # TokensEvent after every step (greedy rows only; beams report when done)
    # The first generated token, at log-probability 0, whatever the step ranks: the target language's code of a
    # model with ModelSpec.forced_bos (generate's forced_bos_token_id); None: the first token is decoded
    forced_first: int | None = None
    # Per sentence of the request, in order, the target token ids its translation must contain, one entry per
    # glossary term its source holds (`server.core.constraints`); empty: no sentence has any. A sentence with
    # terms decodes with a beam of at least TERM_BEAM_SIZE, whatever beam_size says.
    terms: tuple[tuple[tuple[int, ...], ...], ...] = ()


TERM_BEAM_SIZE = 4  # the narrowest beam that leaves a term's banks room beside the unconstrained hypotheses


def check_options(options: DecodeOptions, max_beam_size: int, max_target_len: int) -> None:
    """Beam width within what the engine's slots hold, a finite length penalty in range, an output limit the
    model can reach, no more hypotheses than the beam keeps."""
    if not 1 <= options.beam_size <= max_beam_size:
        raise InvalidWorkError(f"options.beam_size must be in 1..{max_beam_size}, got {options.beam_size}")
    penalty = options.length_penalty
    if not (math.isfinite(penalty) and 0.0 <= penalty <= MAX_LENGTH_PENALTY):
        raise InvalidWorkError(f"options.length_penalty must be in 0..{MAX_LENGTH_PENALTY}, got {penalty}")
    if not 0 <= options.max_output_len <= max_target_len:
        raise InvalidWorkError(
            f"options.max_output_len must be at most the model's {max_target_len} tokens "
            f"(0 = the model's default: default_max_output_len in ListModels, or 3 x source tokens + 10 where that is "
            f"0), got {options.max_output_len}"
        )
    if not 1 <= options.num_hypotheses <= options.beam_size:
        raise InvalidWorkError(
            f"options.num_hypotheses must be in 1..beam_size ({options.beam_size}), got {options.num_hypotheses}"
        )


def check_sources(sources: Sequence[Sequence[int]], spec: ModelSpec) -> None:
    """At least one source, each 1..max_source_len tokens of ids the model's source vocabulary has, not all of
    them padding (the edge's tokenizer makes only such sources; offline callers may bring any)."""
    if not sources:
        raise InvalidWorkError("a request needs at least one sentence")
    for ids in sources:
        if not 1 <= len(ids) <= spec.max_source_len:
            raise InvalidWorkError(f"a source must hold 1 to {spec.max_source_len} tokens, got {len(ids)}")
        if min(ids) < 0 or max(ids) >= spec.source_vocab_size:
            raise InvalidWorkError(f"source token ids must be in [0, {spec.source_vocab_size})")
        # The encoder masks padding out: a source of nothing else leaves attention nothing to attend to, and
        # each runner would decode something else from it.
        if all(token == spec.pad_id for token in ids):
            raise InvalidWorkError(
                f"a source needs a token other than padding (id {spec.pad_id}): tokenize the sentence, language "
                "tag and EOS included, and leave out sentences with nothing to translate"
            )
