"""Tiny randomly initialised model artifacts for tests, written without torch: built in a temp dir in seconds,
never shipped. tests/tiny_torch.py writes the same artifact from the PyTorch model, for tests that need it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from export.builder.weights import expected_shapes
from model.config import ModelConfig
from model.data import read_tsv
from model.files import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE
from model.tokenizer import Tokenizer, file_sha256
from model.training.train_tokenizer import train_tokenizer

# The random Marian models' sample text (bench/marian_random.py), for our tiny models too
TINY_PAIRS = [(p.de, p.en) for p in read_tsv(Path(__file__).resolve().parent.parent / "data" / "sample_pairs.tsv")]

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


def tiny_config(out_dir: Path, config: ModelConfig = TINY_CONFIG) -> ModelConfig:
    """`config` sized to the tokenizer in `out_dir` and bound to it by its hash."""
    tok = Tokenizer(out_dir / TOKENIZER_FILE)
    fields = {"vocab_size": tok.vocab_size, "tokenizer_sha256": file_sha256(out_dir / TOKENIZER_FILE)}
    return ModelConfig(**{**config.to_dict(), **fields})


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Every tensor the model has (export/builder's names and shapes), initialised as model.training.transformer does:
    Xavier-uniform matrices, N(0, d_model^-0.5) embeddings, unit LayerNorm scales, zero biases."""
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("embed.weight"):
            weights[name] = rng.normal(0.0, cfg.d_model**-0.5, shape)
        elif len(shape) == 2:
            bound = (6.0 / sum(shape)) ** 0.5
            weights[name] = rng.uniform(-bound, bound, shape)
        else:
            weights[name] = np.ones(shape) if "norm" in name and name.endswith(".weight") else np.zeros(shape)
    return {name: array.astype(np.float32) for name, array in weights.items()}


def build_tiny_artifact(out_dir: Path, seed: int = 0, config: ModelConfig = TINY_CONFIG) -> Path:
    """config.json + model.safetensors + tokenizer.model of a random tiny model in `out_dir`."""
    build_tiny_tokenizer(out_dir)
    cfg = tiny_config(out_dir, config)
    save_file(random_weights(cfg, seed), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(cfg.to_json() + "\n")
    return out_dir
