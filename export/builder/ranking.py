"""The beam's candidate ranking inside the decoder graph: row_scores (B,) and top_k (1,) (or a fixed k) in,
top_scores and top_ids (B, k) = TopK(log_probs + row_scores[:, None], top_k) out.

A serving step then hands back k candidates per row instead of a (B, V) row of log-probabilities: on CUDA
the vocabulary-wide rows never leave the device, and on CPU onnxruntime's TopK replaces a numpy partition.
ONNX TopK breaks ties to the lower index, as the reference beam search does, and the float32 add is the
reference's own (torch adds scores to log-probs in float32).
"""

from __future__ import annotations

from onnx import TensorProto

from export.builder.graph import GraphBuilder


def add_candidate_selection(b: GraphBuilder, log_probs: str, fixed_k: int | None = None) -> None:
    """Ranks the (B, V) float32 `log_probs` of the graph being built; adds the inputs and outputs above.

    With `fixed_k` the graph ranks that many candidates per row and has no top_k input: TopK reads its k on
    the host, which a captured graph would freeze, so a capturable graph fixes it (its callers take the
    first k of them: the order is total, score then lower id)."""
    row_scores = b.add_input("row_scores", TensorProto.FLOAT, ["B"])
    top_k = b.add_input("top_k", TensorProto.INT64, [1]) if fixed_k is None else b.ints(fixed_k)
    k_dim: int | str = "K" if fixed_k is None else fixed_k
    with b.scope("ranking"):
        column = b.op("Unsqueeze", row_scores, b.ints(1))  # (B, 1)
        scores = b.op("Add", log_probs, column)  # (B, V)
        top = b.op_n("TopK", scores, top_k, outputs=2, axis=-1, largest=1, sorted=1)
    b.add_output(b.rename(top[0], "top_scores"), TensorProto.FLOAT, ["B", k_dim])
    b.add_output(b.rename(top[1], "top_ids"), TensorProto.INT64, ["B", k_dim])
