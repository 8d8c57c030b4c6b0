"""The step graph's pad ban: one column of the (B, V) scores written in place of a pass over every score.

The values it bans to are checked against PyTorch under every option by tests/test_builder.py; here the
column write itself, at any row count, and the absence of any op a captured graph would freeze.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

from export.builder.decoder import BANNED_LOG_PROB, set_column
from export.builder.fused_step import HOST_READ_OPS
from export.builder.graph import GraphBuilder

VOCAB = 11


@pytest.fixture(scope="module")
def banned() -> ort.InferenceSession:
    """set_column over an (B, V) input, its rows counted from a (B,) tokens input as in every step graph."""
    b = GraphBuilder("ban", np.dtype(np.float32))
    b.add_input("tokens", TensorProto.INT64, ["B"])
    scores = b.add_input("scores", TensorProto.FLOAT, ["B", VOCAB])
    b.add_output(b.rename(set_column(b, scores, 3, BANNED_LOG_PROB, "ban"), "out"), TensorProto.FLOAT, ["B", VOCAB])
    model = b.model(18)
    assert not {node.op_type for node in model.graph.node} & HOST_READ_OPS
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("rows", [1, 5])
def test_only_the_column_changes(banned: ort.InferenceSession, rows: int) -> None:
    rng = np.random.default_rng(rows)
    scores = rng.normal(-4.0, 2.0, (rows, VOCAB)).astype(np.float32)
    tokens = rng.integers(0, 1_000_000, rows).astype(np.int64)  # any ids: only their count is read
    (out,) = banned.run(["out"], {"tokens": tokens, "scores": scores})
    want = scores.copy()
    want[:, 3] = BANNED_LOG_PROB
    np.testing.assert_array_equal(out, want)
