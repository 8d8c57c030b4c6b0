"""The shipped model artifact: config.json + model.safetensors + tokenizer.model, never pickled."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.files import CONFIG_FILE, SHIPPED_DIR, TOKENIZER_FILE, WEIGHTS_FILE, load_config, weights_sha256
from model.training.transformer import Transformer

__all__ = [
    "CONFIG_FILE", "SHIPPED_DIR", "TOKENIZER_FILE", "WEIGHTS_FILE",
    "load_artifact", "load_config", "save_artifact", "weights_sha256",
]  # fmt: skip


def save_artifact(model: Transformer, out_dir: Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write config and weights (fp16 by default: half the size, no measurable loss) to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(model.cfg.to_json() + "\n")
    return out_dir


def load_artifact(model_dir: Path, device: str | torch.device = "cpu") -> Transformer:
    """Rebuild the model from its own config and load fp32 weights; eval mode."""
    cfg = load_config(model_dir)
    weights = model_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in model directory {model_dir}")
    model = Transformer(cfg)
    state = {k: v.float() for k, v in load_file(str(weights)).items()}
    model.load_state_dict(state, strict=True)
    return model.to(device).eval()
