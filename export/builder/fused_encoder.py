"""encoder_fused.onnx from the weights: the encoder (`export.builder.encoder`, whose inputs and outputs it keeps
exactly) built from onnxruntime's fused contrib ops (`export.builder.fused`), for the fused runner.

An encoder call is not captured (its shapes follow each batch's sources), so every kernel also pays its launch,
and a plain encoder call costs several decoder steps (docs/benchmarks.md#gpu). Here each
layer's self-attention is one packed QKV MatMul, a Split and one MultiHeadAttention under the key padding mask,
every residual and norm one SkipLayerNormalization, and the cross keys and values of all decoder layers come
from one MatMul over their concatenated weights, one transpose and one split, instead of a projection, a
reshape and a transpose per key and per value of every decoder layer.
"""

from __future__ import annotations

import numpy as np
import onnx

from export.builder import fused, layers
from export.builder.encoder import encoder_inputs
from export.builder.graph import GraphBuilder
from export.builder.weights import Weights
from model.config import ModelConfig


def fused_encoder_layer(
    b: GraphBuilder, w: Weights, i: int, stream: fused.Stream, key_mask: str, cfg: ModelConfig
) -> fused.Stream:
    """Self-attention then feed-forward, each closed by its fused residual and norm: (B, S, D) -> (B, S, D)."""
    prefix = f"encoder.{i}"
    last = i + 1 == cfg.n_encoder_layers
    after = [f"{prefix}.norm2", "encoder_norm" if last else f"encoder.{i + 1}.norm1"]
    if cfg.norm_placement == "post":
        after = ["", ""]
    with b.scope(f"encoder/layers.{i}"):
        with b.scope("self_attn"):
            qkv = fused.packed_qkv(b, w, f"{prefix}.self_attn", stream.h)  # (B, S, 3D)
            sizes = b.ints(cfg.d_model, cfg.d_model, cfg.d_model)  # sizes, not num_outputs: opset 17 too
            q, k, v = b.op_n("Split", qkv, sizes, outputs=3, axis=-1)  # each (B, S, D)
            attended = b.op(
                "MultiHeadAttention", q, k, v, "", key_mask, domain=fused.MS, num_heads=cfg.n_heads,
                mask_filter_value=layers.MASK_VALUE,
            )  # fmt: skip
            product = fused.matmul(b, w, f"{prefix}.self_attn.out_proj", attended)
        out_bias = fused.bias(b, w, f"{prefix}.self_attn.out_proj")
        stream = fused.residual(b, w, product, out_bias, stream, f"{prefix}.norm1", after[0])
        fed = fused.feed_forward(b, w, prefix, stream.h, cfg)
        return fused.residual(b, w, fed, fused.bias(b, w, f"{prefix}.ff.w2"), stream, f"{prefix}.norm2", after[1])


def cross_keys_and_values(b: GraphBuilder, w: Weights, memory: str, cfg: ModelConfig) -> list[str]:
    """Every decoder layer's cross keys and values of memory (B, S, D), in one MatMul: 2L values (B, H, S, Dh),
    k then v for each layer."""
    names = [f"decoder.{i}.cross_attn.{kind}_proj" for i in range(cfg.n_decoder_layers) for kind in "kv"]
    weight = np.concatenate([w[f"{name}.weight"].T for name in names], axis=1)  # (D, 2L D)
    packed_bias = np.concatenate([w[f"{name}.bias"] for name in names])
    with b.scope("decoder/cross_kv"):
        product = b.matmul(memory, "decoder.cross_kv_proj.weight", weight)
        projected = b.op("Add", product, b.weight("decoder.cross_kv_proj.bias", packed_bias))  # (B, S, 2L D)
        heads = b.op("Reshape", projected, b.ints(0, 0, len(names), cfg.n_heads, cfg.head_dim))  # (B, S, 2L, H, Dh)
        stacked = b.op("Transpose", heads, perm=[2, 0, 3, 1, 4])  # (2L, B, H, S, Dh)
        parts = b.op_n("Split", stacked, b.ints(*[1] * len(names)), outputs=len(names), axis=0)
        return [b.op("Squeeze", part, b.ints(0)) for part in parts]  # each (B, H, S, Dh)


def fused_encoder_graph(w: Weights, cfg: ModelConfig, dtype: np.dtype, opset: int) -> onnx.ModelProto:
    b = GraphBuilder("encoder_fused", dtype)
    src_mask, x = encoder_inputs(b, w, cfg)
    with b.scope("encoder"):
        key_mask = fused.key_padding_mask(b, src_mask)
        stream = fused.first_stream(b, w, x, cfg, "encoder.0.norm1")
    for i in range(cfg.n_encoder_layers):
        stream = fused_encoder_layer(b, w, i, stream, key_mask, cfg)
    # under pre-norm the last residual normalised with encoder_norm: stream.h is the memory either way
    kv_dims: list[int | str] = ["B", cfg.n_heads, "S", cfg.head_dim]
    outputs = cross_keys_and_values(b, w, stream.h, cfg)
    for index, value in enumerate(outputs):
        kind, layer = "kv"[index % 2], index // 2
        b.add_output(b.rename(value, f"cross_{kind}_{layer}"), b.elem, kv_dims)
    return b.model(opset)
