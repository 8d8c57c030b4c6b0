"""The weights of a model artifact as numpy arrays, read from model.safetensors without torch and checked
against the config: every tensor the model has, of its shape, and nothing else."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from model.config import ModelConfig
from model.files import WEIGHTS_FILE

Weights = dict[str, np.ndarray]


class WeightsError(ValueError):
    """model.safetensors does not hold the tensors its config describes."""


def _attention(prefix: str, d: int) -> dict[str, tuple[int, ...]]:
    projections = ("q_proj", "k_proj", "v_proj", "out_proj")
    return {
        f"{prefix}.{p}.{kind}": (d, d) if kind == "weight" else (d,) for p in projections for kind in ("weight", "bias")
    }


def _block(prefix: str, cfg: ModelConfig, attentions: tuple[str, ...], norms: int) -> dict[str, tuple[int, ...]]:
    d, f = cfg.d_model, cfg.d_ff
    shapes = {f"{prefix}.ff.w1.weight": (f, d), f"{prefix}.ff.w1.bias": (f,)}
    shapes |= {f"{prefix}.ff.w2.weight": (d, f), f"{prefix}.ff.w2.bias": (d,)}
    for attention in attentions:
        shapes |= _attention(f"{prefix}.{attention}", d)
    for i in range(1, norms + 1):
        shapes |= {f"{prefix}.norm{i}.weight": (d,), f"{prefix}.norm{i}.bias": (d,)}
    return shapes


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, as model.training.transformer.Transformer's state dict holds them."""
    d = cfg.d_model
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, d)}
    if cfg.src_vocab_size:
        shapes["src_embed.weight"] = (cfg.src_vocab_size, d)
    for i in range(cfg.n_encoder_layers):
        shapes |= _block(f"encoder.{i}", cfg, ("self_attn",), norms=2)
    for i in range(cfg.n_decoder_layers):
        shapes |= _block(f"decoder.{i}", cfg, ("self_attn", "cross_attn"), norms=3)
    if cfg.norm_placement == "pre":
        for stack in ("encoder_norm", "decoder_norm"):
            shapes |= {f"{stack}.weight": (d,), f"{stack}.bias": (d,)}
    if cfg.final_logits_bias:
        shapes["logits_bias"] = (cfg.vocab_size,)
    return shapes


def load_weights(model_dir: Path, cfg: ModelConfig) -> Weights:
    """Every tensor as float32 (a float16 checkpoint is widened exactly, as the PyTorch reference loads it)."""
    stored = load_file(str(model_dir / WEIGHTS_FILE))
    expected = expected_shapes(cfg)
    if missing := sorted(set(expected) - set(stored)):
        raise WeightsError(f"{model_dir / WEIGHTS_FILE} lacks {missing[:5]} ({len(missing)} missing)")
    if unknown := sorted(set(stored) - set(expected)):
        raise WeightsError(f"{model_dir / WEIGHTS_FILE} holds tensors the config has no place for: {unknown[:5]}")
    if wrong := [f"{k} {stored[k].shape} != {v}" for k, v in expected.items() if stored[k].shape != v]:
        raise WeightsError(f"{model_dir / WEIGHTS_FILE}: shapes disagree with the config: {wrong[:5]}")
    return {name: array.astype(np.float32, copy=False) for name, array in stored.items()}
