"""A model artifact's files, read without torch: their names, its config, and the hash of its weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TypeVar

from model.config import ModelConfig

V = TypeVar("V")

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
    """Read in blocks: the weights of a large model are not held in memory to be hashed."""
    with (model_dir / WEIGHTS_FILE).open("rb") as weights:
        return hashlib.file_digest(weights, "sha256").hexdigest()


def read_json_map(path: Path, value_type: type[V], what: str) -> dict[str, V]:
    """The JSON object in `path` whose every value is a `value_type`; ValueError naming `what` it should map."""
    found = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(found, dict) or not all(isinstance(v, value_type) for v in found.values()):
        raise ValueError(f"{path}: expected a JSON object mapping {what}")
    return found
