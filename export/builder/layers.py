"""The Transformer's sublayers written as ONNX nodes, one small function each, mirroring model/training/transformer.py.

Every function takes the builder, the checkpoint prefix of its weights and value names, and returns the name
of its output. Dimensions as everywhere: B rows, T query positions, S key positions, D, H heads, Dh head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from export.builder.graph import GraphBuilder
from export.builder.positions import sinusoid_table
from export.builder.weights import Weights
from model.config import ModelConfig
from model.directory import buffer_head_dim

MASK_VALUE = -1e4  # model.training.transformer.MASK_VALUE: finite, so float16 neither overflows nor yields NaN rows
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default


def linear(b: GraphBuilder, w: Weights, prefix: str, x: str, scope: str) -> str:
    """x @ W^T + bias, as torch.nn.Linear; the transposed weight (in, out) is stored, so MatMul reads it
    directly."""
    return affine(b, prefix, x, scope, w[f"{prefix}.weight"].T, w[f"{prefix}.bias"])


def affine(b: GraphBuilder, prefix: str, x: str, scope: str, weight: np.ndarray, bias: np.ndarray) -> str:
    """x @ weight + bias, weight (in, out) and bias stored under `prefix`'s checkpoint names."""
    with b.scope(scope):
        product = b.matmul(x, f"{prefix}.weight", weight)
        return b.op("Add", product, b.weight(f"{prefix}.bias", bias))


def head_linear(b: GraphBuilder, w: Weights, prefix: str, x: str, scope: str, cfg: ModelConfig, side: str) -> str:
    """`linear` whose H x Dh side (`side` "out": its outputs, a projection into heads; "in": its inputs, the
    projection out of them) is H x buffer_head_dim(Dh), the head size the attention kernel takes: each head's
    extra outputs are zero, or its extra inputs meet zero rows, so every sum is `linear`'s (and int8, whose
    range holds zero already, quantizes the real weights alike). `linear` itself where Dh needs no padding."""
    width = buffer_head_dim(cfg.head_dim)
    weight, bias = w[f"{prefix}.weight"].T, w[f"{prefix}.bias"]  # (in, out), (out,)
    if side == "out":
        weight, bias = pad_heads(weight, cfg, width, axis=1), pad_heads(bias, cfg, width, axis=0)
    else:
        weight = pad_heads(weight, cfg, width, axis=0)
    return affine(b, prefix, x, scope, weight, bias)


def pad_heads(array: np.ndarray, cfg: ModelConfig, width: int, axis: int) -> np.ndarray:
    """`array` with its H x Dh axis `axis` widened to H x width, each head's extra entries zero."""
    if width == cfg.head_dim:
        return array
    shape = array.shape
    heads = array.reshape(*shape[:axis], cfg.n_heads, cfg.head_dim, *shape[axis + 1 :])
    pad = [(0, 0)] * heads.ndim
    pad[axis + 1] = (0, width - cfg.head_dim)
    return np.pad(heads, pad).reshape(*shape[:axis], cfg.n_heads * width, *shape[axis + 1 :])


def layer_norm(b: GraphBuilder, w: Weights, prefix: str, x: str, scope: str) -> str:
    with b.scope(scope):
        scale, bias = (
            b.weight(f"{prefix}.weight", w[f"{prefix}.weight"]),
            b.weight(f"{prefix}.bias", w[f"{prefix}.bias"]),
        )
        return b.op("LayerNormalization", x, scale, bias, axis=-1, epsilon=LAYER_NORM_EPS)


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a padded (B, S) batch sit, so that the encoder's per-token work (projections,
    norms, feed-forward) runs on those T tokens only, (T, D), and attention alone on the padded (B, S) layout."""

    kept: str  # (T,) each real token's position in the flattened B * S
    row_of: str  # (B * S,) the packed row each position reads back: its own token's, any real row at padding
    padded: str  # (3,) the padded shape [B, S, -1]: the width of whatever is unpacked


def pack_tokens(b: GraphBuilder, mask: str) -> Packing:
    """The packing of a (B, S) bool mask. Padding reads back a real row, not zeros: attention masks those keys
    (weight exactly 0 times a finite value) and the padded queries' outputs are packed away unread."""
    flat = b.op("Reshape", mask, b.ints(-1))  # (B * S,)
    kept = b.op("Squeeze", b.op("NonZero", flat), b.ints(0))  # (T,)
    count = b.op("CumSum", b.op("Cast", flat, to=TensorProto.INT64), b.const(0, np.int64))  # (B * S,)
    row_of = b.op("Where", flat, b.op("Sub", count, b.const(1, np.int64)), b.const(0, np.int64))
    padded = b.op("Concat", b.op("Shape", mask), b.ints(-1), axis=0)
    return Packing(kept, row_of, padded)


def unpack(b: GraphBuilder, packing: Packing, x: str) -> str:
    """(T, N) -> (B, S, N)."""
    return b.op("Reshape", b.op("Gather", x, packing.row_of, axis=0), packing.padded)


def pack(b: GraphBuilder, packing: Packing, x: str, cfg: ModelConfig) -> str:
    """(B, S, D) -> (T, D)."""
    return b.op("Gather", b.op("Reshape", x, b.ints(-1, cfg.d_model)), packing.kept, axis=0)


def split_heads(b: GraphBuilder, x: str, cfg: ModelConfig, head_dim: int = 0) -> str:
    """(B, T, H x Dh) -> (B, H, T, Dh), Dh the model's head size or `head_dim`."""
    heads = b.op("Reshape", x, b.ints(0, -1, cfg.n_heads, head_dim or cfg.head_dim))  # (B, T, H, Dh)
    return b.op("Transpose", heads, perm=[0, 2, 1, 3])


def merge_heads(b: GraphBuilder, x: str, cfg: ModelConfig) -> str:
    """(B, H, T, Dh) -> (B, T, D)."""
    rows = b.op("Transpose", x, perm=[0, 2, 1, 3])  # (B, T, H, Dh)
    return b.op("Reshape", rows, b.ints(0, -1, cfg.d_model))


def project_kv(
    b: GraphBuilder, w: Weights, prefix: str, x: str, cfg: ModelConfig, packing: Packing | None = None,
    padded: bool = False,
) -> tuple[str, str]:  # fmt: skip
    """Keys and values of x (B, S, D), or of packed tokens x (T, D) with their `packing`, each (B, H, S, Dh); with
    `padded`, each head buffer_head_dim(Dh) wide (`head_linear`)."""
    if padded:
        k, v = (head_linear(b, w, f"{prefix}.{name}", x, name, cfg, "out") for name in ("k_proj", "v_proj"))
    else:
        k, v = (linear(b, w, f"{prefix}.{name}", x, name) for name in ("k_proj", "v_proj"))
    if packing is not None:
        k, v = unpack(b, packing, k), unpack(b, packing, v)
    width = buffer_head_dim(cfg.head_dim) if padded else cfg.head_dim
    return split_heads(b, k, cfg, width), split_heads(b, v, cfg, width)


def attention(b: GraphBuilder, q: str, k: str, v: str, keep: str, cfg: ModelConfig) -> str:
    """softmax(q k^T / sqrt(Dh), masked where `keep` is False) v: q (B, H, T, Dh), k and v (B, H, S, Dh),
    keep broadcastable to (B, H, T, S) -> (B, H, T, Dh)."""
    scores = b.op("MatMul", q, b.op("Transpose", k, perm=[0, 1, 3, 2]))  # (B, H, T, S)
    scaled = b.op("Div", scores, b.scalar(math.sqrt(cfg.head_dim)))
    masked = b.op("Where", keep, scaled, b.scalar(MASK_VALUE))
    return b.op("MatMul", b.op("Softmax", masked, axis=-1), v)


def multi_head_attention(
    b: GraphBuilder, w: Weights, prefix: str, x: str, kv: tuple[str, str], keep: str, cfg: ModelConfig,
    packing: Packing | None = None,
) -> str:  # fmt: skip
    """Queries of x (B, T, D) against precomputed heads kv (B, H, S, Dh) -> (B, T, D); with a `packing`, of the
    packed tokens x (T, D) against their own batch's heads -> (T, D)."""
    q = linear(b, w, f"{prefix}.q_proj", x, "q_proj")
    heads = attention(b, split_heads(b, q if packing is None else unpack(b, packing, q), cfg), kv[0], kv[1], keep, cfg)
    merged = merge_heads(b, heads, cfg)
    return linear(b, w, f"{prefix}.out_proj", merged if packing is None else pack(b, packing, merged, cfg), "out_proj")


def activation(b: GraphBuilder, x: str, kind: str) -> str:
    """The config's feed-forward nonlinearity: ReLU, SiLU (x * sigmoid(x)) or exact GELU (erf)."""
    if kind == "relu":
        return b.op("Relu", x)
    if kind == "swish":
        return b.op("Mul", x, b.op("Sigmoid", x))
    erf = b.op("Erf", b.op("Div", x, b.scalar(math.sqrt(2.0))))
    return b.op("Mul", b.op("Mul", x, b.op("Add", erf, b.scalar(1.0))), b.scalar(0.5))


def feed_forward(b: GraphBuilder, w: Weights, prefix: str, x: str, cfg: ModelConfig) -> str:
    with b.scope("ff"):
        hidden = activation(b, linear(b, w, f"{prefix}.ff.w1", x, "w1"), cfg.activation)
        return linear(b, w, f"{prefix}.ff.w2", hidden, "w2")


def residual_input(b: GraphBuilder, w: Weights, norm: str, x: str, cfg: ModelConfig) -> str:
    """What a sublayer reads: LayerNorm(x) under pre-norm, x itself under post-norm."""
    return layer_norm(b, w, norm, x, norm.rsplit(".", 1)[1]) if cfg.norm_placement == "pre" else x


def residual_output(b: GraphBuilder, w: Weights, norm: str, x: str, out: str, cfg: ModelConfig) -> str:
    """x + out under pre-norm; LayerNorm(x + out) under post-norm."""
    total = b.op("Add", x, out, name=f"{norm.rsplit('.', 1)[1]}_residual")
    return total if cfg.norm_placement == "pre" else layer_norm(b, w, norm, total, norm.rsplit(".", 1)[1])


def embed(b: GraphBuilder, w: Weights, table: str, ids: str, positions: str, cfg: ModelConfig) -> str:
    """Token embedding (times sqrt(D) when `scale_embedding`) plus the sinusoid at each position."""
    tokens = b.lookup(table, w[table], ids)
    if cfg.scale_embedding:
        tokens = b.op("Mul", tokens, b.scalar(math.sqrt(cfg.d_model)))
    rows = sinusoid_table(cfg.max_len, cfg.d_model, cfg.position_layout, cfg.position_offset)
    sinusoids = b.weight("sinusoids", rows)
    return b.op("Add", tokens, b.op("Gather", sinusoids, positions, axis=0))


def keep_mask(b: GraphBuilder, mask: str) -> str:
    """(B, S) bool -> (B, 1, 1, S): every head and query of a row sees the same keys."""
    return b.op("Unsqueeze", mask, b.ints(1, 2))
