"""Small weightless graphs that move rows of the key/value caches where they live (CUDA IO binding).

The captured runner (`server.backend.captured`) keeps its caches in static device buffers, which its step
writes in place; these graphs write the encoder's output into them and move rows between slots there, so
no cache crosses to the host. Every graph works on all 2L caches of one kind at once (one session run, not
2L), in the decoder's own layout: cache (slots, H, T, Dh).

- kv_move:    cache_i[dst, :, :length] = cache_i[src, :, :length]     in place (beam reorder)
- kv_write:   cache_i[slots, :, :S] = encoded_i[items]                in place (after encoding; zeroing)

"In place" means the server binds the output to the input's own buffer: onnxruntime's ScatterND
skips its copy when input and output share memory, so a move writes only the rows it updates, not the
whole cache. Indices are built inside the graphs from row ids and lengths, so only a few int64s
cross to the device per call.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from model.directory import KV_MOVE_FILE, KV_WRITE_FILE

KV_OPS_OPSET = 18
# The IR version opset 18 came with: a newer onnx package would stamp its own (IR 14 with onnx 1.23), which
# onnxruntime releases older than that package refuse to load.
KV_OPS_IR_VERSION = 8
FLOAT_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


class _Builder:
    """Accumulates nodes and int64 constants, naming every intermediate uniquely."""

    def __init__(self, n_heads: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.heads = self.const("heads", list(range(n_heads)))  # (H,)
        self.n_heads = self.const("n_heads", [n_heads])

    def const(self, name: str, values: list[int], scalar: bool = False) -> str:
        unique = f"{name}_c{len(self.inits)}"
        self.inits.append(helper.make_tensor(unique, TensorProto.INT64, [] if scalar else [len(values)], values))
        return unique

    def op(self, op_type: str, *inputs: str, **attrs: int) -> str:
        out = f"{op_type.lower()}_{len(self.nodes)}"
        node = helper.make_node(op_type, list(inputs), [out])
        node.attribute.extend(helper.make_attribute(key, value) for key, value in attrs.items())
        self.nodes.append(node)
        return out

    def op_to(self, op_type: str, output: str, *inputs: str) -> None:
        """A node writing a graph output by its fixed name (out_i), which `op` would name itself."""
        self.nodes.append(helper.make_node(op_type, list(inputs), [output]))

    def index(self, rows: str, columns: str) -> str:
        """(N, H, L, 3) indices (rows[n], h, columns[n or 0, l]) into a (slots, H, T, Dh) cache.

        `rows` is (N,); `columns` is (N, L) or (1, L), broadcast over the rows.
        """
        shape = self.op("Concat", self.op("Shape", rows), self.n_heads, self.op("Shape", columns, start=1), axis=0)
        r = self.op("Expand", self.op("Reshape", rows, self.const("r_shape", [-1, 1, 1])), shape)
        h = self.op("Expand", self.op("Reshape", self.heads, self.const("h_shape", [1, -1, 1])), shape)
        c = self.op("Expand", self.op("Unsqueeze", columns, self.const("c_axis", [1])), shape)
        parts = [self.op("Unsqueeze", t, self.const("last_axis", [-1])) for t in (r, h, c)]
        return self.op("Concat", *parts, axis=-1)

    def prefix_columns(self, length: str) -> str:
        """(1, length) = [[0, 1, ..., length - 1]] from a scalar int64 `length`."""
        zero, one = self.const("zero", [0], scalar=True), self.const("one", [1], scalar=True)
        return self.op("Unsqueeze", self.op("Range", zero, length, one), self.const("row_axis", [0]))


def _cache_info(name: str, elem: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, ["slots", "H", "T", "Dh"])


def _int_info(name: str, shape: list[str | int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.INT64, shape)


def _model(b: _Builder, name: str, inputs: list, outputs: list) -> onnx.ModelProto:
    graph = helper.make_graph(b.nodes, name, inputs, outputs, initializer=b.inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", KV_OPS_OPSET)], ir_version=KV_OPS_IR_VERSION
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def move_graph(n_caches: int, n_heads: int, elem: int) -> onnx.ModelProto:
    b = _Builder(n_heads)
    columns = b.prefix_columns("length")
    src, dst = b.index("src", columns), b.index("dst", columns)
    for i in range(n_caches):
        moved = b.op("GatherND", f"cache_{i}", src)  # read everything before anything is written
        b.op_to("ScatterND", f"out_{i}", f"cache_{i}", dst, moved)
    inputs = [_cache_info(f"cache_{i}", elem) for i in range(n_caches)]
    inputs += [_int_info("src", ["N"]), _int_info("dst", ["N"]), _int_info("length", [])]
    outputs = [_cache_info(f"out_{i}", elem) for i in range(n_caches)]
    return _model(b, "kv_move", inputs, outputs)


def write_graph(n_caches: int, n_heads: int, elem: int) -> onnx.ModelProto:
    b = _Builder(n_heads)
    length = b.op("Squeeze", b.op("Shape", "encoded_0", start=2, end=3), b.const("squeeze_axis", [0]))
    idx = b.index("slots", b.prefix_columns(length))
    for i in range(n_caches):
        rows = b.op("Gather", f"encoded_{i}", "items", axis=0)  # (N, H, S, Dh): item i's rows, once per slot
        b.op_to("ScatterND", f"out_{i}", f"cache_{i}", idx, rows)
    inputs = [_cache_info(f"cache_{i}", elem) for i in range(n_caches)]
    inputs += [helper.make_tensor_value_info(f"encoded_{i}", elem, ["n", "H", "S", "Dh"]) for i in range(n_caches)]
    inputs += [_int_info("items", ["N"]), _int_info("slots", ["N"])]
    outputs = [_cache_info(f"out_{i}", elem) for i in range(n_caches)]
    return _model(b, "kv_write", inputs, outputs)


def export_kv_ops(out_dir: Path, n_layers: int, n_heads: int, dtype: str) -> None:
    """Write the cache graphs for 2 x `n_layers` caches of `dtype` into `out_dir`."""
    elem, n = FLOAT_TYPES[dtype], 2 * n_layers
    graphs = {
        KV_MOVE_FILE: move_graph(n, n_heads, elem),
        KV_WRITE_FILE: write_graph(n, n_heads, elem),
    }
    for name, model in graphs.items():
        onnx.save(model, str(out_dir / name))
