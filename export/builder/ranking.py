"""The beam's candidate ranking inside the decoder graphs, with a per-row additive bias before it.

In: row_scores (B,), bias_ids (B, J) int64, bias_values (B, J) float32 and top_k (1,) (or a fixed k, and J fixed
at MAX_BIAS_PER_ROW). Out: top_scores and top_ids (B, k) = TopK(biased, top_k) and bias_scores (B, J) =
biased[i, bias_ids[i, j]], where biased = log_probs + row_scores[:, None] with bias_values[i, j] added at
column bias_ids[i, j] of row i (ScatterElements with reduction "add", so repeated ids add up).

A serving step then hands back k candidates per row instead of a (B, V) row of log-probabilities: on CUDA
the vocabulary-wide rows never leave the device, and on CPU onnxruntime's TopK replaces a numpy partition.
ONNX TopK breaks ties to the lower index, as the reference beam search does, and the float32 add is the
reference's own (torch adds scores to log-probs in float32).

The bias is the one logits seam for decoding constraints (`server.core.runner.RowBias`): its callers add 0
("report this token's score") or -inf ("never rank this token"), so every candidate carries its true score and
adding either is exact whatever order the scatter adds duplicates in. A row without a bias is padded with
id 0, value 0. J is at least 1: a (B, 0) bias is never fed.

Two forms. The captured CUDA step ranks as written above (`add_candidate_selection`). The ordinary step, the CPU
path, ranks in chunks (`add_chunked_selection`), because on a CPU the vocabulary-wide passes after the projection
cost as much as the projection itself (docs/decisions.md): its log-probabilities come padded to whole chunks of
RANKING_CHUNK columns (-inf past V), the bias is added in place, each chunk's maximum is taken by one ReduceMax
and ranked with the row score added, and only the k best chunks are searched, in id order, their entries with the
row score added. The result is the plain form's, ties included: the float32 add is monotone, so a chunk's
maximum plus the row score is the chunk's best sum, and a chunk left out has k chunks ahead of it whose best
sums are k distinct entries at least as good (equal ones at lower ids). A bias of 0 or -inf commutes with the add.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from export.builder.graph import GraphBuilder
from model.directory import MAX_BIAS_PER_ROW

RANKING_CHUNK = 128  # columns per chunk of the ordinary step's ranking


@dataclass(frozen=True)
class RankingInputs:
    """The ranking's graph inputs, and the widths of its outputs."""

    row_scores: str  # (B,)
    bias_ids: str  # (B, J) int64
    bias_values: str  # (B, J)
    top_k: str  # (1,) int64: the top_k input, or a constant
    k_dim: int | str
    j_dim: int | str


def ranking_inputs(b: GraphBuilder, fixed_k: int | None) -> RankingInputs:
    """row_scores, bias_ids, bias_values and top_k; under `fixed_k` top_k is that constant and the bias
    MAX_BIAS_PER_ROW wide."""
    j_dim: int | str = "J" if fixed_k is None else MAX_BIAS_PER_ROW
    return RankingInputs(
        b.add_input("row_scores", TensorProto.FLOAT, ["B"]),
        b.add_input("bias_ids", TensorProto.INT64, ["B", j_dim]),
        b.add_input("bias_values", TensorProto.FLOAT, ["B", j_dim]),
        b.add_input("top_k", TensorProto.INT64, [1]) if fixed_k is None else b.ints(fixed_k),
        "K" if fixed_k is None else fixed_k,
        j_dim,
    )


def ranking_outputs(b: GraphBuilder, io: RankingInputs, top_scores: str, top_ids: str, asked: str) -> None:
    """The graph's top_scores, top_ids (B, k) and bias_scores (B, J)."""
    b.add_output(b.rename(top_scores, "top_scores"), TensorProto.FLOAT, ["B", io.k_dim])
    b.add_output(b.rename(top_ids, "top_ids"), TensorProto.INT64, ["B", io.k_dim])
    b.add_output(b.rename(asked, "bias_scores"), TensorProto.FLOAT, ["B", io.j_dim])


def add_candidate_selection(b: GraphBuilder, log_probs: str, fixed_k: int | None = None) -> None:
    """Ranks the (B, V) float32 `log_probs` of the graph being built; adds the inputs and outputs above.

    With `fixed_k` the graph ranks that many candidates per row and has no top_k input: TopK reads its k on
    the host, which a captured graph would freeze, so a capturable graph fixes it (its callers take the
    first k of them: the order is total, score then lower id). Such a graph's bias is MAX_BIAS_PER_ROW wide,
    since a captured graph's inputs keep their shapes."""
    io = ranking_inputs(b, fixed_k)
    row_scores, bias_ids, bias_values, top_k = io.row_scores, io.bias_ids, io.bias_values, io.top_k
    with b.scope("ranking"):
        column = b.op("Unsqueeze", row_scores, b.ints(1))  # (B, 1)
        scores = b.op("Add", log_probs, column)  # (B, V)
        # The Add's output has no other reader, so onnxruntime's CPU kernel scatters into it in place.
        biased = b.op("ScatterElements", scores, bias_ids, bias_values, axis=1, reduction="add")  # (B, V)
        top = b.op_n("TopK", biased, top_k, outputs=2, axis=-1, largest=1, sorted=1)
        asked = b.op("GatherElements", biased, bias_ids, axis=1)  # (B, J)
    ranking_outputs(b, io, top[0], top[1], asked)


def add_chunked_selection(b: GraphBuilder, log_probs: str, opset: int) -> None:
    """Ranks the (B, V') float32 `log_probs` (V' a multiple of RANKING_CHUNK, -inf past V, no other reader) as the
    module docstring says; adds the inputs and outputs of `add_candidate_selection` with a top_k input."""
    io = ranking_inputs(b, None)
    row_scores, bias_ids, bias_values, top_k = io.row_scores, io.bias_ids, io.bias_values, io.top_k
    with b.scope("ranking"):
        # log_probs has no other reader, so onnxruntime's CPU kernel adds the bias in place.
        biased = b.op("ScatterElements", log_probs, bias_ids, bias_values, axis=1, reduction="add")  # (B, V')
        chunks = b.op("Reshape", biased, b.ints(0, -1, RANKING_CHUNK))  # (B, G, C)
        if opset >= 18:
            maxima = b.op("ReduceMax", chunks, b.ints(-1), keepdims=0)  # (B, G)
        else:
            maxima = b.op("ReduceMax", chunks, axes=[-1], keepdims=0)
        column = b.op("Unsqueeze", row_scores, b.ints(1))  # (B, 1)
        searched = b.op("Min", top_k, b.op("Slice", b.op("Shape", maxima), b.ints(1), b.ints(2)))  # (1,)
        best = b.op_n("TopK", b.op("Add", maxima, column), searched, outputs=2, axis=-1)[1]  # (B, n) chunk numbers
        in_order = b.op_n("TopK", best, searched, outputs=2, axis=-1, largest=0)[0]  # (B, n) ascending
        first = b.op("Unsqueeze", b.op("Mul", in_order, b.const(RANKING_CHUNK, np.int64)), b.ints(-1))  # (B, n, 1)
        columns = b.op("Reshape", b.op("Add", first, b.const(np.arange(RANKING_CHUNK), np.int64)), b.ints(0, -1))
        found = b.op("Add", b.op("GatherElements", biased, columns, axis=1), column)  # (B, n * C)
        top = b.op_n("TopK", found, top_k, outputs=2, axis=-1, largest=1, sorted=1)
        top_scores, top_ids = top[0], b.op("GatherElements", columns, top[1], axis=1)  # (B, k)
        asked = b.op("Add", b.op("GatherElements", biased, bias_ids, axis=1), column)  # (B, J)
    ranking_outputs(b, io, top_scores, top_ids, asked)
