"""A model artifact's files, read without torch: their names, its config, and the hash of its weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from model.config import ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.model"
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"


def load_config(model_dir: Path) -> ModelConfig:
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in model directory {model_dir}")
    return ModelConfig.from_dict(json.loads(path.read_text()))


def weights_sha256(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / WEIGHTS_FILE).read_bytes()).hexdigest()
