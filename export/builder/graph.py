"""A small ONNX graph writer over onnx.helper: nodes named by scope, readable value names, typed constants.

Nodes are named as torch.onnx names them, so a graph reads the same in Netron:
`/decoder/layers.3/self_attn/q_proj/MatMul`, its output `/decoder/layers.3/self_attn/q_proj/MatMul_output_0`.
Weights become initializers under their checkpoint names (`decoder.3.self_attn.q_proj.weight`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export.builder.int8 import Int8Recipe, matmul_int8, per_row_int8

# The IR version opset 18 came with: onnxruntime releases older than the installed onnx package refuse the IR
# that package would stamp by default.
IR_VERSION = 8
ELEM_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}

Dims = Sequence[int | str]


class GraphBuilder:
    """Accumulates the nodes, initializers, inputs and outputs of one graph in a float dtype; with an int8
    recipe, its MatMul weights and embedding tables are int8 (export/builder/int8.py)."""

    def __init__(self, name: str, dtype: np.dtype, int8: Int8Recipe | None = None) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)  # the float type of weights and activations
        self.elem = ELEM_TYPES[self.dtype]
        self.int8 = int8
        self._quantized_inputs: dict[str, list[str]] = {}  # value -> its DynamicQuantizeLinear's outputs
        self.nodes: list[onnx.NodeProto] = []
        # Initializers are written straight into the model that `model` returns: one copy of each weight.
        self._model = onnx.ModelProto(ir_version=IR_VERSION, producer_name="export.builder")
        self._graph = self._model.graph
        self._graph.name = name
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._scope: list[str] = []
        self._used: set[str] = set()
        self._constants: dict[tuple[str, bytes, tuple[int, ...]], str] = {}

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Names the nodes made inside `/<outer>/<name>/...`."""
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def _node_name(self, op_type: str, name: str | None) -> str:
        base = "/" + "/".join([*self._scope, name or op_type])
        unique, n = base, 1
        while unique in self._used:
            unique, n = f"{base}_{n}", n + 1
        self._used.add(unique)
        return unique

    def op(self, op_type: str, *inputs: str, name: str | None = None, outputs: int = 1, **attrs: Any) -> str:
        """Adds a node and returns its (first) output's name."""
        return self.op_n(op_type, *inputs, name=name, outputs=outputs, **attrs)[0]

    def op_n(self, op_type: str, *inputs: str, name: str | None = None, outputs: int = 1, **attrs: Any) -> list[str]:
        """Adds a node with `outputs` outputs and returns their names."""
        node_name = self._node_name(op_type, name)
        names = [f"{node_name}_output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=node_name, **attrs))
        return names

    def rename(self, value: str, name: str) -> str:
        """Gives a computed value a fixed name (a graph input or output's), wherever it is made or read."""
        for node in self.nodes:
            node.output[:] = [name if out == value else out for out in node.output]
            node.input[:] = [name if arg == value else arg for arg in node.input]
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        """A float initializer in the graph's dtype under `name`."""
        tensor = self._graph.initializer.add()
        tensor.name, tensor.data_type = name, self.elem
        tensor.dims.extend(array.shape)
        tensor.raw_data = np.ascontiguousarray(array, dtype=self.dtype).tobytes()
        return name

    def matmul(self, x: str, name: str, array: np.ndarray) -> str:
        """x @ array, a weight (in, out) stored under `name`; int8 in an int8 graph, x then quantized per call
        (one DynamicQuantizeLinear for every weight that multiplies the same x)."""
        if self.int8 is None:
            return self.op("MatMul", x, self.weight(name, array))
        quantized, scale = matmul_int8(array, self.int8)
        weights = [
            self._initializer(quantized, f"{name}_quantized"),
            self._initializer(scale, f"{name}_scale"),
            self._initializer(np.zeros(scale.shape, np.int8), f"{name}_zero_point"),
        ]
        if x not in self._quantized_inputs:
            self._quantized_inputs[x] = self.op_n("DynamicQuantizeLinear", x, name="DynamicQuantizeLinear", outputs=3)
        x_q, x_scale, x_zero = self._quantized_inputs[x]
        product = self.op("MatMulInteger", x_q, weights[0], x_zero, weights[2])  # int32
        scales = self.op("Mul", x_scale, weights[1])
        return self.op("Mul", self.op("Cast", product, to=TensorProto.FLOAT), scales)

    def lookup(self, name: str, table: np.ndarray, ids: str) -> str:
        """The rows of an embedding table (V, D) at `ids`; int8 rows with a scale each in an int8 graph."""
        if self.int8 is None:
            return self.op("Gather", self.weight(name, table), ids, axis=0)
        quantized, scales = per_row_int8(table, self.int8.row_qmax)
        rows = self.op("Gather", self._initializer(quantized, f"{name}_quantized"), ids, axis=0)
        row_scales = self.op("Gather", self._initializer(scales[:, None], f"{name}_row_scale"), ids, axis=0)
        return self.op("Mul", self.op("Cast", rows, to=TensorProto.FLOAT), row_scales)  # (..., D)

    def _initializer(self, array: np.ndarray, name: str) -> str:
        self._graph.initializer.append(numpy_helper.from_array(array, name))
        return name

    def const(self, values: object, dtype: np.dtype | type, name: str = "const") -> str:
        """A constant initializer, shared by every use of the same values, dtype and shape."""
        array = np.asarray(values, dtype=dtype)
        key = (array.dtype.str, array.tobytes(), array.shape)
        if key not in self._constants:
            unique = f"{name}_{len(self._constants)}"
            self._graph.initializer.append(numpy_helper.from_array(array, unique))
            self._constants[key] = unique
        return self._constants[key]

    def ints(self, *values: int) -> str:
        """A 1-D int64 constant: axes, shapes, perms."""
        return self.const(list(values), np.int64, "ints")

    def scalar(self, value: float) -> str:
        """A 0-D constant in the graph's float dtype."""
        return self.const(value, self.dtype, "scalar")

    def add_input(self, name: str, elem: int, dims: Dims) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, list(dims)))
        return name

    def add_output(self, name: str, elem: int, dims: Dims) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem, list(dims)))

    def model(self, opset: int) -> onnx.ModelProto:
        """The finished model; the builder hands over its graph and is spent."""
        model, self._model = self._model, onnx.ModelProto()
        model.opset_import.append(helper.make_opsetid("", opset))
        for domain in sorted({node.domain for node in self.nodes} - {"", "ai.onnx"}):
            model.opset_import.append(helper.make_opsetid(domain, 1))  # contrib ops: com.microsoft
        model.graph.node.extend(self.nodes)
        model.graph.input.extend(self.inputs)
        model.graph.output.extend(self.outputs)
        return model
