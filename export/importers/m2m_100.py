"""NLLB-200 and M2M100 (transformers' M2M100ForConditionalGeneration, model_type m2m_100): pre-norm blocks with a
final LayerNorm per stack, fairseq's sinusoids numbered from the padding index + 1, scaled embeddings, relu, one
table for encoder, decoder and output; any language to any language, the target's code forced as the decoder's
first token. NLLB's tokenizer is sentencepiece.bpe.model alone (its pieces at SentencePiece's id + 1, the codes
after them, <mask> last); M2M100's adds a vocab.json (`__xx__` codes after it, then madeup words)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import sentencepiece as spm

from export.importers.files import DamagedFiles, Source, UnsupportedModel, damaged, read_json
from export.importers.language_codes import M2M100_LISTS, NLLB_CODES
from export.importers.registry import Importer, register
from model.config import ModelConfig
from model.directions import Directions
from model.languages import listed
from model.m2m_tokenizer import BOS, CODES_FILE, EOS, PAD, SPM_FILE, TOKENIZER_JSON, UNK, VOCAB_FILE
from model.marian_tokenizer import read_vocab

NLLB_SPECIALS = (BOS, PAD, EOS, UNK)  # fairseq's first four ids, before the pieces
FAIRSEQ_OFFSET = 1  # an NLLB piece's id is its SentencePiece id + 1 (fairseq puts <pad> at 1)
MASK = "<mask>"


@register
class M2M100Importer(Importer):
    model_type = "m2m_100"
    architecture = "M2M100ForConditionalGeneration"
    served = "NLLB-200, M2M100"
    required_files = (SPM_FILE,)

    def model_config(self, hf: dict[str, Any], max_len: int) -> ModelConfig:
        return model_config(hf, max_len)

    def tokenizer(self, directory: Path, out: Path, cfg: ModelConfig) -> None:
        try:
            sp = spm.SentencePieceProcessor(model_file=str(directory / SPM_FILE))
        except (RuntimeError, OSError) as exc:
            raise damaged(directory / SPM_FILE, f"cannot be read ({exc})") from exc
        vocab, codes = (m2m100_vocab if (directory / VOCAB_FILE).is_file() else nllb_vocab)(directory, sp)
        if (top := max(vocab.values())) >= cfg.vocab_size:
            raise UnsupportedModel(f"the tokenizer holds ids up to {top}, past the embedding's {cfg.vocab_size} rows")
        found = {"eos": vocab.get(EOS), "pad": vocab.get(PAD)}
        if found != {"eos": cfg.eos_id, "pad": cfg.pad_id}:
            raise UnsupportedModel(
                f"the tokenizer gives </s>, <pad> ids {found}, config.json {cfg.eos_id}, {cfg.pad_id}"
            )
        shutil.copyfile(directory / SPM_FILE, out / SPM_FILE)
        if (directory / TOKENIZER_JSON).is_file() and not (directory / VOCAB_FILE).is_file():  # NLLB's cutting
            shutil.copyfile(directory / TOKENIZER_JSON, out / TOKENIZER_JSON)
        (out / VOCAB_FILE).write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
        (out / CODES_FILE).write_text(json.dumps(codes, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    def directions(self, args: argparse.Namespace, source: Source, out: Path) -> Directions:
        """Any language into any other, or among those the flags list (`+`- or `,`-joined): declared as two sets,
        never as the pairs (NLLB-200's 202 languages make some 40,000)."""
        languages = list(json.loads((out / CODES_FILE).read_text(encoding="utf-8")))
        sources = chosen(args.source_lang, languages, "--source-lang")
        targets = chosen(args.target_lang, languages, "--target-lang")
        if sources == targets == [sources[0]]:
            raise UnsupportedModel(f"--source-lang and --target-lang name only {sources[0]}: no direction to serve")
        return Directions.between(sources, targets)


def chosen(flag: str | None, languages: list[str], name: str) -> list[str]:
    if not flag:
        return languages
    picked = [code for part in flag.split(",") for code in listed(part)]
    if unknown := [code for code in picked if code not in languages]:
        raise UnsupportedModel(f"{name} {', '.join(unknown)}: not among the model's language codes")
    return picked


def model_config(hf: dict[str, Any], max_len: int) -> ModelConfig:
    """Our config for an M2M100Config dict; raises UnsupportedModel for what ours cannot represent."""
    if hf.get("activation_function", "relu") != "relu":
        raise UnsupportedModel(f"activation_function {hf.get('activation_function')!r}: M2M100 is served with relu")
    pairs = [("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")]
    if unequal := [f"{a} != {b}" for a, b in pairs if hf[a] != hf[b]]:
        raise UnsupportedModel(f"encoder and decoder differ in shape ({', '.join(unequal)}); not representable")
    if hf.get("tie_word_embeddings", True) is False:
        raise UnsupportedModel("tie_word_embeddings is false; an untied output is not representable")
    pad = hf["pad_token_id"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["d_model"],
        n_heads=hf["encoder_attention_heads"],
        d_ff=hf["encoder_ffn_dim"],
        n_encoder_layers=hf["encoder_layers"],
        n_decoder_layers=hf["decoder_layers"],
        dropout=0.0,  # and layerdrop, a training-time skip of whole layers
        max_len=min(max_len, hf["max_position_embeddings"]),
        pad_id=pad,
        bos_id=hf.get("decoder_start_token_id", hf["eos_token_id"]),
        eos_id=hf["eos_token_id"],
        unk_id=hf.get("unk_token_id", 3),
        norm_placement="pre",
        activation="relu",
        position_layout="fairseq",
        position_offset=pad + 1,  # M2M100SinusoidalPositionalEmbedding numbers positions from padding_idx + 1
        scale_embedding=bool(hf.get("scale_embedding", False)),
        final_logits_bias=False,
        forced_bos=True,
        tokenizer="m2m",
    )


def nllb_vocab(directory: Path, sp: spm.SentencePieceProcessor) -> tuple[dict[str, int], dict[str, str]]:
    """NLLB's ids, as tokenizer.json holds them where the snapshot has one, else fairseq's layout (`fairseq_vocab`);
    each language's code is its own name."""
    if (directory / TOKENIZER_JSON).is_file():
        return tokenizer_json_vocab(directory / TOKENIZER_JSON)
    config = read_json(directory / "tokenizer_config.json")
    listed_codes = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    codes = [str(c) for c in listed_codes] if isinstance(listed_codes, list) and listed_codes else list(NLLB_CODES)
    return fairseq_vocab(sp, codes), {code: code for code in codes}


def fairseq_vocab(sp: spm.SentencePieceProcessor, codes: list[str]) -> dict[str, int]:
    """<s> <pad> </s> <unk>, the pieces at their SentencePiece id + 1, the codes, <mask> last."""
    vocab = dict(zip(NLLB_SPECIALS, range(len(NLLB_SPECIALS)), strict=True))
    for i in range(sp.get_piece_size()):
        if not (sp.is_control(i) or sp.is_unknown(i)):
            vocab.setdefault(sp.id_to_piece(i), i + FAIRSEQ_OFFSET)
    first = sp.get_piece_size() + FAIRSEQ_OFFSET
    vocab |= {code: first + i for i, code in enumerate(codes)}
    vocab[MASK] = first + len(codes)
    return vocab


def tokenizer_json_vocab(path: Path) -> tuple[dict[str, int], dict[str, str]]:
    """The pieces of tokenizer.json's BPE model and its added tokens, by id; the codes are the added tokens
    that are NLLB language codes."""
    data = read_json(path)
    model, added = data.get("model") or {}, data.get("added_tokens") or []
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise UnsupportedModel(f"{path.name} holds no BPE vocabulary; NLLB's tokenizer is a BPE")
    vocab = {str(piece): int(i) for piece, i in model["vocab"].items()}
    vocab |= {str(token["content"]): int(token["id"]) for token in added}
    known = set(NLLB_CODES)
    return vocab, {t["content"]: t["content"] for t in sorted(added, key=lambda t: t["id"]) if t["content"] in known}


def m2m100_vocab(directory: Path, sp: spm.SentencePieceProcessor) -> tuple[dict[str, int], dict[str, str]]:
    """M2M100's ids: vocab.json, then `__xx__` per code of its `language_codes` list (m2m100 or wmt21)."""
    try:
        vocab = read_vocab(directory / VOCAB_FILE)
    except (ValueError, OSError) as exc:
        raise damaged(directory / VOCAB_FILE, f"cannot be read ({exc})") from exc
    if missing := [p for p in (BOS, PAD, EOS, UNK) if p not in vocab]:
        raise DamagedFiles(f"{directory / VOCAB_FILE} lacks {missing}")
    which = read_json(directory / "tokenizer_config.json").get("language_codes", "m2m100")
    if which not in M2M100_LISTS:
        raise UnsupportedModel(f"tokenizer_config.json's language_codes {which!r} is none of {sorted(M2M100_LISTS)}")
    size = len(vocab)  # M2M100Tokenizer numbers the codes from the vocabulary's length
    codes = {code: f"__{code}__" for code in M2M100_LISTS[which]}
    return vocab | {piece: size + i for i, piece in enumerate(codes.values())}, codes
