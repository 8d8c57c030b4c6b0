"""The embedding tables of the int8 graphs held as int8.

`quantize_dynamic` quantizes MatMul weights only: each graph keeps its float32 embedding table for the Gather
(the decoder step beside the int8 copy its output projection, tied to the table, multiplies by). At a 256k
vocabulary those float32 tables are most of the int8 variant's memory. Here every table a Gather reads becomes
int8 with one scale per row (symmetric, as the MatMul weights are):

    Gather(table int8 (V, D), ids) -> Cast -> Mul(Gather(row scales (V, 1), ids))

The output projection keeps the recipe `quantize_dynamic` gave it. Gathering the step's rows from the
projection's own (D, V) weight instead saves no resident memory (onnxruntime packs that weight for its kernel
and frees the original) and costs a strided Gather and a scale per column (docs/decisions.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

EMBEDDING_TABLES = ("embed.weight", "src_embed.weight")  # the builder's names (export/builder/weights.py)
QUANTIZED_SUFFIX = "_quantized"  # quantize_dynamic's, for its int8 weights


def quantize_embeddings(graph_path: Path, reduce_range: bool = False) -> None:
    """Rewrite the graph at `graph_path` (an output of `quantize_dynamic`) in place: each embedding Gather
    reads int8 rows and their scales; no float32 table is left. `reduce_range` keeps 7-bit weights, as the
    recipe that made the graph did."""
    model = onnx.load(str(graph_path))
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        table_name = node.input[0] if node.op_type == "Gather" else ""
        if table_name not in EMBEDDING_TABLES or table_name not in initializers:
            nodes.append(node)
            continue
        table = numpy_helper.to_array(initializers[table_name]).astype(np.float32)  # (V, D)
        quantized, scales = per_row_int8(table, 63 if reduce_range else 127)
        int8_name, scale_name = f"{table_name}{QUANTIZED_SUFFIX}", f"{table_name}_row_scale"
        graph.initializer.remove(initializers.pop(table_name))
        graph.initializer.extend(
            [numpy_helper.from_array(quantized, int8_name), numpy_helper.from_array(scales[:, None], scale_name)]
        )
        nodes += _lookup(node, int8_name, scale_name)
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


def _lookup(node: onnx.NodeProto, int8_table: str, scale_name: str) -> list[onnx.NodeProto]:
    """The node's output (..., D), float32 as before: the int8 rows at its ids times their scales."""
    ids, out = node.input[1], node.output[0]
    return [
        helper.make_node("Gather", [int8_table, ids], [f"{out}_int8"], axis=0),
        helper.make_node("Cast", [f"{out}_int8"], [f"{out}_float"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Gather", [scale_name, ids], [f"{out}_scales"], axis=0),  # (..., 1)
        helper.make_node("Mul", [f"{out}_float", f"{out}_scales"], [out]),
    ]
