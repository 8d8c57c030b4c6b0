"""The Transformer's sublayers as onnxruntime's fused contrib ops (com.microsoft), for the fused builds of the
capturable step (`export.builder.fused_step`) and the encoder (`export.builder.fused_encoder`).

A captured step replays every kernel of its graph; at OPUS-MT's size each is a few microseconds of a small
batch, so the count of kernels, not arithmetic, sets the step's time (and an uncaptured encoder call also
pays each kernel's launch). Fused here, against the plain ops of `export.builder.layers` (per decoder layer,
about half the kernels):

- self-attention's three projections as one MatMul over the concatenated weights, read by
  GroupQueryAttention as packed QKV;
- each residual sum and its LayerNorm, with the sublayer's output bias, as one SkipLayerNormalization;
- cross-attention (scores, mask, softmax, weighted sum and the head transposes) as one MultiHeadAttention
  over the cached keys and values in their (B, H, S, Dh) layout, under the source's key padding mask;
- the feed-forward's bias and activation as BiasGelu (exact GELU), or Add then Relu / QuickGelu (alpha 1:
  x * sigmoid(x), SiLU).

Pre-norm chains the norms: the SkipLayerNormalization after a sublayer normalises the residual sum with the
next sublayer's norm (the next layer's norm1, after the last layer the decoder's final norm) and also outputs
the sum, which carries the residual stream. Post-norm normalises with the sublayer's own norm, and the
normalised sum is the stream. Both CPU and CUDA implement every op used, in float32 and float16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from export.builder import layers
from export.builder.graph import GraphBuilder
from export.builder.weights import Weights
from model.config import ModelConfig

MS = "com.microsoft"


@dataclass(frozen=True)
class Stream:
    """Where a layer stands: the residual stream x (B, T, D), and under pre-norm its normalisation h with the
    norm of the sublayer that reads it next (under post-norm h is x)."""

    x: str
    h: str


def matmul(b: GraphBuilder, w: Weights, prefix: str, x: str) -> str:
    """x @ W^T without the bias, which the op after it adds."""
    return b.matmul(x, f"{prefix}.weight", w[f"{prefix}.weight"].T)


def bias(b: GraphBuilder, w: Weights, prefix: str) -> str:
    return b.weight(f"{prefix}.bias", w[f"{prefix}.bias"])


def packed_qkv(b: GraphBuilder, w: Weights, prefix: str, h: str) -> str:
    """(B, T, D) -> (B, T, 3D): the query, key and value projections in one MatMul and one Add."""
    names = [f"{prefix}.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    weight = np.concatenate([w[f"{name}.weight"].T for name in names], axis=1)  # (D, 3D)
    packed_bias = np.concatenate([w[f"{name}.bias"] for name in names])
    product = b.matmul(h, f"{prefix}.qkv_proj.weight", weight)
    return b.op("Add", product, b.weight(f"{prefix}.qkv_proj.bias", packed_bias))


def first_stream(b: GraphBuilder, w: Weights, x: str, cfg: ModelConfig, norm: str = "decoder.0.norm1") -> Stream:
    """The embeddings as the first layer reads them (under pre-norm, normalised by its `norm`)."""
    if cfg.norm_placement == "post":
        return Stream(x, x)
    return Stream(x, layers.layer_norm(b, w, norm, x, "norm1"))


def residual(b: GraphBuilder, w: Weights, out: str, out_bias: str, stream: Stream, norm: str, after: str) -> Stream:
    """stream.x + out + out_bias, normalised: under post-norm (`after` empty) by `norm`, the sublayer's own;
    under pre-norm by `after`, the next sublayer's, the sum kept as the stream."""
    used = norm if after == "" else after
    with b.scope(f"{norm.rsplit('.', 1)[-1]}_residual"):
        scale, shift = (b.weight(f"{used}.{p}", w[f"{used}.{p}"]) for p in ("weight", "bias"))
        normed, _, _, total = b.op_n(
            "SkipLayerNormalization", out, stream.x, scale, shift, out_bias, outputs=4, domain=MS,
            epsilon=layers.LAYER_NORM_EPS,
        )  # fmt: skip
    node = b.nodes[-1]
    node.output[1] = node.output[2] = ""  # mean and inverse deviation: not computed (CUDA has neither)
    if after == "":
        node.output[3] = ""
        return Stream(normed, normed)
    return Stream(total, normed)


def feed_forward(b: GraphBuilder, w: Weights, prefix: str, h: str, cfg: ModelConfig) -> str:
    """(B, T, D) -> the second projection's product (B, T, D), its bias left to the residual."""
    with b.scope("ff"):
        hidden = matmul(b, w, f"{prefix}.ff.w1", h)
        first_bias = bias(b, w, f"{prefix}.ff.w1")
        if cfg.activation == "gelu":
            active = b.op("BiasGelu", hidden, first_bias, domain=MS)
        else:
            biased = b.op("Add", hidden, first_bias)
            active = (
                b.op("Relu", biased) if cfg.activation == "relu" else b.op("QuickGelu", biased, domain=MS, alpha=1.0)
            )
        return matmul(b, w, f"{prefix}.ff.w2", active)


def cross_attention(b: GraphBuilder, w: Weights, i: int, h: str, key_mask: str, cfg: ModelConfig) -> str:
    """Queries of h (B, 1, D) against layer i's cached cross keys and values (B, H, S, Dh) -> the output
    projection's product (B, 1, D), its bias left to the residual."""
    prefix = f"decoder.{i}.cross_attn"
    with b.scope("cross_attn"):
        q = layers.linear(b, w, f"{prefix}.q_proj", h, "q_proj")
        attended = b.op(
            "MultiHeadAttention", q, f"cross_k_{i}", f"cross_v_{i}", "", key_mask, domain=MS,
            num_heads=cfg.n_heads, mask_filter_value=layers.MASK_VALUE,
        )  # fmt: skip
        return matmul(b, w, f"{prefix}.out_proj", attended)


def buffer_inputs(b: GraphBuilder, prefix: str, i: int, dims: list[int | str]) -> tuple[str, str]:
    """Layer i's key and value buffer inputs, `{prefix}_k_i` and `{prefix}_v_i` of `dims` (B, H, length, Dh)."""
    return b.add_input(f"{prefix}_k_{i}", b.elem, dims), b.add_input(f"{prefix}_v_{i}", b.elem, dims)


def shared_buffer_attention(
    b: GraphBuilder, qkv: tuple[str, str, str], buffers: tuple[str, str], present: tuple[str, str], seqlens: str,
    total: str, cfg: ModelConfig, groups: tuple[str, str] | None = None,
) -> str:  # fmt: skip
    """GroupQueryAttention (kv_num_heads = num_heads: plain multi-head attention) in its shared-buffer form over
    the key and value `buffers` (B, H, length, Dh), whose updated forms the outputs named `present` are: bound
    to the very same memory, the step writes each row's new key and value at that row's own position `seqlens`
    (int32 (B,)) and the row attends to its entries 0 .. seqlens, nothing past them. `total` is the int32
    scalar total_sequence_length, which the kernel reads on the host. Queries, keys and values (B, 1, H x Dh)
    each, or packed (B, 1, 3 x H x Dh) with the other two "" -> (B, 1, H x Dh); scores scaled by the model's
    own head size, whatever Dh the buffers pad it to.

    With `groups` (attention_bias (B, 1, G, length), query_seqlens int32 (B,)), each of the B buffers serves G
    queries (B, G, H x Dh) at once: the kernel writes the G new keys and values at seqlens - G + 1 .. seqlens
    and query g attends causally to entries 0 .. seqlens - G + 1 + g, which the bias narrows."""
    extra = ("", "", "", groups[0], "", "", "", "", "", groups[1]) if groups else ()
    node = b.op_n(
        "GroupQueryAttention", *qkv, *buffers, seqlens, total, *extra, outputs=3, domain=MS,
        num_heads=cfg.n_heads, kv_num_heads=cfg.n_heads, scale=1.0 / math.sqrt(cfg.head_dim),
    )  # fmt: skip
    for value, name in zip(node[1:], present, strict=True):
        b.rename(value, name)
    return node[0]


def key_padding_mask(b: GraphBuilder, src_mask: str) -> str:
    """(B, S) bool -> (B, S) int32, MultiHeadAttention's key padding mask (1 = attend)."""
    return b.op("Cast", src_mask, to=TensorProto.INT32, name="key_padding_mask")
