"""The embedding tables of the int8 graphs held as int8, once per graph.

`quantize_dynamic` quantizes MatMul weights only: each graph keeps its float32 embedding table for the Gather,
and the decoder step holds the target table twice (float32 for the Gather, int8 transposed for the output
projection tied to it). At a 256k vocabulary those float32 tables are most of the int8 variant's memory.
Here every table a Gather reads becomes int8 with one scale per row (symmetric, as the MatMul weights are):

    encoder: Gather(table int8 (V, D), ids) -> Cast -> Mul(Gather(row scales (V, 1), ids))
    step:    Gather(projection int8 (D, V), ids, axis=1) -> Transpose -> Cast -> Mul(row scales ...)

In the step the Gather reads the projection's own int8 weight (a column of it is a row of the table), so the
table is held once; the projection is then quantized with one scale per output column, the same scales.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

EMBEDDING_TABLES = ("embed.weight", "src_embed.weight")  # the builder's names (export/builder/weights.py)
PROJECTION = "embed.weight.T"  # the output projection's weight, the target table transposed (builder/decoder.py)
SCALE_SUFFIX, QUANTIZED_SUFFIX, ZERO_POINT_SUFFIX = "_scale", "_quantized", "_zero_point"  # quantize_dynamic's


def quantize_embeddings(graph_path: Path, reduce_range: bool = False) -> None:
    """Rewrite the graph at `graph_path` (an output of `quantize_dynamic`) in place: each embedding Gather
    reads int8 rows and their scales; no float32 table is left. `reduce_range` keeps 7-bit weights, as the
    recipe that made the graph did."""
    model = onnx.load(str(graph_path))
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    qmax = 63 if reduce_range else 127
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        table_name = node.input[0] if node.op_type == "Gather" else ""
        if table_name not in EMBEDDING_TABLES or table_name not in initializers:
            nodes.append(node)
            continue
        table = numpy_helper.to_array(initializers[table_name]).astype(np.float32)  # (V, D)
        quantized, scales = per_row_int8(table, qmax)
        if table_name == "embed.weight" and PROJECTION + QUANTIZED_SUFFIX in initializers:
            _tie_to_projection(graph, initializers, quantized, scales)
            nodes += _gather_columns(node, PROJECTION + QUANTIZED_SUFFIX)
        else:
            _add(graph, initializers, f"{table_name}{QUANTIZED_SUFFIX}", quantized)
            nodes.append(helper.make_node("Gather", [f"{table_name}{QUANTIZED_SUFFIX}", node.input[1]], [_int8(node)]))
        _add(graph, initializers, f"{table_name}_row{SCALE_SUFFIX}", scales[:, None])  # (V, 1)
        nodes += _dequantize(node, f"{table_name}_row{SCALE_SUFFIX}")
        graph.initializer.remove(initializers.pop(table_name))
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, str(graph_path))


def per_row_int8(table: np.ndarray, qmax: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 rows of `table` (V, D) and their float32 scales (V,): row ~ quantized * scale.
    An all-zero row gets scale 1 (it dequantizes to zeros either way)."""
    largest = np.abs(table).max(axis=1)
    scales = np.where(largest > 0, largest / qmax, 1.0).astype(np.float32)
    quantized = np.clip(np.rint(table / scales[:, None]), -qmax, qmax).astype(np.int8)
    return quantized, scales


def _tie_to_projection(
    graph: onnx.GraphProto, initializers: dict[str, onnx.TensorProto], quantized: np.ndarray, scales: np.ndarray
) -> None:  # fmt: skip
    """The output projection's int8 weight (D, V) replaced by the table's rows as columns, with one scale and
    zero point per column: MatMulInteger takes per-column zero points, and the Mul after it broadcasts (V,)."""
    for suffix, value in (
        (QUANTIZED_SUFFIX, np.ascontiguousarray(quantized.T)),
        (SCALE_SUFFIX, scales),
        (ZERO_POINT_SUFFIX, np.zeros(scales.shape, np.int8)),
    ):
        graph.initializer.remove(initializers.pop(PROJECTION + suffix))
        _add(graph, initializers, PROJECTION + suffix, value)


def _add(graph: onnx.GraphProto, initializers: dict[str, onnx.TensorProto], name: str, value: np.ndarray) -> None:
    initializers[name] = numpy_helper.from_array(value, name)
    graph.initializer.append(initializers[name])


def _int8(node: onnx.NodeProto) -> str:
    return f"{node.output[0]}_int8"


def _gather_columns(node: onnx.NodeProto, projection: str) -> list[onnx.NodeProto]:
    """int8 columns of the projection (D, V) at the node's ids (B, T), as the builder's `embed` takes them,
    moved last: (B, T, D)."""
    columns = f"{node.output[0]}_columns"
    return [
        helper.make_node("Gather", [projection, node.input[1]], [columns], axis=1),  # (D, B, T)
        helper.make_node("Transpose", [columns], [_int8(node)], perm=[1, 2, 0]),
    ]


def _dequantize(node: onnx.NodeProto, scale_name: str) -> list[onnx.NodeProto]:
    """The node's output, float32 again: its int8 rows times their scales."""
    out = node.output[0]
    return [
        helper.make_node("Cast", [_int8(node)], [f"{out}_float"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Gather", [scale_name, node.input[1]], [f"{out}_scales"], axis=0),  # (B, T, 1)
        helper.make_node("Mul", [f"{out}_float", f"{out}_scales"], [out]),
    ]
