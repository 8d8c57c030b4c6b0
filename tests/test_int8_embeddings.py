"""The int8 variant's embedding tables (export/int8_embeddings.py): int8 rows with a scale each, lookups equal to the
dequantized rows, the output projection as `quantize_dynamic` made it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from export.int8_embeddings import per_row_int8, quantize_embeddings

VOCAB, DIM = 300, 32


def _table(seed: int = 0) -> np.ndarray:
    table = np.random.default_rng(seed).normal(0, 1, (VOCAB, DIM)).astype(np.float32)
    table[7] = 0  # a row of zeros (NLLB's and our exports zero rows)
    table[11] *= 1000  # rows of very different norms: one scale per row keeps the small ones
    return table


def _graph(path: Path, table_name: str, tied: bool, reduce_range: bool = False) -> np.ndarray:
    """A step-like graph (the gather and the projection tied to it, as the builder names them) or an
    encoder-like one (the gather alone), quantized as export_int8 does; returns the float32 table."""
    table = _table()
    nodes = [helper.make_node("Gather", [table_name, "ids"], ["embedded"], axis=0)]
    outputs = [helper.make_tensor_value_info("embedded", TensorProto.FLOAT, ["B", "T", DIM])]
    initializers = [numpy_helper.from_array(table, table_name)]
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "T"])]
    if tied:
        nodes.append(helper.make_node("MatMul", ["x", "embed.weight.T"], ["logits"]))
        initializers.append(numpy_helper.from_array(np.ascontiguousarray(table.T), "embed.weight.T"))
        inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", DIM]))
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "T", VOCAB]))
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path.with_suffix(".f32")))
    quantize_dynamic(
        str(path.with_suffix(".f32")), str(path), op_types_to_quantize=["MatMul"], per_channel=reduce_range,
        reduce_range=reduce_range, weight_type=QuantType.QInt8,
    )  # fmt: skip
    quantize_embeddings(path, reduce_range)
    return table


def _run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {graph_input.name for graph_input in session.get_inputs()}
    return session.run(None, {name: value for name, value in feeds.items() if name in names})


@pytest.mark.parametrize("qmax", [127, 63])
def test_rows_round_to_their_nearest_step_and_zero_rows_stay_zero(qmax: int) -> None:
    table = _table()
    quantized, scales = per_row_int8(table, qmax)
    assert quantized.dtype == np.int8 and np.abs(quantized).max() == qmax
    assert np.all(np.abs(quantized * scales[:, None] - table) <= scales[:, None] / 2 + 1e-6)
    assert not quantized[7].any() and scales[7] == 1
    assert scales[11] > 500 * np.median(scales)


@pytest.mark.parametrize("table_name", ["embed.weight", "src_embed.weight"])
def test_the_encoders_lookup_reads_int8_rows_and_gives_them_dequantized(tmp_path: Path, table_name: str) -> None:
    path = tmp_path / "encoder.onnx"
    table = _graph(path, table_name, tied=False)
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    assert weights[f"{table_name}_quantized"].dtype == np.int8 and table_name not in weights
    ids = np.array([[0, 7, 11, 299], [5, 5, 1, 2]], np.int64)
    (embedded,) = _run(path, {"ids": ids})
    quantized, scales = per_row_int8(table)
    np.testing.assert_array_equal(embedded, quantized[ids] * scales[ids][..., None])


@pytest.mark.parametrize("reduce_range", [False, True])
def test_the_steps_lookup_reads_int8_rows_beside_the_projections_own_recipe(tmp_path: Path, reduce_range: bool) -> None:
    path = tmp_path / "decoder_step.onnx"
    table = _graph(path, "embed.weight", tied=True, reduce_range=reduce_range)
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    assert "embed.weight" not in weights
    assert weights["embed.weight_quantized"].shape == (VOCAB, DIM)
    assert weights["embed.weight.T_quantized"].shape == (DIM, VOCAB)  # quantize_dynamic's, untouched
    assert weights["embed.weight.T_scale"].shape == ((VOCAB,) if reduce_range else ())
    assert np.abs(weights["embed.weight_quantized"]).max() == (63 if reduce_range else 127)
    ids = np.array([[3], [7], [11], [299]], np.int64)
    x = np.random.default_rng(1).normal(0, 1, (4, 1, DIM)).astype(np.float32)
    embedded, logits = _run(path, {"ids": ids, "x": x})
    quantized, scales = per_row_int8(table, 63 if reduce_range else 127)
    np.testing.assert_array_equal(embedded, quantized[ids] * scales[ids][..., None])
    reference = x @ table.T
    assert np.abs(logits - reference).max() <= 0.05 * np.abs(reference).max()
