"""The beam's candidate ranking inside the decoder graph, with a per-row additive bias before it.

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
"""

from __future__ import annotations

from onnx import TensorProto

from export.builder.graph import GraphBuilder
from model.directory import MAX_BIAS_PER_ROW


def add_candidate_selection(b: GraphBuilder, log_probs: str, fixed_k: int | None = None) -> None:
    """Ranks the (B, V) float32 `log_probs` of the graph being built; adds the inputs and outputs above.

    With `fixed_k` the graph ranks that many candidates per row and has no top_k input: TopK reads its k on
    the host, which a captured graph would freeze, so a capturable graph fixes it (its callers take the
    first k of them: the order is total, score then lower id). Such a graph's bias is MAX_BIAS_PER_ROW wide,
    since a captured graph's inputs keep their shapes."""
    row_scores = b.add_input("row_scores", TensorProto.FLOAT, ["B"])
    j_dim: int | str = "J" if fixed_k is None else MAX_BIAS_PER_ROW
    bias_ids = b.add_input("bias_ids", TensorProto.INT64, ["B", j_dim])
    bias_values = b.add_input("bias_values", TensorProto.FLOAT, ["B", j_dim])
    top_k = b.add_input("top_k", TensorProto.INT64, [1]) if fixed_k is None else b.ints(fixed_k)
    k_dim: int | str = "K" if fixed_k is None else fixed_k
    with b.scope("ranking"):
        column = b.op("Unsqueeze", row_scores, b.ints(1))  # (B, 1)
        scores = b.op("Add", log_probs, column)  # (B, V)
        # The Add's output has no other reader, so onnxruntime's CPU kernel scatters into it in place.
        biased = b.op("ScatterElements", scores, bias_ids, bias_values, axis=1, reduction="add")  # (B, V)
        top = b.op_n("TopK", biased, top_k, outputs=2, axis=-1, largest=1, sorted=1)
        asked = b.op("GatherElements", biased, bias_ids, axis=1)  # (B, J)
    b.add_output(b.rename(top[0], "top_scores"), TensorProto.FLOAT, ["B", k_dim])
    b.add_output(b.rename(top[1], "top_ids"), TensorProto.INT64, ["B", k_dim])
    b.add_output(b.rename(asked, "bias_scores"), TensorProto.FLOAT, ["B", j_dim])
