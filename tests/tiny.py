"""Tiny randomly initialised model artifacts for tests: built in a temp dir in seconds, never shipped."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.marian_random import SAMPLE_PAIRS
from model.artifact import TOKENIZER_FILE, save_artifact
from model.config import ModelConfig
from model.tokenizer import Tokenizer, file_sha256, train_tokenizer
from model.transformer import make_model

TINY_PAIRS = SAMPLE_PAIRS  # the random Marian models' sample text, for our tiny models too

TINY_CONFIG = ModelConfig(
    vocab_size=0,  # replaced by the tokenizer's size
    d_model=32,
    n_heads=4,
    d_ff=64,
    n_encoder_layers=2,
    n_decoder_layers=2,
    dropout=0.0,
    max_len=64,
)


def build_tiny_tokenizer(out_dir: Path, vocab_size: int = 120) -> Tokenizer:
    texts = [t for pair in TINY_PAIRS for t in pair] * 4
    train_tokenizer(texts, out_dir, vocab_size)
    return Tokenizer(out_dir / TOKENIZER_FILE)


def build_tiny_artifact(out_dir: Path, seed: int = 0, config: ModelConfig = TINY_CONFIG) -> Path:
    """config.json + model.safetensors + tokenizer.model of a random tiny model in `out_dir`."""
    tok = build_tiny_tokenizer(out_dir)
    torch.manual_seed(seed)
    tokenizer_sha256 = file_sha256(out_dir / TOKENIZER_FILE)
    cfg = ModelConfig(**{**config.to_dict(), "vocab_size": tok.vocab_size, "tokenizer_sha256": tokenizer_sha256})
    model = make_model(cfg).eval()
    save_artifact(model, out_dir, dtype=torch.float32)
    return out_dir
