"""transformers' BART-family state dict (Marian, M2M100, NLLB) -> this project's Transformer names, float32;
checks ties, position tables and that nothing is left over. Tensors are renamed, not copied: each is read from
the checkpoint when the import writes it."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import numpy as np

from export.builder.positions import sinusoid_table
from export.importers.files import UnsupportedModel
from model.config import ModelConfig

LAYER_NAMES = {  # transformers' name inside a layer -> ours
    "self_attn_layer_norm": "norm1",
    "final_layer_norm": "norm3",  # norm2 in encoder layers (see layer_rename)
    "encoder_attn_layer_norm": "norm2",
    "encoder_attn": "cross_attn",
    "self_attn": "self_attn",
    "fc1": "ff.w1",
    "fc2": "ff.w2",
}


def layer_rename(side: str, rest: str) -> str:
    """`layers.3.fc1.weight` of the encoder or decoder -> our `encoder.3.ff.w1.weight`."""
    index, module, param = _split_layer_key(rest)
    ours = LAYER_NAMES.get(module)
    if ours is None:
        raise UnsupportedModel(f"unknown {side} layer weight {rest!r}")
    if side == "encoder" and module == "final_layer_norm":
        ours = "norm2"
    return f"{side}.{index}.{ours}{param}"


def _split_layer_key(rest: str) -> tuple[str, str, str]:
    """`layers.3.self_attn.q_proj.weight` -> ("3", "self_attn", ".q_proj.weight")."""
    match = re.fullmatch(r"layers\.(\d+)\.([a-z_]+\d?)((?:\.[qkv]_proj|\.out_proj)?\.(?:weight|bias))", rest)
    if match is None:
        raise UnsupportedModel(f"unknown layer weight {rest!r}")
    return match.group(1), match.group(2), match.group(3)


class ConvertedWeights(Mapping[str, np.ndarray]):
    """Our tensors by our names, each read from the checkpoint as float32 when asked for; the few the import
    makes itself (a reshaped or absent logits bias) held."""

    def __init__(self, hf: Mapping[str, np.ndarray], names: dict[str, str], made: dict[str, np.ndarray]) -> None:
        self._hf, self._names, self._made = hf, names, made
        stored = getattr(hf, "shapes", None)  # a lazily read checkpoint knows its shapes without reading
        self.shapes = {ours: tuple(stored[key] if stored else hf[key].shape) for ours, key in names.items()}
        self.shapes |= {name: array.shape for name, array in made.items()}

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._made:
            return self._made[name]
        return self._hf[self._names[name]].astype(np.float32, copy=False)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def convert_weights(hf: Mapping[str, np.ndarray], cfg: ModelConfig) -> ConvertedWeights:
    """transformers' state dict -> ours, float32: embeddings, the logits bias where the config has one, each
    stack's final LayerNorm under pre-norm, the layers."""
    keys = {k.removeprefix("model."): k for k in hf}  # transformers' name without its prefix -> as stored
    names = embeddings(hf, keys, cfg)
    made: dict[str, np.ndarray] = {}
    if cfg.final_logits_bias:
        key = keys.pop("final_logits_bias", None)
        bias = hf[key] if key is not None else np.zeros((1, cfg.vocab_size))
        made["logits_bias"] = bias.astype(np.float32).reshape(cfg.vocab_size)
    for side in ("encoder", "decoder"):
        positions = keys.pop(f"{side}.embed_positions.weight", None)
        check_positions(hf[positions] if positions is not None else None, cfg)
        if cfg.norm_placement == "pre":
            for param in ("weight", "bias"):
                if (norm := keys.pop(f"{side}.layer_norm.{param}", None)) is None:
                    raise UnsupportedModel(f"no {side}.layer_norm.{param} among the weights of a pre-norm model")
                names[f"{side}_norm.{param}"] = norm
    for name, key in keys.items():
        side, _, rest = name.partition(".")
        if side not in ("encoder", "decoder"):
            raise UnsupportedModel(f"unknown weight {name!r}")
        names[layer_rename(side, rest)] = key
    return ConvertedWeights(hf, names, made)


def embeddings(hf: Mapping[str, np.ndarray], keys: dict[str, str], cfg: ModelConfig) -> dict[str, str]:
    """Pops the embedding tables and the output projection from `keys`: one table for both sides and the
    output, or a separate source table where the config keeps two; an untied output is refused. Our names ->
    the checkpoint's."""
    target = keys.pop("decoder.embed_tokens.weight", None)
    shared = keys.pop("shared.weight", None)
    source = keys.pop("encoder.embed_tokens.weight", None)
    target = target if target is not None else shared
    if target is None:
        raise UnsupportedModel("no decoder or shared embedding table among the weights")
    ours = {"embed.weight": target}
    if cfg.src_vocab_size:
        if source is None:
            raise UnsupportedModel("no encoder embedding table among the weights of a model with two vocabularies")
        ours["src_embed.weight"] = source
    elif source is not None and not np.array_equal(hf[source], hf[target]):
        raise UnsupportedModel("encoder and decoder embeddings differ although the config shares them")
    lm_head = keys.pop("lm_head.weight", None)
    if lm_head is not None and not np.array_equal(hf[lm_head], hf[target]):
        raise UnsupportedModel("lm_head is not tied to the decoder embedding; an untied output is not representable")
    return ours


def check_positions(saved: np.ndarray | None, cfg: ModelConfig) -> None:
    """A saved position table must be the sinusoids our model rebuilds (in the config's layout, from row 0)."""
    if saved is None:
        return
    rebuilt = sinusoid_table(saved.shape[0], cfg.d_model, cfg.position_layout)
    if not np.allclose(saved, rebuilt, atol=1e-5):
        raise UnsupportedModel(
            f"embed_positions is not the {cfg.position_layout} sinusoid table; learned positions are not supported"
        )
