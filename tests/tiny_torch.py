"""The tiny test model written from the PyTorch model (model.training.artifact.save_artifact), for the tests that check
the torch-free tests/tiny.py writes the same artifact."""

from __future__ import annotations

from pathlib import Path

import torch

from model.config import ModelConfig
from model.training.artifact import save_artifact
from model.training.transformer import make_model
from tests.tiny import TINY_CONFIG, build_tiny_tokenizer, tiny_config


def build_torch_artifact(out_dir: Path, seed: int = 0, config: ModelConfig = TINY_CONFIG) -> Path:
    """config.json + model.safetensors + tokenizer.model of a random tiny PyTorch model in `out_dir`."""
    build_tiny_tokenizer(out_dir)
    torch.manual_seed(seed)
    save_artifact(make_model(tiny_config(out_dir, config)).eval(), out_dir, dtype=torch.float32)
    return out_dir
