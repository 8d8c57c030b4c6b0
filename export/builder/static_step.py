"""decoder_step_static.onnx from the weights: a decoder step whose every shape is fixed by its bound buffers
and whose every value stays on the device, so that a CUDA graph can capture it.

In: tokens (B,), positions (B,), src_mask (B, S), cross_k_i / cross_v_i (B, H, S, Dh), past_k_i / past_v_i
(B, H, L, Dh) with L = max_target_len, then the ranking's row_scores (B,) and bias_ids / bias_values (B, J).
Out: log_probs (B, V) float32, top_scores / top_ids (B, K) and bias_scores (B, J), with K =
model.directory.STATIC_TOP_K (or V if smaller) and J = MAX_BIAS_PER_ROW fixed in the graph, present_k_i /
present_v_i (B, H, L, Dh).

Self-attention is onnxruntime's GroupQueryAttention (kv_num_heads = num_heads: plain multi-head attention)
in its shared-buffer form: present_* is bound to the very buffer of past_*, the step writes each row's new
key and value at that row's own position, and a row attends to entries 0 .. position, read from the
per-row lengths on the device (positions, cast in the graph). Its total_sequence_length, which the kernel
reads on the host, is the constant L. Cross-attention reads caches of the bound source length S under the
per-row source mask. No Shape, If or other op whose result the host must read: the graph replays as
captured for any tokens, positions and masks.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto

from export.builder import layers
from export.builder.decoder import decoder_stack, row_inputs
from export.builder.graph import GraphBuilder
from export.builder.ranking import add_candidate_selection
from export.builder.weights import Weights
from model.config import ModelConfig
from model.directory import HEAD_DIM_MULTIPLE, STATIC_TOP_K, capturable_head_dim

HOST_READ_OPS = frozenset({"Shape", "Size", "If", "Loop", "NonZero"})  # ops whose results shape the run on the host


def capturable(cfg: ModelConfig) -> bool:
    """Whether the static step can be built for this model's attention shape."""
    return capturable_head_dim(cfg.head_dim)


def shared_buffer_attention(b: GraphBuilder, i: int, qkv: tuple[str, str, str], seqlens: str, cfg: ModelConfig) -> str:
    """GroupQueryAttention of layer i over its shared past/present buffers (B, H, L, Dh), naming present_*:
    queries, keys and values (B, 1, D) each, or packed (B, 1, 3D) with the other two "" -> (B, 1, D)."""
    kv_dims: list[int | str] = ["B", cfg.n_heads, cfg.max_len, cfg.head_dim]
    past = [b.add_input(f"past_{kind}_{i}", b.elem, kv_dims) for kind in "kv"]
    total = b.const(np.int32(cfg.max_len), np.int32, "total_sequence_length")
    node = b.op_n(
        "GroupQueryAttention", *qkv, past[0], past[1], seqlens, total, outputs=3, domain="com.microsoft",
        num_heads=cfg.n_heads, kv_num_heads=cfg.n_heads, scale=1.0 / math.sqrt(cfg.head_dim),
    )  # fmt: skip
    for kind, value in zip("kv", node[1:], strict=True):
        b.rename(value, f"present_{kind}_{i}")
    return node[0]


def static_self_attention(b: GraphBuilder, w: Weights, i: int, h: str, seqlens: str, cfg: ModelConfig) -> str:
    """GroupQueryAttention of h (B, 1, D) over layer i's shared past/present buffers -> (B, 1, D)."""
    prefix = f"decoder.{i}.self_attn"
    with b.scope("self_attn"):
        q, k, v = (layers.linear(b, w, f"{prefix}.{name}", h, name) for name in ("q_proj", "k_proj", "v_proj"))
        attended = shared_buffer_attention(b, i, (q, k, v), seqlens, cfg)
        return layers.linear(b, w, f"{prefix}.out_proj", attended, "out_proj")


def static_inputs(b: GraphBuilder, w: Weights, cfg: ModelConfig) -> tuple[str, str, str]:
    """`row_inputs` without past_keep; returns x (B, 1, D), the per-row past lengths (B,) int32 that
    GroupQueryAttention reads, and the source keep mask (B, 1, 1, S)."""
    x, positions, src_keep = row_inputs(b, w, cfg, past_keep=False)
    with b.scope("decoder"):
        seqlens = b.op("Cast", positions, to=TensorProto.INT32, name="seqlens_k")  # entries before this step
    return x, seqlens, src_keep


def static_step_graph(w: Weights, cfg: ModelConfig, dtype: np.dtype, opset: int) -> onnx.ModelProto:
    if not capturable(cfg):
        raise ValueError(f"head_dim {cfg.head_dim} is not a multiple of {HEAD_DIM_MULTIPLE}")
    b = GraphBuilder("decoder_step_static", dtype)
    x, seqlens, src_keep = static_inputs(b, w, cfg)
    decoder_stack(b, w, x, lambda i, h: static_self_attention(b, w, i, h, seqlens, cfg), src_keep, cfg)
    add_candidate_selection(b, "log_probs", fixed_k=min(STATIC_TOP_K, cfg.vocab_size))
    for i in range(cfg.n_decoder_layers):
        for kind in "kv":
            b.add_output(f"present_{kind}_{i}", b.elem, ["B", cfg.n_heads, cfg.max_len, cfg.head_dim])
    return b.model(opset)


def check_capturable(model: onnx.ModelProto, path: object) -> None:
    """No op whose result the host reads to shape or route the run: a captured graph would freeze it."""
    found = sorted({node.op_type for node in model.graph.node} & HOST_READ_OPS)
    if found:
        raise RuntimeError(f"{path} is not capturable: it contains {', '.join(found)}")
