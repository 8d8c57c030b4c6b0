"""The weights of a model artifact as numpy arrays, read from model.safetensors without torch and checked
against the config: every tensor the model has, of its shape, and nothing else."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from model.config import ModelConfig
from model.files import WEIGHTS_FILE

Weights = Mapping[str, np.ndarray]


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


class StoredWeights(Mapping[str, np.ndarray]):
    """The tensors of one safetensors file, each read when asked for: a graph builder holds the weights it is
    writing, not the whole checkpoint beside them. The file is mapped only while a tensor is read, so that
    the pages it touched do not stay in the process's resident memory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with safe_open(str(path), framework="numpy") as stored:
            names = stored.keys()  # a safetensors file is not iterable itself
            self.shapes = {name: tuple(stored.get_slice(name).get_shape()) for name in names}

    def __getitem__(self, name: str) -> np.ndarray:
        """float32 (a float16 checkpoint is widened exactly, as the PyTorch reference loads it)."""
        if name not in self.shapes:
            raise KeyError(name)
        with safe_open(str(self.path), framework="numpy") as stored:
            return stored.get_tensor(name).astype(np.float32, copy=False)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def load_weights(model_dir: Path, cfg: ModelConfig) -> Weights:
    """Every tensor of model.safetensors, checked against the config, read as float32 when used."""
    try:
        stored = StoredWeights(model_dir / WEIGHTS_FILE)
    except (SafetensorError, OSError) as exc:  # cut short, or not safetensors at all
        raise WeightsError(f"{model_dir / WEIGHTS_FILE} cannot be read ({exc})") from exc
    expected, shapes = expected_shapes(cfg), stored.shapes
    if missing := sorted(set(expected) - set(shapes)):
        raise WeightsError(f"{model_dir / WEIGHTS_FILE} lacks {missing[:5]} ({len(missing)} missing)")
    if unknown := sorted(set(shapes) - set(expected)):
        raise WeightsError(f"{model_dir / WEIGHTS_FILE} holds tensors the config has no place for: {unknown[:5]}")
    if wrong := [f"{k} {shapes[k]} != {v}" for k, v in expected.items() if shapes[k] != v]:
        raise WeightsError(f"{model_dir / WEIGHTS_FILE}: shapes disagree with the config: {wrong[:5]}")
    return stored
