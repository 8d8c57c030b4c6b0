"""decoder_step.onnx from the weights: one step for B rows at any mix of positions, each row's keys and values
kept in buffers the caller binds.

In: tokens (B,), positions (B,) (each row's entries before this step), src_mask (N, S) (a prefix per cross group:
sources are right-padded), cross_k_i / cross_v_i (N, H, S, Dh'), past_k_i / past_v_i (B, H, L, Dh'), cross_rows
(N, G) and row_cross (B,), then the ranking's row_scores (B,), bias_ids / bias_values (B, J) and top_k (1,). Out:
top_scores / top_ids (B, k), bias_scores (B, J), present_k_i / present_v_i (B, H, L, Dh') and cross_present_k_i /
cross_present_v_i (N, H, S, Dh'), Dh' = `model.directory.buffer_head_dim` of the model's head size.

A cross group is one source and the rows that attend to it: a sentence's beams share one copy of its cross keys
and values. cross_rows[n] are group n's rows (G of them, a group with fewer repeating one), row_cross[i] is row
i's place n x G + g among them. Where the step takes one query per group (`shares_cross_groups`), G is 1.

Both attentions are onnxruntime's GroupQueryAttention in its shared-buffer form
(`export.builder.fused.shared_buffer_attention`), the outputs bound to the very buffers of the inputs: the
self-attention writes this step's key and value at each row's position, the cross-attention writes back each
group's last source entry where it already is (and G - 1 copies past it, which no query reads), and a row reads
its own entries only. So the past is never copied and no padding of either cache is read. L, any length above
every position, is read from past_k_0's shape. No `If` node: every row runs the same nodes. The whole (B, V)
distribution is no output: the ranking works on it in place, and a parity check that wants it ranks all V ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

from export.builder import fused, layers
from export.builder.graph import ELEM_TYPES, GraphBuilder
from export.builder.int8 import Int8Recipe
from export.builder.ranking import RANKING_CHUNK, add_chunked_selection
from export.builder.weights import Weights
from model.config import ModelConfig
from model.directory import buffer_head_dim, takes_cross_groups

PROJECTIONS = ("q_proj", "k_proj", "v_proj")
# model.training.transformer.BANNED_LOG_PROB: finite, so adding a row score stays exact elsewhere
BANNED_LOG_PROB = -1e9

Attention = Callable[[int, str], str]  # (layer i, its normed input h (B, 1, D)) -> attended (B, 1, D)


@dataclass(frozen=True)
class StepLengths:
    """What the CPU step's attention reads: each row's entries in the self-attention buffers, and each cross group's
    source entries in the cross feed, as GroupQueryAttention takes them. A cross group is one source and the G
    rows that attend to it (a sentence's beams share one), fed as G queries against one copy of its entries."""

    positions: str  # int32 (B,): the self-attention entries each row holds, where this step writes its own
    total: str  # int32 scalar: the self-attention buffers' length L
    last_source: str  # int32 (N,): each group's last source entry (its source length - 1; 0 for a group without one)
    cross_seqlens: str  # int32 (N,): last_source + G - 1, the last of the G entries the kernel writes per group
    source_total: str  # int32 scalar: the cross feed's length S
    last_index: str  # int64 (N, H, 1): last_source per head, a GatherND index into the cross feed (batch_dims 2)
    source_bias: str  # (N, 1, G, S): 0 at each group's source entries, -inf past them ("" when G is 1)
    group_size: str  # int32 (N,): G for every group, GroupQueryAttention's query_seqlens ("" when G is 1)


def step_lengths(b: GraphBuilder, positions: str, cfg: ModelConfig, grouped: bool) -> StepLengths:
    """The lengths from the positions, past_k_0's shape, the groups' source mask (a prefix: sources are
    right-padded) and cross_rows' shape; without `grouped` (one query per group) no bias and no group sizes."""
    with b.scope("decoder/lengths"):
        int32 = TensorProto.INT32
        seqlens = b.op("Cast", positions, to=int32)
        total = b.op("Cast", b.op("Gather", b.op("Shape", "past_k_0"), b.const(2, np.int64)), to=int32)
        src_len = b.op("ReduceSum", b.op("Cast", "src_mask", to=int32), b.ints(1), keepdims=0)  # (N,)
        last = b.op("Max", b.op("Sub", src_len, b.const(np.int32(1), np.int32)), b.const(np.int32(0), np.int32))
        source_total = b.op("Cast", b.op("Gather", b.op("Shape", "src_mask"), b.const(1, np.int64)), to=int32)
        column = b.op("Reshape", b.op("Cast", last, to=TensorProto.INT64), b.ints(-1, 1, 1))  # (N, 1, 1)
        index = b.op("Expand", column, b.ints(1, cfg.n_heads, 1))  # (N, H, 1)
        if not grouped:
            return StepLengths(seqlens, total, last, last, source_total, index, "", "")
        grid = b.op("Shape", "cross_rows")  # (N, G)
        size = b.op("Cast", b.op("Slice", grid, b.ints(1), b.ints(2)), to=int32)  # (1,) G
        cross_seqlens = b.op("Add", last, b.op("Sub", size, b.const(np.int32(1), np.int32)))  # (N,)
        group_size = b.op("Add", b.op("Mul", last, b.const(np.int32(0), np.int32)), size)  # (N,)
        open_ = b.op("Where", "src_mask", b.scalar(0.0), b.scalar(-np.inf))  # (N, S)
        rows = b.op("Unsqueeze", open_, b.ints(1, 2))  # (N, 1, 1, S)
        n, g = b.op("Slice", grid, b.ints(0), b.ints(1)), b.op("Slice", grid, b.ints(1), b.ints(2))
        s = b.op("Slice", b.op("Shape", "src_mask"), b.ints(1), b.ints(2))
        bias = b.op("Expand", rows, b.op("Concat", n, b.ints(1), g, s, axis=0))  # (N, 1, G, S)
        return StepLengths(seqlens, total, last, cross_seqlens, source_total, index, bias, group_size)


def self_attention(b: GraphBuilder, w: Weights, i: int, h: str, lengths: StepLengths, cfg: ModelConfig) -> str:
    """Attend from this step's h (B, 1, D) to each row's own entries in layer i's buffers past_k_i / past_v_i
    (B, H, L, Dh') plus its own key and value, which the step writes there (present_*) -> (B, 1, D). The three
    projections stay three products of h, so that int8 quantizes each weight as `quantize_dynamic` does; the
    heads are padded to Dh' where the kernel needs it (`layers.head_linear`)."""
    prefix = f"decoder.{i}.self_attn"
    with b.scope("self_attn"):
        q, k, v = (layers.head_linear(b, w, f"{prefix}.{name}", h, name, cfg, "out") for name in PROJECTIONS)
        buffers = fused.buffer_inputs(b, "past", i, ["B", cfg.n_heads, "L", buffer_head_dim(cfg.head_dim)])
        present = (f"present_k_{i}", f"present_v_{i}")
        attended = fused.shared_buffer_attention(b, (q, k, v), buffers, present, lengths.positions, lengths.total, cfg)
        return layers.head_linear(b, w, f"{prefix}.out_proj", attended, "out_proj", cfg, "in")


def cross_attention(b: GraphBuilder, w: Weights, i: int, h: str, lengths: StepLengths, cfg: ModelConfig) -> str:
    """Queries of h (B, 1, D) against their cross groups' source entries in layer i's cross feed cross_k_i /
    cross_v_i (N, H, S, Dh') -> (B, 1, D). The rows' queries are gathered into their groups (cross_rows (N, G)),
    GroupQueryAttention runs G queries per group over the feed as its shared buffers, and each row takes its
    group's answer back (row_cross (B,)). The kernel writes the G "new" keys and values at the group's last
    source entry and the G - 1 entries past it: fed the last entry, it writes that one back unchanged, and the
    bias keeps every query off the entries past the source. A group reads no padding, and the feed holds one
    copy of a source however many beams attend to it."""
    prefix = f"decoder.{i}.cross_attn"
    feed = (f"cross_k_{i}", f"cross_v_{i}")
    with b.scope("cross_attn"):
        q = layers.head_linear(b, w, f"{prefix}.q_proj", h, "q_proj", cfg, "out")  # (B, 1, H Dh')
        grouped = b.op("Gather", b.op("Squeeze", q, b.ints(1)), "cross_rows", axis=0)  # (N, G, H Dh')
        last = []
        for name in feed:
            entry = b.op("GatherND", name, lengths.last_index, batch_dims=2)  # (N, H, Dh'): one copy per head
            last.append(b.op("Expand", b.op("Reshape", entry, b.ints(0, 1, -1)), b.op("Shape", grouped)))
        present = (f"cross_present_k_{i}", f"cross_present_v_{i}")
        attended = fused.shared_buffer_attention(
            b,
            (grouped, last[0], last[1]),
            feed,
            present,
            lengths.cross_seqlens,
            lengths.source_total,
            cfg,
            groups=(lengths.source_bias, lengths.group_size) if lengths.group_size else None,
        )  # (N, G, H Dh')
        flat = b.op("Reshape", attended, b.ints(-1, cfg.n_heads * buffer_head_dim(cfg.head_dim)))  # (N G, H Dh')
        rows = b.op("Unsqueeze", b.op("Gather", flat, "row_cross", axis=0), b.ints(1))  # (B, 1, H Dh')
        return layers.head_linear(b, w, f"{prefix}.out_proj", rows, "out_proj", cfg, "in")


def decoder_layer(
    b: GraphBuilder, w: Weights, i: int, x: str, attend: Attention, cross: Attention, cfg: ModelConfig
) -> str:
    """Self-attention (`attend`), encoder-decoder attention (`cross`), feed-forward: (B, 1, D) -> (B, 1, D)."""
    prefix = f"decoder.{i}"
    with b.scope(f"decoder/layers.{i}"):
        h = layers.residual_input(b, w, f"{prefix}.norm1", x, cfg)
        x = layers.residual_output(b, w, f"{prefix}.norm1", x, attend(i, h), cfg)
        h = layers.residual_input(b, w, f"{prefix}.norm2", x, cfg)
        x = layers.residual_output(b, w, f"{prefix}.norm2", x, cross(i, h), cfg)
        h = layers.residual_input(b, w, f"{prefix}.norm3", x, cfg)
        return layers.residual_output(b, w, f"{prefix}.norm3", x, layers.feed_forward(b, w, prefix, h, cfg), cfg)


def row_inputs(
    b: GraphBuilder, w: Weights, cfg: ModelConfig, keep_mask: bool = True, sources: str = "B"
) -> tuple[str, str, str]:
    """The row inputs and the cross caches (sources, H, S, Dh'), one per row or, with `sources` "N", one per cross
    group; returns x (B, 1, D), the positions and the source keep mask (B, 1, 1, S), or with `keep_mask` False the
    src_mask input (sources, S) itself."""
    tokens = b.add_input("tokens", TensorProto.INT64, ["B"])
    positions = b.add_input("positions", TensorProto.INT64, ["B"])
    src_mask = b.add_input("src_mask", TensorProto.BOOL, [sources, "S"])
    for i in range(cfg.n_decoder_layers):
        fused.buffer_inputs(b, "cross", i, [sources, cfg.n_heads, "S", buffer_head_dim(cfg.head_dim)])
    with b.scope("decoder"):
        column = b.ints(1)
        ids, steps = b.op("Unsqueeze", tokens, column), b.op("Unsqueeze", positions, column)  # (B, 1)
        x = layers.embed(b, w, "embed.weight", ids, steps, cfg)  # (B, 1, D)
        return x, positions, layers.keep_mask(b, src_mask) if keep_mask else src_mask


def log_probs(b: GraphBuilder, w: Weights, x: str, cfg: ModelConfig, normed: bool = False, chunk: int = 0) -> str:
    """(B, 1, D) -> float32 log-probabilities (B, V): the final norm under pre-norm (unless x is `normed`
    already), the output projection tied to the target embedding, the logits bias if any, log-softmax in
    float32, and banned ids (pad, under `ban_pad`) set after normalising (and also excluded before it under
    `renormalize_logits`).

    With `chunk`, the rows are (B, V') instead, V' = V rounded up to a multiple of `chunk`, for a ranking that
    reshapes them into chunks (`export.builder.ranking.add_chunked_selection`): the extra columns hold -inf and
    change no other log-probability (`padded_projection`)."""
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
    """(B, D) -> logits (B, V') with V' = V rounded up to a multiple of `chunk`, -inf past V, in one pass over the
    (B, V') product: a float graph multiplies [x, 1] by the weight with the logits bias as one more row (-inf past
    V), where an add of the bias after the product (onnxruntime's Gemm, too) writes and reads every logit once
    more; an int8 graph adds the bias inside its quantized product (onnxruntime fuses it); without a bias the
    projection gains zero columns, set to -inf in place afterwards (a scatter of B x (V' - V) values)."""
    extra = -cfg.vocab_size % chunk
    weight = np.pad(w["embed.weight"].T, ((0, 0), (0, extra)))  # (D, V')
    if not cfg.final_logits_bias:
        logits = b.matmul(x, "embed.weight.T", weight)
        padding = np.arange(cfg.vocab_size, cfg.vocab_size + extra)
        return set_columns(b, logits, padding, -np.inf, "padding", b.dtype) if extra else logits
    bias = np.concatenate([w["logits_bias"], np.full(extra, -np.inf, np.float32)])  # (V',)
    if b.int8 is not None:
        return b.op("Add", b.matmul(x, "embed.weight.T", weight), b.weight("logits_bias", bias))
    with b.scope("with_bias"):
        rows = b.op("Cast", b.op("Unsqueeze", "tokens", b.ints(1)), to=b.elem)  # (B, 1)
        ones = b.op("Add", b.op("Mul", rows, b.scalar(0.0)), b.scalar(1.0))  # (B, 1)
        extended = b.op("Concat", x, ones, axis=1)  # (B, D + 1)
    return b.matmul(extended, "embed.weight.T", np.concatenate([weight, bias[None].astype(weight.dtype)]))


def set_column(b: GraphBuilder, scores: str, token: int, value: float, name: str) -> str:
    """float32 scores (B, V) with column `token` set to `value` in every row (`set_columns`)."""
    return set_columns(b, scores, np.asarray([token]), value, name)


def set_columns(
    b: GraphBuilder, scores: str, tokens: np.ndarray, value: float, name: str, dtype: np.dtype | type = np.float32
) -> str:
    """Scores (B, V) of `dtype` with columns `tokens` set to `value` in every row: a ScatterElements of (B, P)
    columns, which onnxruntime runs as at most a copy of the scores (in place where they have no other reader and
    the result is no graph output), where a Where against a vocabulary-wide mask costs more (docs/decisions.md).
    Its (B, P) index and values count their rows from the graph's tokens input: a capturable graph holds no Shape."""
    with b.scope(name):
        rows = b.op("Unsqueeze", "tokens", b.ints(1))  # (B, 1)
        index = b.op("Add", b.op("Mul", rows, b.const(0, np.int64)), b.const(tokens, np.int64))  # (B, P)
        elem = ELEM_TYPES[np.dtype(dtype)]
        zeros = b.op("Mul", b.op("Cast", rows, to=elem), b.const(0.0, dtype))  # (B, 1)
        values = b.op("Add", zeros, b.const(np.full(len(tokens), value), dtype))  # (B, P)
        return b.op("ScatterElements", scores, index, values, axis=1)


def shares_cross_groups(dtype: np.dtype | type) -> bool:
    """Whether a step of this float dtype attends with several queries per cross group (a sentence's beams
    against one copy of its source). That takes GroupQueryAttention's query_seqlens and attention_bias together,
    which onnxruntime's CPU kernel reads from 1.32 on; float16 steps are the CUDA variant's fallback, where one
    query per group is what has been run. Otherwise each row is its own group (G = 1), over the same inputs."""
    return np.dtype(dtype) != np.float16 and takes_cross_groups(ort.__version__)


def decoder_step_graph(
    w: Weights, cfg: ModelConfig, dtype: np.dtype, opset: int, int8: Int8Recipe | None = None
) -> onnx.ModelProto:
    b = GraphBuilder("decoder_step", dtype, int8)
    x, positions, _ = row_inputs(b, w, cfg, keep_mask=False, sources="N")
    b.add_input("cross_rows", TensorProto.INT64, ["N", "G"])
    b.add_input("row_cross", TensorProto.INT64, ["B"])
    lengths = step_lengths(b, positions, cfg, shares_cross_groups(dtype))
    for i in range(cfg.n_decoder_layers):
        x = decoder_layer(
            b, w, i, x, lambda i, h: self_attention(b, w, i, h, lengths, cfg),
            lambda i, h: cross_attention(b, w, i, h, lengths, cfg), cfg,
        )  # fmt: skip
    add_chunked_selection(b, log_probs(b, w, x, cfg, chunk=RANKING_CHUNK), opset)
    dims: list[int | str] = ["B", cfg.n_heads, "L", buffer_head_dim(cfg.head_dim)]
    for i in range(cfg.n_decoder_layers):
        for kind in "kv":
            b.add_output(f"present_{kind}_{i}", b.elem, dims)
    for i in range(cfg.n_decoder_layers):
        for kind in "kv":
            b.add_output(f"cross_present_{kind}_{i}", b.elem, ["N", dims[1], "S", dims[3]])
    return b.model(opset)
