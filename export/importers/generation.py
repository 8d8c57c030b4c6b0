"""What a model's generate() does, from its generation config: how a hypothesis ends and normalises (carried in
the model config), the defaults for requests that set none (decoding.json); any setting that would change
generate()'s translations and that the decoder here does not apply is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from export.importers.files import UnsupportedModel, read_json
from model.config import ModelConfig
from model.directory import MAX_BIAS_PER_ROW, MAX_LENGTH_PENALTY, served_length_penalty

# generate()'s settings that change its translations and that the decoder here does not apply, at the values
# that leave them off: a model setting one otherwise is refused, not served with other translations.
INERT_GENERATION = {
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0, "min_length": 0, "min_new_tokens": None, "do_sample": False,
    "num_beam_groups": 1, "diversity_penalty": 0.0, "begin_suppress_tokens": None,
    "exponential_decay_length_penalty": None, "sequence_bias": None, "forced_bos_token_id": None,
    "constraints": None, "force_words_ids": None, "watermarking_config": None, "guidance_scale": 1.0,
}  # fmt: skip


def ending(cfg: ModelConfig, gen: dict[str, Any]) -> ModelConfig:
    """How the model's generate() ends a hypothesis and normalises, from its generation config: EOS forced at
    the output limit where `forced_eos_token_id` is the EOS id, the pad ban where `bad_words_ids` bans pad
    (before normalising where `renormalize_logits` is set), its other banned words and `suppress_tokens`, beam
    search's patience from `early_stopping`; any other setting that would change generate()'s translations is
    refused."""
    forced = gen.get("forced_eos_token_id")
    forced_ids = forced if isinstance(forced, list) else [forced]
    if forced is not None and forced_ids != [cfg.eos_id]:
        raise UnsupportedModel(f"forced_eos_token_id {forced} is not the EOS id {cfg.eos_id}")
    eos = gen.get("eos_token_id")
    if eos is not None and (eos if isinstance(eos, list) else [eos]) != [cfg.eos_id]:
        raise UnsupportedModel(
            f"its generation config ends a hypothesis at eos_token_id {eos}, its config.json at {cfg.eos_id}:"
            " generate() would stop where this decoder does not"
        )
    start = gen.get("decoder_start_token_id")
    if start is not None and start != cfg.bos_id:
        raise UnsupportedModel(
            f"its generation config starts decoding at decoder_start_token_id {start}, its config.json at {cfg.bos_id}"
        )
    penalty = gen.get("length_penalty", 1.0)
    if not served_length_penalty(penalty):
        raise UnsupportedModel(
            f"its generation config sets length_penalty {penalty!r}: the server serves 0..{MAX_LENGTH_PENALTY}"
        )
    for key, inert in INERT_GENERATION.items():
        if (value := gen.get(key)) not in (None, inert, [], {}):
            raise UnsupportedModel(
                f"its generation config sets {key} {value!r}: generate() would apply it, and this decoder does not"
                " (it serves beam search with a length penalty, a forced EOS and a pad ban only)"
            )
    early_stopping = gen.get("early_stopping", False)
    if early_stopping not in (True, False, None):  # "never": another heuristic, with max_length
        raise UnsupportedModel(f"its generation config sets early_stopping {early_stopping!r}; true or false is served")
    banned = [list(word) for word in gen.get("bad_words_ids") or []]
    words = [word for word in banned if word != [cfg.pad_id]] + [[token] for token in gen.get("suppress_tokens") or []]
    return dataclasses.replace(
        cfg,
        forced_eos_at_limit=forced is not None,
        renormalize_logits=bool(gen.get("renormalize_logits")),
        ban_pad=[cfg.pad_id] in banned,
        patient_beam=early_stopping is not True,  # generate()'s default, False, decodes on past K finished
        banned_words=_banned_words(words, cfg, bool(gen.get("renormalize_logits"))),
    )


# Banned words the step's bias takes beside a request's own entries (EOS and glossary terms)
MAX_BANNED_WORDS = MAX_BIAS_PER_ROW // 2


def _banned_words(words: list[list[int]], cfg: ModelConfig, renormalize: bool) -> tuple[tuple[int, ...], ...]:
    """`bad_words_ids` besides the pad ban and `suppress_tokens`, as generate() applies them after normalising: a
    word's last token at -inf where a hypothesis ends with the rest. Refused where the decoder would differ: with
    `renormalize_logits` (generate() normalises again after the ban, and the bias does not), ids outside the
    vocabulary, EOS (generate() would never end), or more than the step's bias holds."""
    if not words:
        return ()
    if renormalize:
        raise UnsupportedModel(
            f"its generation config bans {words} with renormalize_logits: generate() normalises again after the ban,"
            " which this decoder does only for the pad ban"
        )
    if len(words) > MAX_BANNED_WORDS:
        raise UnsupportedModel(f"its generation config bans {len(words)} words; the decoder serves {MAX_BANNED_WORDS}")
    for word in words:
        if not word or any(not 0 <= token < cfg.vocab_size for token in word) or word[-1] == cfg.eos_id:
            raise UnsupportedModel(f"its generation config bans {word}: not a sequence of ids other than EOS ending it")
    return tuple(tuple(word) for word in words)


def generation_defaults(directory: Path, hf: dict[str, Any], directions: list[str], weights: str) -> dict[str, Any]:
    """decoding.json: the model's own beam, output limit and length penalty, for requests that set none; the
    penalty keyed as `model.directory.direction_names` names the `directions`."""
    gen = read_json(directory / "generation_config.json") or hf
    penalty = float(gen.get("length_penalty", 1.0))
    return {
        "length_penalty": dict.fromkeys(directions, penalty),
        "beam_size": int(gen.get("num_beams") or 1),
        # transformers' max_length counts the decoder's start token; ours counts generated tokens only
        "max_output_len": int(gen.get("max_new_tokens") or 0)
        or max(int(gen.get("max_length") or hf.get("max_length") or 0) - 1, 0),
        "weights_sha256": weights,
        "source": "generation_config.json" if (directory / "generation_config.json").is_file() else "config.json",
    }
