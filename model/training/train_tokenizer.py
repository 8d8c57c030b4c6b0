"""Train the shared German/English SentencePiece tokenizer (model.tokenizer) on the training split.

Usage: python -m model.training.train_tokenizer --data data/ --out model/shipped/ --vocab-size 8000
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

import sentencepiece as spm

from model.config import BOS_ID, EOS_ID, LANG_TAGS, PAD_ID, UNK_ID
from model.data import read_tsv
from model.tokenizer import TOKENIZER_FILE


def train_tokenizer(texts: list[str], out_dir: Path, vocab_size: int, seed: int = 0) -> Path:
    """Train a unigram model on `texts` (the training split only) and write it to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sample = rng.sample(texts, min(len(texts), 2_000_000))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sample),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        user_defined_symbols=list(LANG_TAGS.values()),
        input_sentence_size=len(sample),
        shuffle_input_sentence=False,  # already sampled with our seed: deterministic
        num_threads=2,
        minloglevel=2,
    )
    path = out_dir / TOKENIZER_FILE
    path.write_bytes(model.getvalue())
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data"))
    parser.add_argument("--out", type=Path, default=Path("model/shipped"))
    parser.add_argument("--vocab-size", type=int, default=8000)
    args = parser.parse_args()
    pairs = read_tsv(args.data / "train.tsv")
    texts = [p.de for p in pairs] + [p.en for p in pairs]
    path = train_tokenizer(texts, args.out, args.vocab_size)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
