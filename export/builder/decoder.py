"""decoder_step.onnx from the weights: one step for B rows at any mix of positions against a gathered cache.

In: tokens (B,), positions (B,), src_mask (B, S), past_keep (B, P), cross_k_i / cross_v_i (B, H, S, Dh),
past_k_i / past_v_i (B, H, P, Dh), then the ranking's row_scores (B,), bias_ids / bias_values (B, J) and top_k (1,).
Out: new_k_i / new_v_i (B, H, 1, Dh), top_scores / top_ids (B, k), bias_scores (B, J), and
present_k_i / present_v_i (B, H, P + 1, Dh), the past with this step appended, which the working batch feeds
back as the next past. No `If` node: every row runs the same nodes. The whole (B, V) distribution is no output:
the ranking works on it in place, and a parity check that wants it ranks all V ids.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto

from export.builder import layers
from export.builder.graph import GraphBuilder
from export.builder.int8 import Int8Recipe
from export.builder.ranking import RANKING_CHUNK, add_chunked_selection
from export.builder.weights import Weights
from model.config import ModelConfig

# model.training.transformer.BANNED_LOG_PROB: finite, so adding a row score stays exact elsewhere
BANNED_LOG_PROB = -1e9

SelfAttention = Callable[[int, str], str]  # (layer i, its normed input h (B, 1, D)) -> attended (B, 1, D)


def self_attention(b: GraphBuilder, w: Weights, i: int, h: str, keep: str, cfg: ModelConfig) -> str:
    """Attend from this step's h (B, 1, D) to the past plus its own keys and values; names the graph's
    new_* (B, H, 1, Dh) and present_* (B, H, P + 1, Dh) outputs of layer i."""
    kv_dims: list[int | str] = ["B", cfg.n_heads, "P", cfg.head_dim]
    with b.scope("self_attn"):
        new = layers.project_kv(b, w, f"decoder.{i}.self_attn", h, cfg)
        present = []
        for kind, value in zip("kv", new, strict=True):
            past = b.add_input(f"past_{kind}_{i}", b.elem, kv_dims)
            b.rename(value, f"new_{kind}_{i}")
            present.append(
                b.op_to("Concat", f"present_{kind}_{i}", past, f"new_{kind}_{i}", name=f"{kind}_cache", axis=2)
            )
        return layers.multi_head_attention(b, w, f"decoder.{i}.self_attn", h, (present[0], present[1]), keep, cfg)


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


def row_inputs(
    b: GraphBuilder, w: Weights, cfg: ModelConfig, past_keep: bool, keep_mask: bool = True
) -> tuple[str, str, str]:
    """The row inputs (past_keep (B, P) too, if asked) and the cross caches; returns x (B, 1, D), the positions
    and the source keep mask (B, 1, 1, S), or with `keep_mask` False the src_mask input (B, S) itself."""
    tokens = b.add_input("tokens", TensorProto.INT64, ["B"])
    positions = b.add_input("positions", TensorProto.INT64, ["B"])
    src_mask = b.add_input("src_mask", TensorProto.BOOL, ["B", "S"])
    if past_keep:
        b.add_input("past_keep", TensorProto.BOOL, ["B", "P"])
    for i in range(cfg.n_decoder_layers):
        for kind in "kv":
            b.add_input(f"cross_{kind}_{i}", b.elem, ["B", cfg.n_heads, "S", cfg.head_dim])
    with b.scope("decoder"):
        column = b.ints(1)
        ids, steps = b.op("Unsqueeze", tokens, column), b.op("Unsqueeze", positions, column)  # (B, 1)
        x = layers.embed(b, w, "embed.weight", ids, steps, cfg)  # (B, 1, D)
        return x, positions, layers.keep_mask(b, src_mask) if keep_mask else src_mask


def step_inputs(b: GraphBuilder, w: Weights, cfg: ModelConfig) -> tuple[str, str, str]:
    """`row_inputs` with past_keep; returns x (B, 1, D) and the keep masks, self (B, 1, 1, P + 1) and source
    (B, 1, 1, S)."""
    x, _, src_keep = row_inputs(b, w, cfg, past_keep=True)
    with b.scope("decoder"):
        column = b.ints(1)
        own = b.op("Expand", b.const([[True]], np.bool_), b.op("Concat", b.op("Shape", "tokens"), column, axis=0))
        self_keep = layers.keep_mask(b, b.op("Concat", "past_keep", own, axis=1))  # each row also sees its own step
        return x, self_keep, src_keep


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
    x, self_keep, src_keep = step_inputs(b, w, cfg)
    scores = decoder_stack(b, w, x, lambda i, h: self_attention(b, w, i, h, self_keep, cfg), src_keep, cfg)
    layers = [(kind, i) for i in range(cfg.n_decoder_layers) for kind in "kv"]
    for kind, i in layers:
        b.add_output(f"new_{kind}_{i}", b.elem, ["B", cfg.n_heads, 1, cfg.head_dim])
    add_chunked_selection(b, scores, opset)
    for kind, i in layers:
        b.add_output(f"present_{kind}_{i}", b.elem, ["B", cfg.n_heads, "P1", cfg.head_dim])
    return b.model(opset)
