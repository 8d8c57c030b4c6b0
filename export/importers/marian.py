"""OPUS-MT (transformers' MarianMTModel, model_type marian): post-norm blocks, [sin | cos] positions from 0, a
logits bias, one or two vocabularies; source.spm, target.spm and vocab.json (target_vocab.json) map pieces to
model ids; `>>xx<<` target tags in front of the source of multilingual models."""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path
from typing import Any

import sentencepiece as spm

from export.importers.files import DamagedFiles, Source, UnsupportedModel, damaged, read_json
from export.importers.registry import Importer, register
from model.config import ModelConfig
from model.directions import Directions
from model.languages import AmbiguousLanguage, listed
from model.languages import match as match_language
from model.languages import parse as parse_language
from model.marian_tokenizer import EOS, PAD, SOURCE_SPM, TAG, TARGET_SPM, TARGET_VOCAB_FILE, UNK, VOCAB_FILE, read_vocab

ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}
# Config switches of older BART-style configs that MarianMTModel would need to honour to be representable.
UNSUPPORTED_IF_TRUE = ("normalize_before", "add_final_layer_norm", "normalize_embedding", "layernorm_embedding")


@register
class MarianImporter(Importer):
    model_type = "marian"
    architecture = "MarianMTModel"
    served = "OPUS-MT"
    required_files = (SOURCE_SPM, TARGET_SPM, VOCAB_FILE)

    def model_config(self, hf: dict[str, Any], max_len: int) -> ModelConfig:
        return model_config(hf, max_len)

    def tokenizer(self, directory: Path, out: Path, cfg: ModelConfig) -> None:
        copy_tokenizer(directory, out)
        check_vocabularies(out, cfg)
        check_special_ids(out, cfg)

    def directions(self, args: argparse.Namespace, source: Source, out: Path) -> Directions:
        pairs = languages(args, source, read_json(source.directory / "tokenizer_config.json"))
        return Directions.of_pairs([(s, t) for s, t in pairs])


def model_config(hf: dict[str, Any], max_len: int) -> ModelConfig:
    """Our config for a MarianConfig dict; raises UnsupportedModel for what ours cannot represent."""
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
