"""Tiny random NLLB-200 and M2M100 checkpoints, built offline as the hub lays them out: transformers'
M2M100ForConditionalGeneration with random weights, a small SentencePiece BPE trained on the spot, and the
family's tokenizer files (NLLB: sentencepiece.bpe.model and tokenizer.json with the 202 codes after the pieces,
<mask> last; M2M100: vocab.json and sentencepiece.bpe.model, `__xx__` codes after the vocabulary)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch

from tests.tiny import TINY_PAIRS

SPM_FILE = "sentencepiece.bpe.model"
SHAPE: dict[str, Any] = {
    "d_model": 16, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "max_position_embeddings": 64,
}  # fmt: skip
EOS_BIAS = 3.0  # EOS's embedding row moved toward the mean row: random outputs then end within a few tokens


def train_bpe(path: Path, vocab_size: int = 300) -> spm.SentencePieceProcessor:
    """A BPE model with SentencePiece's default specials (<unk> 0, <s> 1, </s> 2), as NLLB's and M2M100's are."""
    model = io.BytesIO()
    texts = [text for pair in TINY_PAIRS for text in pair]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts * 4), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, minloglevel=2, num_threads=1, hard_vocab_limit=False,
    )  # fmt: skip
    path.write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_file=str(path))


def save_model(out: Path, vocab_size: int, generation: dict[str, object], seed: int = 0) -> None:
    """A random M2M100ForConditionalGeneration of `vocab_size` ids, saved with its generation config."""
    from transformers import GenerationConfig, M2M100Config, M2M100ForConditionalGeneration

    torch.manual_seed(seed)
    config = M2M100Config(vocab_size=vocab_size, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                          decoder_start_token_id=2, scale_embedding=True, **SHAPE)  # fmt: skip
    model = M2M100ForConditionalGeneration(config).eval()
    with torch.no_grad():  # EOS a little likelier than any piece, so that random outputs end
        shared = model.model.shared.weight
        shared[2] = shared[2] + EOS_BIAS * shared.mean(dim=0)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=0, decoder_start_token_id=2, eos_token_id=2, pad_token_id=1, max_length=200,
                     **generation).save_pretrained(out)  # fmt: skip


def build_nllb_dir(out: Path) -> Path:
    """NLLB-200's files: sentencepiece.bpe.model, tokenizer.json (codes after the pieces, <mask> last)."""
    from transformers import NllbTokenizer
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    out.mkdir(parents=True, exist_ok=True)
    sp = train_bpe(out / SPM_FILE)
    converted = NllbTokenizer.from_pretrained(str(out), extra_special_tokens=list(FAIRSEQ_LANGUAGE_CODES))
    converted.save_pretrained(str(out))
    data = json.loads((out / "tokenizer.json").read_text())
    first = sp.get_piece_size() + 1  # the hub's layout: the codes right after the pieces, <mask> after them
    ids = {code: first + i for i, code in enumerate(FAIRSEQ_LANGUAGE_CODES)} | {"<mask>": first + 202}
    for token in data["added_tokens"]:
        token["id"] = ids.get(token["content"], token["id"])
    data["added_tokens"].sort(key=lambda token: token["id"])
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    save_model(out, vocab_size=first + 203 + 2, generation={})  # NLLB's embedding has rows past <mask>
    return out


def build_m2m100_dir(out: Path) -> Path:
    """M2M100's files: vocab.json and sentencepiece.bpe.model; num_beams 5 and early_stopping, as m2m100_418M's."""
    from transformers import M2M100Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    sp = train_bpe(out / SPM_FILE)
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not (sp.is_control(i) or sp.is_unknown(i))]
    vocab = {piece: i for i, piece in enumerate([*specials, *pieces])}
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    tokenizer = M2M100Tokenizer(str(out / "vocab.json"), str(out / SPM_FILE))
    tokenizer.save_pretrained(str(out))
    save_model(out, vocab_size=len(vocab) + 100 + 8, generation={"num_beams": 5, "early_stopping": True})
    return out


def nllb_tokenizer(directory: Path, source: str):  # type: ignore[no-untyped-def]
    from transformers import NllbTokenizer

    return NllbTokenizer.from_pretrained(str(directory), src_lang=source)


def m2m100_tokenizer(directory: Path, source: str):  # type: ignore[no-untyped-def]
    from transformers import M2M100Tokenizer

    return M2M100Tokenizer.from_pretrained(str(directory), src_lang=source)
