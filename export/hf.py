"""Import a transformers MarianMTModel (OPUS-MT) into this project's model artifact.

    python -m export.hf --model DIR_OR_HUB_ID --out models/opus-mt-de-en [--source-lang de --target-lang en]

Reads config.json, generation_config.json where present, model.safetensors (without torch; a checkpoint
only as pytorch_model.bin, a pickle, needs torch: `pip install 'translate-service[train]'`), source.spm,
target.spm, vocab.json and target_vocab.json where present. Writes config.json (model.config.ModelConfig),
model.safetensors (float32, our names), the tokenizer files, languages.json, decoding.json (the model's
generation defaults) and MODEL_CARD.md. A hub id is fetched with huggingface_hub
(`pip install 'translate-service[import]'`). What the model does that ours cannot represent fails the
import with a message naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from export.builder.positions import sinusoid_table
from export.fetch import FetchError, HubSettings, download, parse_name, resolve_commit, torch_needed
from model.config import ModelConfig
from model.directory import MAX_LENGTH_PENALTY, served_length_penalty
from model.files import CONFIG_FILE, WEIGHTS_FILE, weights_sha256
from model.languages import AmbiguousLanguage, listed
from model.languages import match as match_language
from model.languages import parse as parse_language
from model.marian_tokenizer import (
    EOS,
    LANGUAGES_FILE,
    PAD,
    SOURCE_SPM,
    TAG,
    TARGET_SPM,
    TARGET_VOCAB_FILE,
    UNK,
    VOCAB_FILE,
    read_vocab,
)
from model.tokenizer import tokenizer_sha256

ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}
# Config switches of older BART-style configs that MarianMTModel would need to honour to be representable.
UNSUPPORTED_IF_TRUE = ("normalize_before", "add_final_layer_norm", "normalize_embedding", "layernorm_embedding")
CARD_FILE = "MODEL_CARD.md"
DECODING_FILE = "decoding.json"
LAYER_NAMES = {  # transformers' name inside a layer -> ours
    "self_attn_layer_norm": "norm1",
    "final_layer_norm": "norm3",  # norm2 in encoder layers (see layer_rename)
    "encoder_attn_layer_norm": "norm2",
    "encoder_attn": "cross_attn",
    "self_attn": "self_attn",
    "fc1": "ff.w1",
    "fc2": "ff.w2",
}


class UnsupportedModel(Exception):
    """The source is not a Marian model this project can represent; reported as one line, exit status 2."""


class DamagedFiles(UnsupportedModel):
    """A file the model needs is missing or cannot be read: a download cut short, not an architecture."""


@dataclass(frozen=True)
class Source:
    directory: Path
    name: str  # the hub id or directory name, for the model card


def resolve(model: str) -> Source:
    """A local directory (a hub snapshot's named `org/name`), or a hub id fetched as export/fetch.py fetches it."""
    try:
        name = parse_name(model)
        if name.local is not None:
            return Source(name.local, name.repository)
        try:
            from huggingface_hub import constants  # it reads HF_HUB_CACHE and HF_HUB_OFFLINE at import
        except ImportError as exc:
            raise UnsupportedModel(
                f"{model} is not a directory; to fetch it from the hub: pip install 'translate-service[import]'"
            ) from exc
        hub = HubSettings(Path(constants.HF_HUB_CACHE), bool(constants.HF_HUB_OFFLINE))
        return Source(download(name, resolve_commit(name, hub), hub), name.repository)
    except FetchError as exc:
        raise UnsupportedModel(str(exc)) from exc


def damaged(path: Path, why: str) -> DamagedFiles:
    """`path` cannot be read: DamagedFiles naming it and what to delete, with the huggingface_hub blob it links to
    (a snapshot's link deleted alone is linked again to the same damaged blob)."""
    blob = path.resolve()
    also = f" and {blob}, the blob it links to," if blob != path.parent.resolve() / path.name else ""
    return DamagedFiles(f"{path} {why}: a damaged or partial download; delete it{also} and fetch it again")


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path` ({} where there is no such file); UnsupportedModel naming a file that is not one
    (a download cut short leaves a truncated file)."""
    if not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise damaged(path, f"is not valid JSON ({exc})") from exc
    if not isinstance(found, dict):
        raise UnsupportedModel(f"{path.name} holds no JSON object")
    return found


def model_config(hf: dict[str, Any], max_len: int) -> ModelConfig:
    """Our config for a MarianConfig dict; raises UnsupportedModel for what ours cannot represent."""
    if hf.get("model_type") != "marian":
        raise UnsupportedModel(f"model_type is {hf.get('model_type')!r}; this importer reads Marian models only")
    if set_flags := [flag for flag in UNSUPPORTED_IF_TRUE if hf.get(flag)]:
        raise UnsupportedModel(f"config sets {set_flags}, which this project's Transformer does not implement")
    activation = ACTIVATIONS.get(hf.get("activation_function", ""))
    if activation is None:
        raise UnsupportedModel(
            f"activation_function {hf.get('activation_function')!r} is not one of {sorted(ACTIVATIONS)}"
        )
    pairs = [("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")]
    if unequal := [f"{a} != {b}" for a, b in pairs if hf[a] != hf[b]]:
        raise UnsupportedModel(f"encoder and decoder differ in shape ({', '.join(unequal)}); not representable")
    shared = hf.get("share_encoder_decoder_embeddings", True)
    target_vocab = hf["vocab_size"] if shared else hf.get("decoder_vocab_size") or hf["vocab_size"]
    return ModelConfig(
        vocab_size=target_vocab,
        d_model=hf["d_model"],
        n_heads=hf["encoder_attention_heads"],
        d_ff=hf["encoder_ffn_dim"],
        n_encoder_layers=hf["encoder_layers"],
        n_decoder_layers=hf["decoder_layers"],
        dropout=0.0,
        max_len=min(max_len, hf["max_position_embeddings"]),
        pad_id=hf["pad_token_id"],
        bos_id=hf.get("decoder_start_token_id", hf["pad_token_id"]),
        eos_id=hf["eos_token_id"],
        norm_placement="post",
        activation=activation,
        position_layout="halves",
        scale_embedding=bool(hf.get("scale_embedding", False)),
        final_logits_bias=True,
        src_vocab_size=0 if shared else hf["vocab_size"],
        ban_pad=True,
        tokenizer="marian",
    )


# Raised whenever importing the same files gives another model directory (what a generation setting becomes, say):
# part of a hub build's cache key, so that a cached build made by older rules is built again
IMPORT_RULES = 4

# generate()'s settings that change its translations and that the decoder here does not apply, at the values
# that leave them off: a model setting one otherwise is refused, not served with other translations.
INERT_GENERATION = {
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0, "min_length": 0, "min_new_tokens": None, "do_sample": False,
    "num_beam_groups": 1, "diversity_penalty": 0.0, "suppress_tokens": None, "begin_suppress_tokens": None,
    "exponential_decay_length_penalty": None, "sequence_bias": None, "forced_bos_token_id": None,
    "constraints": None, "force_words_ids": None, "watermarking_config": None, "guidance_scale": 1.0,
}  # fmt: skip


def ending(cfg: ModelConfig, gen: dict[str, Any]) -> ModelConfig:
    """How the model's generate() ends a hypothesis and normalises, from its generation config: EOS forced at
    the output limit where `forced_eos_token_id` is the EOS id, the pad ban where `bad_words_ids` bans pad
    (before normalising where `renormalize_logits` is set), beam search's patience from `early_stopping`; any
    other setting that would change generate()'s translations is refused."""
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
    banned = gen.get("bad_words_ids") or []
    if banned not in ([], [[cfg.pad_id]]):
        raise UnsupportedModel(
            f"bad_words_ids {banned} bans more than <pad> ({cfg.pad_id}); only the pad ban is served"
        )
    return dataclasses.replace(
        cfg,
        forced_eos_at_limit=forced is not None,
        renormalize_logits=bool(gen.get("renormalize_logits")),
        ban_pad=bool(banned),
        patient_beam=early_stopping is not True,  # generate()'s default, False, decodes on past K finished
    )


def load_weights(directory: Path) -> dict[str, np.ndarray]:
    """model.safetensors, else pytorch_model.bin (older repositories ship only that)."""
    if (path := directory / "model.safetensors").is_file():
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:  # cut short, or not safetensors at all
            raise damaged(path, f"cannot be read ({exc})") from exc
    if (directory / "pytorch_model.bin").is_file():
        return load_pickled_weights(directory / "pytorch_model.bin")
    raise UnsupportedModel(f"no model.safetensors or pytorch_model.bin in {directory}")


def load_pickled_weights(path: Path) -> dict[str, np.ndarray]:
    """A pytorch_model.bin: the one checkpoint format that needs torch to read, imported only here; loaded with
    weights_only, so that the pickle runs no code of its own."""
    try:
        import torch
    except ImportError:
        raise UnsupportedModel(torch_needed(str(path.parent))) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    # Cut short, no pickle, or one weights_only refuses (its UnpicklingError: the pickle module is never imported
    # here, so that nothing in the import path can unpickle by accident)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise damaged(path, f"cannot be read ({first})") from exc
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UnsupportedModel(f"{path} holds no state dict of tensors")
    return {name: tensor.float().numpy() for name, tensor in state.items()}


def layer_rename(side: str, rest: str) -> str:
    """`layers.3.fc1.weight` of the encoder or decoder -> our `encoder.3.ff.w1.weight`."""
    index, module, param = _split_layer_key(rest)
    ours = LAYER_NAMES.get(module)
    if ours is None:
        raise UnsupportedModel(f"unknown {side} layer weight {rest!r}")
    if side == "encoder" and module == "final_layer_norm":
        ours = "norm2"
    return f"{side}.{index}.{ours}{param}"


def _split_layer_key(rest: str) -> tuple[str, str, str]:
    """`layers.3.self_attn.q_proj.weight` -> ("3", "self_attn", ".q_proj.weight")."""
    match = re.fullmatch(r"layers\.(\d+)\.([a-z_]+\d?)((?:\.[qkv]_proj|\.out_proj)?\.(?:weight|bias))", rest)
    if match is None:
        raise UnsupportedModel(f"unknown layer weight {rest!r}")
    return match.group(1), match.group(2), match.group(3)


def convert_weights(hf: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """transformers' state dict -> ours, float32; checks ties, positions and that nothing is left over."""
    weights = {k.removeprefix("model."): v.astype(np.float32) for k, v in hf.items()}
    target = weights.pop("decoder.embed_tokens.weight", None)
    shared = weights.pop("shared.weight", None)
    source = weights.pop("encoder.embed_tokens.weight", None)
    target = target if target is not None else shared
    if target is None:
        raise UnsupportedModel("no decoder or shared embedding table among the weights")
    ours: dict[str, np.ndarray] = {"embed.weight": target}
    if cfg.src_vocab_size:
        if source is None:
            raise UnsupportedModel("no encoder embedding table among the weights of a model with two vocabularies")
        ours["src_embed.weight"] = source
    elif source is not None and not np.array_equal(source, target):
        raise UnsupportedModel("encoder and decoder embeddings differ although the config shares them")
    lm_head = weights.pop("lm_head.weight", None)
    if lm_head is not None and not np.array_equal(lm_head, target):
        raise UnsupportedModel("lm_head is not tied to the decoder embedding; an untied output is not representable")
    bias = weights.pop("final_logits_bias", np.zeros((1, cfg.vocab_size), dtype=np.float32))
    ours["logits_bias"] = bias.reshape(cfg.vocab_size)
    for side in ("encoder", "decoder"):
        check_positions(weights.pop(f"{side}.embed_positions.weight", None), cfg)
    for key, value in weights.items():
        side, _, rest = key.partition(".")
        if side not in ("encoder", "decoder"):
            raise UnsupportedModel(f"unknown weight {key!r}")
        ours[layer_rename(side, rest)] = value
    return ours


def check_positions(saved: np.ndarray | None, cfg: ModelConfig) -> None:
    """A saved position table must be the [sin | cos] sinusoids our model rebuilds."""
    if saved is None:
        return
    rebuilt = sinusoid_table(saved.shape[0], cfg.d_model, cfg.position_layout)
    if not np.allclose(saved, rebuilt, atol=1e-5):
        raise UnsupportedModel(
            "embed_positions is not the [sin | cos] sinusoid table; learned positions are not supported"
        )


def languages(args: argparse.Namespace, source: Source, tokenizer_config: dict[str, Any]) -> list[list[str]]:
    """Pairs from the flags, else tokenizer_config.json, else a name like opus-mt-de-en; every >>xx<< tag
    of a multilingual vocabulary is a target, every code of a `+`- or `_`-joined list (model.languages.listed) a
    source."""
    src = args.source_lang or tokenizer_config.get("source_lang")
    tgt = args.target_lang or tokenizer_config.get("target_lang")
    if not (src and tgt) and (
        match := re.search(r"opus-mt-(?:tc-(?:[a-z]+-)+)?([a-zA-Z_]+)-([a-zA-Z_]+)$", source.name)
    ):
        src, tgt = src or match.group(1), tgt or match.group(2)
    if not (src and tgt):
        raise UnsupportedModel(
            "cannot tell the languages from its name (opus-mt-SRC-TGT) or tokenizer_config.json; import it with "
            "python -m export.hf --model ID --out DIR --source-lang SRC --target-lang TGT, then serve --model-dir DIR"
        )
    sources = listed(src) if args.source_lang else family_members(listed(src), source.directory)
    vocab = read_vocab(source.directory / VOCAB_FILE)
    tags = sorted(m.group(1) for piece in vocab if (m := TAG.match(piece)))
    if tags and args.target_lang:  # a multilingual model served toward one of its targets: that target's own tag
        try:
            tag = match_language(args.target_lang, tags)
        except AmbiguousLanguage as exc:
            raise UnsupportedModel(f"--target-lang {exc}") from exc
        if tag is None:
            raise UnsupportedModel(
                f"--target-lang {args.target_lang} is none of the model's target tags ({', '.join(tags)})"
            )
        return [[s, tag] for s in sources]
    return [[s, t] for s in sources for t in (tags or listed(tgt))]


# The model card's list of what the model reads: `* source language(s): bel bel_Latn rus ukr` (Tatoeba-Challenge
# and tc-big cards), `* source languages: fr,fr_BE` (classic ones); not the `raw source language(s)` line.
CARD_SOURCES = re.compile(
    r"^[ \t]*[*-][ \t]*(?:\*\*)?source languages?(?:\(s\))?:(?:\*\*)?[ \t]*(.+?)[ \t]*$", re.I | re.M
)


def family_members(sources: list[str], directory: Path) -> list[str]:
    """`sources` with a language family (opus-mt-zle-en's `zle`) replaced by the languages the model card lists,
    so that the model takes those and no other (a family read as "any language" took German into an East Slavic
    model); `mul` stays, and so does a family whose card lists none (routing ranks it below `mul`)."""
    if not any(parse_language(code).is_group and code != "mul" for code in sources):
        return sources
    readme = directory / "README.md"
    found = CARD_SOURCES.search(readme.read_text(errors="replace")) if readme.is_file() else None
    members = [code for code in re.split(r"[\s,]+", found.group(1)) if code] if found else []
    if not members:
        return sources
    expanded = [member for code in sources for member in (members if parse_language(code).is_group else [code])]
    return list(dict.fromkeys(expanded))


def copy_tokenizer(directory: Path, out: Path) -> None:
    """The tokenizer files copied into `out`, each read first: a corrupt one fails here, in one line naming it,
    not at export."""
    for name in (SOURCE_SPM, TARGET_SPM, VOCAB_FILE):
        if not (directory / name).is_file():
            raise DamagedFiles(f"no {name} in {directory}: a partial download? fetch it again")
    separate = [TARGET_VOCAB_FILE] if (directory / TARGET_VOCAB_FILE).is_file() else []
    for name in [SOURCE_SPM, TARGET_SPM, VOCAB_FILE, *separate]:
        try:  # json's and sentencepiece's errors are ValueError, RuntimeError
            if name.endswith(".spm"):
                spm.SentencePieceProcessor(model_file=str(directory / name))
            else:
                read_vocab(directory / name)
        except (ValueError, RuntimeError, OSError) as exc:
            raise damaged(directory / name, f"cannot be read ({exc})") from exc
        shutil.copyfile(directory / name, out / name)
    if missing := [p for p in (EOS, UNK, PAD) if p not in read_vocab(out / VOCAB_FILE)]:
        raise UnsupportedModel(f"{directory / VOCAB_FILE} lacks {missing}")


def check_vocabularies(out: Path, cfg: ModelConfig) -> None:
    """Each vocabulary holds the ids its embedding has: two vocabularies where the config keeps two tables (else
    the target ids would be read through the source's pieces and come out as other words)."""
    separate = (out / TARGET_VOCAB_FILE).is_file()
    if cfg.src_vocab_size and not separate:
        raise UnsupportedModel(f"the config keeps two vocabularies (decoder_vocab_size {cfg.vocab_size}) but there is "
                               f"no {TARGET_VOCAB_FILE}")  # fmt: skip
    sizes = {
        VOCAB_FILE: cfg.src_vocab_size or cfg.vocab_size,
        **({TARGET_VOCAB_FILE: cfg.vocab_size} if separate else {}),
    }
    for name, size in sizes.items():
        if (top := max(read_vocab(out / name).values()) + 1) > size:
            raise UnsupportedModel(f"{name} holds ids up to {top - 1}, past the {size} rows of its embedding")


def check_special_ids(out: Path, cfg: ModelConfig) -> None:
    """The vocabularies' </s> and <pad> are the config's ids: sources are padded with the pad id and masked
    where they hold it, so a real piece under that id would vanish from every source."""
    vocabularies = [out / VOCAB_FILE] + ([out / TARGET_VOCAB_FILE] if (out / TARGET_VOCAB_FILE).is_file() else [])
    for path in vocabularies:
        vocab = read_vocab(path)
        found = {"eos": vocab.get(EOS), "pad": vocab.get(PAD)}
        if found != {"eos": cfg.eos_id, "pad": cfg.pad_id}:
            raise UnsupportedModel(f"{path.name} gives </s>, <pad> ids {found}, the config {cfg.eos_id}, {cfg.pad_id}")


def generation_defaults(directory: Path, hf: dict[str, Any], pairs: list[list[str]], weights: str) -> dict[str, Any]:
    """decoding.json: the model's own beam, output limit and length penalty, for requests that set none."""
    gen = read_json(directory / "generation_config.json") or hf
    penalty = float(gen.get("length_penalty", 1.0))
    return {
        "length_penalty": {f"{s}-{t}": penalty for s, t in pairs},
        "beam_size": int(gen.get("num_beams") or 1),
        # transformers' max_length counts the decoder's start token; ours counts generated tokens only
        "max_output_len": int(gen.get("max_new_tokens") or 0)
        or max(int(gen.get("max_length") or hf.get("max_length") or 0) - 1, 0),
        "weights_sha256": weights,
        "source": "generation_config.json" if (directory / "generation_config.json").is_file() else "config.json",
    }


def card(source: Source, cfg: ModelConfig, pairs: list[list[str]], parameters: int) -> str:
    licence = "not stated in the source's README.md; see the source model's card"
    readme = source.directory / "README.md"
    if readme.is_file() and (match := re.search(r"^license:\s*(\S+)", readme.read_text(), re.MULTILINE)):
        licence = match.group(1)
    directions = ", ".join(f"{s}->{t}" for s, t in pairs)
    return (
        f"# {source.name} (imported)\n\n"
        f"Imported from the transformers MarianMTModel `{source.name}` by `python -m export.hf`.\n\n"
        f"- Licence: {licence} (the source model's; it applies to these weights)\n"
        f"- Directions: {directions}\n"
        f"- Shape: d_model {cfg.d_model}, {cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, "
        f"{cfg.n_heads} heads, FFN {cfg.d_ff}, vocabulary {cfg.vocab_size}, {parameters:,} parameters\n"
        "- Scores: those of the source model's card; this import is checked equal to transformers "
        "(`python -m bench.hf_parity`), not re-scored.\n"
    )


def import_model(args: argparse.Namespace) -> Path:
    source = resolve(args.model)
    hf = read_json(source.directory / CONFIG_FILE)
    if not hf:
        raise UnsupportedModel(f"no {CONFIG_FILE} in {source.directory}")
    cfg = model_config(hf, args.max_len)
    weights = convert_weights(load_weights(source.directory), cfg)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(source.directory, out)
    check_vocabularies(out, cfg)
    check_special_ids(out, cfg)
    cfg = ending(cfg, read_json(source.directory / "generation_config.json") or hf)  # its ids checked first
    pairs = languages(args, source, read_json(source.directory / "tokenizer_config.json"))
    (out / LANGUAGES_FILE).write_text(json.dumps({"pairs": pairs}, indent=2) + "\n")
    cfg = ModelConfig(**{**cfg.to_dict(), "tokenizer_sha256": tokenizer_sha256(out, cfg.tokenizer)})
    save_file(
        {k: np.ascontiguousarray(v) for k, v in weights.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"}
    )
    (out / CONFIG_FILE).write_text(cfg.to_json() + "\n")
    defaults = generation_defaults(source.directory, hf, pairs, weights_sha256(out))
    (out / DECODING_FILE).write_text(json.dumps(defaults, indent=2, sort_keys=True) + "\n")
    (out / CARD_FILE).write_text(card(source, cfg, pairs, sum(v.size for v in weights.values())))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m export.hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a transformers Marian directory or a hub id")
    parser.add_argument("--out", type=Path, required=True, help="the model directory to write")
    parser.add_argument("--source-lang", default=None, help="default: tokenizer_config.json or the model's name")
    parser.add_argument("--target-lang", default=None, help="default: tokenizer_config.json or the model's name")
    parser.add_argument("--max-len", type=int, default=512, help="longest source or output in tokens")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = import_model(args)
    except UnsupportedModel as exc:
        print(f"export.hf: error: {exc}", file=sys.stderr)
        return 2
    except KeyError as exc:  # a config without a field every Marian config has
        print(f"export.hf: error: {CONFIG_FILE} lacks {exc}", file=sys.stderr)
        return 2
    print(f"imported {args.model} to {out}; next: python -m export --model-dir {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
