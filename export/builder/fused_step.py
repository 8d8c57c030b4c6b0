"""decoder_step_fused.onnx from the weights: a decoder step whose every shape is fixed by its bound buffers and
whose every value stays on the device, so that a CUDA graph can capture it; served by `--kv-cache fused`.

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
per-row source mask. No Shape, If or other op whose result the host must read (`check_capturable`): the graph
replays as captured for any tokens, positions and masks.

Built from onnxruntime's fused contrib ops (`export.builder.fused`): packed QKV into GroupQueryAttention,
MultiHeadAttention over the cross caches, SkipLayerNormalization for every residual and norm, the
feed-forward's activation fused with its bias where onnxruntime has the op: few kernels per decoder layer, for
a CUDA graph that replays every kernel it holds.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from export.builder import fused
from export.builder.decoder import log_probs, row_inputs
from export.builder.graph import GraphBuilder
from export.builder.ranking import add_candidate_selection
from export.builder.weights import Weights
from model.config import ModelConfig
from model.directory import HEAD_DIM_MULTIPLE, STATIC_TOP_K, capturable_head_dim

HOST_READ_OPS = frozenset({"Shape", "Size", "If", "Loop", "NonZero"})  # ops whose results shape the run on the host


def capturable(cfg: ModelConfig) -> bool:
    """Whether the capturable step can be built for this model's attention shape."""
    return capturable_head_dim(cfg.head_dim)


def check_capturable(model: onnx.ModelProto, path: object) -> None:
    """No op whose result the host reads to shape or route the run: a captured graph would freeze it."""
    found = sorted({node.op_type for node in model.graph.node} & HOST_READ_OPS)
    if found:
        raise RuntimeError(f"{path} is not capturable: it contains {', '.join(found)}")


def fused_self_attention(b: GraphBuilder, w: Weights, i: int, h: str, seqlens: str, cfg: ModelConfig) -> str:
    """GroupQueryAttention of h (B, 1, D), packed QKV, over layer i's shared past/present buffers (B, H, L, Dh)
    -> the output projection's product (B, 1, D), its bias left to the residual."""
    prefix = f"decoder.{i}.self_attn"
    with b.scope("self_attn"):
        qkv = fused.packed_qkv(b, w, prefix, h)  # (B, 1, 3D)
        total = b.const(np.int32(cfg.max_len), np.int32, "total_sequence_length")
        buffers = fused.buffer_inputs(b, "past", i, ["B", cfg.n_heads, cfg.max_len, cfg.head_dim])
        present = (f"present_k_{i}", f"present_v_{i}")
        attended = fused.shared_buffer_attention(b, (qkv, "", ""), buffers, present, seqlens, total, cfg)
        return fused.matmul(b, w, f"{prefix}.out_proj", attended)


def fused_layer(
    b: GraphBuilder, w: Weights, i: int, stream: fused.Stream, seqlens: str, key_mask: str, cfg: ModelConfig
) -> fused.Stream:
    """Self-attention, encoder-decoder attention, feed-forward, each closed by its fused residual and norm."""
    prefix = f"decoder.{i}"
    last = i + 1 == cfg.n_decoder_layers
    # under pre-norm, the norm of what reads each sublayer's sum: the next sublayer's, then the next layer's
    after = [f"{prefix}.norm2", f"{prefix}.norm3", "decoder_norm" if last else f"decoder.{i + 1}.norm1"]
    if cfg.norm_placement == "post":
        after = ["", "", ""]
    with b.scope(f"decoder/layers.{i}"):
        attended = fused_self_attention(b, w, i, stream.h, seqlens, cfg)
        out_bias = fused.bias(b, w, f"{prefix}.self_attn.out_proj")
        stream = fused.residual(b, w, attended, out_bias, stream, f"{prefix}.norm1", after[0])
        crossed = fused.cross_attention(b, w, i, stream.h, key_mask, cfg)
        out_bias = fused.bias(b, w, f"{prefix}.cross_attn.out_proj")
        stream = fused.residual(b, w, crossed, out_bias, stream, f"{prefix}.norm2", after[1])
        fed = fused.feed_forward(b, w, prefix, stream.h, cfg)
        return fused.residual(b, w, fed, fused.bias(b, w, f"{prefix}.ff.w2"), stream, f"{prefix}.norm3", after[2])


def fused_step_graph(w: Weights, cfg: ModelConfig, dtype: np.dtype, opset: int) -> onnx.ModelProto:
    if not capturable(cfg):
        raise ValueError(f"head_dim {cfg.head_dim} is not a multiple of {HEAD_DIM_MULTIPLE}")
    b = GraphBuilder("decoder_step_fused", dtype)
    x, positions, src_mask = row_inputs(b, w, cfg, keep_mask=False)
    with b.scope("decoder"):
        seqlens = b.op("Cast", positions, to=TensorProto.INT32, name="seqlens_k")  # entries before this step
        key_mask = fused.key_padding_mask(b, src_mask)
        stream = fused.first_stream(b, w, x, cfg)
    for i in range(cfg.n_decoder_layers):
        stream = fused_layer(b, w, i, stream, seqlens, key_mask, cfg)
    b.add_output(log_probs(b, w, stream.h, cfg, normed=True), TensorProto.FLOAT, ["B", cfg.vocab_size])
    add_candidate_selection(b, "log_probs", fixed_k=min(STATIC_TOP_K, cfg.vocab_size))
    for i in range(cfg.n_decoder_layers):
        for kind in "kv":
            b.add_output(f"present_{kind}_{i}", b.elem, ["B", cfg.n_heads, cfg.max_len, cfg.head_dim])
    return b.model(opset)
