"""encoder.onnx from the weights: src_ids (B, S), src_mask (B, S) -> cross_k_i, cross_v_i (B, H, S, Dh') for every
decoder layer i, the encoder-decoder keys and values the decoder step reads instead of recomputing them (Dh' =
`model.directory.buffer_head_dim` of the model's head size, each head's extra entries zero).

The per-token work (embeddings, projections, norms, feed-forward) runs on the batch's real tokens only, packed
(T, D) (`layers.Packing`); attention alone sees the padded (B, S) layout. A batch of sentences of mixed lengths
is mostly padding, which a padded encoder computes in full (docs/decisions.md). Positions past a source's end
in the cross keys and values repeat a real token's: the decoder reads each row's own entries only."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from export.builder import layers
from export.builder.graph import GraphBuilder
from export.builder.int8 import Int8Recipe
from export.builder.weights import Weights
from model.config import ModelConfig
from model.directory import buffer_head_dim


def encoder_layer(
    b: GraphBuilder, w: Weights, i: int, x: str, keep: str, packing: layers.Packing, cfg: ModelConfig
) -> str:
    """Self-attention then feed-forward, each in a pre- or post-norm residual, over packed tokens: (T, D) -> (T, D)."""
    prefix = f"encoder.{i}"
    with b.scope(f"encoder/layers.{i}"):
        h = layers.residual_input(b, w, f"{prefix}.norm1", x, cfg)
        with b.scope("self_attn"):
            kv = layers.project_kv(b, w, f"{prefix}.self_attn", h, cfg, packing)
            attended = layers.multi_head_attention(b, w, f"{prefix}.self_attn", h, kv, keep, cfg, packing)
        x = layers.residual_output(b, w, f"{prefix}.norm1", x, attended, cfg)
        h = layers.residual_input(b, w, f"{prefix}.norm2", x, cfg)
        return layers.residual_output(b, w, f"{prefix}.norm2", x, layers.feed_forward(b, w, prefix, h, cfg), cfg)


def encoder_inputs(b: GraphBuilder, w: Weights, cfg: ModelConfig) -> tuple[str, str]:
    """The graph's inputs src_ids and src_mask (B, S), and the embedded sources x (B, S, D): src_mask, x."""
    src_ids = b.add_input("src_ids", TensorProto.INT64, ["B", "S"])
    src_mask = b.add_input("src_mask", TensorProto.BOOL, ["B", "S"])
    with b.scope("encoder"):
        length = b.op("Gather", b.op("Shape", src_ids), b.const(1, np.int64), axis=0)  # S, a scalar
        positions = b.op("Range", b.const(0, np.int64), length, b.const(1, np.int64))  # (S,)
        table = "src_embed.weight" if cfg.src_vocab_size else "embed.weight"
        return src_mask, layers.embed(b, w, table, src_ids, positions, cfg)


def packed_inputs(b: GraphBuilder, w: Weights, cfg: ModelConfig) -> tuple[str, layers.Packing, str]:
    """The graph's inputs src_ids and src_mask (B, S); returns src_mask, its packing and the real tokens embedded
    at their positions, x (T, D)."""
    src_ids = b.add_input("src_ids", TensorProto.INT64, ["B", "S"])
    src_mask = b.add_input("src_mask", TensorProto.BOOL, ["B", "S"])
    with b.scope("encoder"):
        packing = layers.pack_tokens(b, src_mask)
        ids = b.op("Gather", b.op("Reshape", src_ids, b.ints(-1)), packing.kept, axis=0)  # (T,)
        length = b.op("Gather", b.op("Shape", src_ids), b.const(1, np.int64), axis=0)  # S, a scalar
        positions = b.op("Mod", packing.kept, length)  # (T,) each token's column
        table = "src_embed.weight" if cfg.src_vocab_size else "embed.weight"
        return src_mask, packing, layers.embed(b, w, table, ids, positions, cfg)


def encoder_graph(
    w: Weights, cfg: ModelConfig, dtype: np.dtype, opset: int, int8: Int8Recipe | None = None
) -> onnx.ModelProto:
    b = GraphBuilder("encoder", dtype, int8)
    src_mask, packing, x = packed_inputs(b, w, cfg)
    with b.scope("encoder"):
        keep = layers.keep_mask(b, src_mask)  # (B, 1, 1, S)
    for i in range(cfg.n_encoder_layers):
        x = encoder_layer(b, w, i, x, keep, packing, cfg)
    if cfg.norm_placement == "pre":
        with b.scope("encoder"):
            x = layers.layer_norm(b, w, "encoder_norm", x, "encoder_norm")  # memory (T, D)
    kv_dims: list[int | str] = ["B", cfg.n_heads, "S", buffer_head_dim(cfg.head_dim)]
    for i in range(cfg.n_decoder_layers):
        with b.scope(f"decoder/layers.{i}/cross_attn"):
            k, v = layers.project_kv(b, w, f"decoder.{i}.cross_attn", x, cfg, packing, padded=True)
        for kind, value in (("k", k), ("v", v)):
            b.add_output(b.rename(value, f"cross_{kind}_{i}"), b.elem, kv_dims)
    return b.model(opset)
