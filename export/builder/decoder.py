"""decoder_step.onnx from the weights: one step for B rows at any mix of positions, each row's keys and values
kept in buffers the caller binds.

In: tokens (B,), positions (B,) (each row's entries before this step), src_mask (B, S), cross_k_i / cross_v_i
(B, H, S, Dh), past_k_i / past_v_i (B, H, L, Dh'), then the ranking's row_scores (B,), bias_ids / bias_values
(B, J) and top_k (1,). Out: top_scores / top_ids (B, k), bias_scores (B, J), and present_k_i / present_v_i
(B, H, L, Dh'), Dh' = `model.directory.buffer_head_dim` of the model's head size Dh.

Self-attention is onnxruntime's GroupQueryAttention in its shared-buffer form
(`export.builder.fused.shared_buffer_attention`): bound to the buffers of past_*, present_* is those buffers
with this step's key and value written at each row's position, and a row reads its own entries 0 .. position
only, so the past is neither copied nor read past a row's own entries. L, any length above every position, is
read from past_k_0's shape. No `If` node: every row runs the same nodes. The whole (B, V) distribution is no
output: the ranking works on it in place, and a parity check that wants it ranks all V ids.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto

from export.builder import fused, layers
from export.builder.graph import GraphBuilder
from export.builder.int8 import Int8Recipe
from export.builder.ranking import RANKING_CHUNK, add_chunked_selection
from export.builder.weights import Weights
from model.config import ModelConfig
from model.directory import buffer_head_dim

# model.training.transformer.BANNED_LOG_PROB: finite, so adding a row score stays exact elsewhere
BANNED_LOG_PROB = -1e9

SelfAttention = Callable[[int, str], str]  # (layer i, its normed input h (B, 1, D)) -> attended (B, 1, D)


def self_attention(b: GraphBuilder, w: Weights, i: int, h: str, seqlens: str, total: str, cfg: ModelConfig) -> str:
    """Attend from this step's h (B, 1, D) to each row's own entries in layer i's buffers plus its own key and
    value, which the step writes there (present_*); -> (B, 1, D). The three projections stay three products
    of h, so that int8 quantizes each weight as onnxruntime's `quantize_dynamic` does. A head size the
    attention kernel cannot take is padded (`model.directory.buffer_head_dim`): each head's queries, keys and
    values gain zero columns (a zero adds nothing to q.k; zero in the range quantizes to zero) and the output
    projection zero rows for them, so every sum is the unpadded one."""
    prefix, width = f"decoder.{i}.self_attn", buffer_head_dim(cfg.head_dim)
    with b.scope("self_attn"):
        qkv = []
        for name in ("q_proj", "k_proj", "v_proj"):
            weight, bias = w[f"{prefix}.{name}.weight"].T, w[f"{prefix}.{name}.bias"]  # (D, H * Dh), (H * Dh,)
            with b.scope(name):
                product = b.matmul(h, f"{prefix}.{name}.weight", _pad_heads(weight, cfg, width, axis=1))
                qkv.append(b.op("Add", product, b.weight(f"{prefix}.{name}.bias", _pad_heads(bias, cfg, width, 0))))
        attended = fused.shared_buffer_attention(b, i, (qkv[0], qkv[1], qkv[2]), seqlens, total, "L", cfg, width)
        weight = _pad_heads(w[f"{prefix}.out_proj.weight"].T, cfg, width, axis=0)  # (H * width, D)
        with b.scope("out_proj"):
            product = b.matmul(attended, f"{prefix}.out_proj.weight", weight)
            return b.op("Add", product, b.weight(f"{prefix}.out_proj.bias", w[f"{prefix}.out_proj.bias"]))


def _pad_heads(array: np.ndarray, cfg: ModelConfig, width: int, axis: int) -> np.ndarray:
    """`array` with its H x Dh axis `axis` widened to H x width, each head's extra entries zero."""
    if width == cfg.head_dim:
        return array
    shape = array.shape
    heads = array.reshape(*shape[:axis], cfg.n_heads, cfg.head_dim, *shape[axis + 1 :])
    pad = [(0, 0)] * heads.ndim
    pad[axis + 1] = (0, width - cfg.head_dim)
    return np.pad(heads, pad).reshape(*shape[:axis], cfg.n_heads * width, *shape[axis + 1 :])


def decoder_layer(
    b: GraphBuilder, w: Weights, i: int, x: str, attend: SelfAttention, src_keep: str, cfg: ModelConfig
) -> str:
    """Self-attention (`attend`, over the graph's own cache form), encoder-decoder attention, feed-forward:
    (B, 1, D) -> (B, 1, D)."""
    prefix = f"decoder.{i}"
    with b.scope(f"decoder/layers.{i}"):
        h = layers.residual_input(b, w, f"{prefix}.norm1", x, cfg)
        x = layers.residual_output(b, w, f"{prefix}.norm1", x, attend(i, h), cfg)
        h = layers.residual_input(b, w, f"{prefix}.norm2", x, cfg)
        with b.scope("cross_attn"):
            cross = (f"cross_k_{i}", f"cross_v_{i}")
            attended = layers.multi_head_attention(b, w, f"{prefix}.cross_attn", h, cross, src_keep, cfg)
        x = layers.residual_output(b, w, f"{prefix}.norm2", x, attended, cfg)
        h = layers.residual_input(b, w, f"{prefix}.norm3", x, cfg)
        return layers.residual_output(b, w, f"{prefix}.norm3", x, layers.feed_forward(b, w, prefix, h, cfg), cfg)


def row_inputs(b: GraphBuilder, w: Weights, cfg: ModelConfig, keep_mask: bool = True) -> tuple[str, str, str]:
    """The row inputs and the cross caches; returns x (B, 1, D), the positions and the source keep mask
    (B, 1, 1, S), or with `keep_mask` False the src_mask input (B, S) itself."""
    tokens = b.add_input("tokens", TensorProto.INT64, ["B"])
    positions = b.add_input("positions", TensorProto.INT64, ["B"])
    src_mask = b.add_input("src_mask", TensorProto.BOOL, ["B", "S"])
    for i in range(cfg.n_decoder_layers):
        for kind in "kv":
            b.add_input(f"cross_{kind}_{i}", b.elem, ["B", cfg.n_heads, "S", cfg.head_dim])
    with b.scope("decoder"):
        column = b.ints(1)
        ids, steps = b.op("Unsqueeze", tokens, column), b.op("Unsqueeze", positions, column)  # (B, 1)
        x = layers.embed(b, w, "embed.weight", ids, steps, cfg)  # (B, 1, D)
        return x, positions, layers.keep_mask(b, src_mask) if keep_mask else src_mask


def step_inputs(b: GraphBuilder, w: Weights, cfg: ModelConfig) -> tuple[str, str, str, str]:
    """`row_inputs`; returns x (B, 1, D), the self-attention's seqlens (int32 (B,)) and total length (the buffers'
    L, an int32 scalar) and the source keep mask (B, 1, 1, S)."""
    x, positions, src_keep = row_inputs(b, w, cfg)
    with b.scope("decoder"):
        seqlens = b.op("Cast", positions, to=TensorProto.INT32, name="seqlens_k")
        length = b.op("Gather", b.op("Shape", "past_k_0"), b.const(2, np.int64))  # the buffers' L, a scalar
        total = b.op("Cast", length, to=TensorProto.INT32, name="total_sequence_length")
        return x, seqlens, total, src_keep


def log_probs(b: GraphBuilder, w: Weights, x: str, cfg: ModelConfig, normed: bool = False, chunk: int = 0) -> str:
    """(B, 1, D) -> float32 log-probabilities (B, V): the final norm under pre-norm (unless x is `normed`
    already), the output projection tied to the target embedding, the logits bias if any, log-softmax in
    float32, and banned ids (pad, under `ban_pad`) set after normalising (and also excluded before it under
    `renormalize_logits`).

    With `chunk`, the rows are (B, V') instead, V' = V rounded up to a multiple of `chunk`, for a ranking that
    reshapes them into chunks (`export.builder.ranking.add_chunked_selection`): the projection gains zero columns
    and the bias -inf there, so the extra columns hold -inf and change no other log-probability. The projection
    then runs on (B, D), where onnxruntime folds the bias into the matrix product."""
    with b.scope("decoder"):
        if cfg.norm_placement == "pre" and not normed:
            x = layers.layer_norm(b, w, "decoder_norm", x, "decoder_norm")
        with b.scope("logits"):
            if chunk:
                logits = padded_projection(b, w, b.op("Squeeze", x, b.ints(1)), cfg, chunk)  # (B, V')
            else:
                logits = b.matmul(x, "embed.weight.T", w["embed.weight"].T)  # (B, 1, V)
                if cfg.final_logits_bias:
                    logits = b.op("Add", logits, b.weight("logits_bias", w["logits_bias"]))
                logits = b.op("Squeeze", logits, b.ints(1))  # (B, V)
            if b.elem != TensorProto.FLOAT:
                logits = b.op("Cast", logits, to=TensorProto.FLOAT)
        if cfg.ban_pad and cfg.renormalize_logits:  # banned before normalising: the rest sum to one
            logits = set_column(b, logits, cfg.pad_id, -np.inf, "ban_before_softmax")
        result = b.op("LogSoftmax", logits, axis=-1)
        if cfg.ban_pad:
            result = set_column(b, result, cfg.pad_id, BANNED_LOG_PROB, "ban")
    return b.rename(result, "log_probs")


def padded_projection(b: GraphBuilder, w: Weights, x: str, cfg: ModelConfig, chunk: int) -> str:
    """(B, D) -> logits (B, V') with V' = V rounded up to a multiple of `chunk`, -inf past V."""
    extra = -cfg.vocab_size % chunk
    weight = np.pad(w["embed.weight"].T, ((0, 0), (0, extra)))  # (D, V')
    bias = w["logits_bias"] if cfg.final_logits_bias else np.zeros(cfg.vocab_size, np.float32)
    bias = np.concatenate([bias, np.full(extra, -np.inf, np.float32)])
    logits = b.matmul(x, "embed.weight.T", weight)
    if cfg.final_logits_bias or extra:
        logits = b.op("Add", logits, b.weight("logits_bias", bias))
    return logits


def set_column(b: GraphBuilder, scores: str, token: int, value: float, name: str) -> str:
    """float32 scores (B, V) with column `token` set to `value` in every row: a ScatterElements of one (B, 1)
    column, which onnxruntime runs as at most a copy of the scores (in place where they have no other reader and
    the result is no graph output), where a Where against a vocabulary-wide mask costs more (docs/decisions.md).
    Its (B, 1) index and values count their rows from the graph's tokens input: a capturable graph holds no Shape."""
    with b.scope(name):
        rows = b.op("Unsqueeze", "tokens", b.ints(1))  # (B, 1)
        index = b.op("Add", b.op("Mul", rows, b.const(0, np.int64)), b.const(token, np.int64))  # (B, 1)
        zeros = b.op("Mul", b.op("Cast", rows, to=TensorProto.FLOAT), b.const(0.0, np.float32))  # (B, 1)
        values = b.op("Add", zeros, b.const(value, np.float32))  # (B, 1)
        return b.op("ScatterElements", scores, index, values, axis=1)


def decoder_stack(b: GraphBuilder, w: Weights, x: str, attend: SelfAttention, src_keep: str, cfg: ModelConfig) -> str:
    """Every decoder layer over x (B, 1, D), then the ranking's (B, V') log-probabilities (`log_probs` by
    RANKING_CHUNK)."""
    for i in range(cfg.n_decoder_layers):
        x = decoder_layer(b, w, i, x, attend, src_keep, cfg)
    return log_probs(b, w, x, cfg, chunk=RANKING_CHUNK)


def decoder_step_graph(
    w: Weights, cfg: ModelConfig, dtype: np.dtype, opset: int, int8: Int8Recipe | None = None
) -> onnx.ModelProto:
    b = GraphBuilder("decoder_step", dtype, int8)
    x, seqlens, total, src_keep = step_inputs(b, w, cfg)
    scores = decoder_stack(b, w, x, lambda i, h: self_attention(b, w, i, h, seqlens, total, cfg), src_keep, cfg)
    add_chunked_selection(b, scores, opset)
    for i in range(cfg.n_decoder_layers):
        for kind in "kv":
            b.add_output(f"present_{kind}_{i}", b.elem, ["B", cfg.n_heads, "L", buffer_head_dim(cfg.head_dim)])
    return b.model(opset)
