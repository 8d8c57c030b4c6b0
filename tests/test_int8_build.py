"""The int8 graphs built from the weights (export/builder/int8.py) are onnxruntime's `quantize_dynamic` of the
float32 graphs to the bit: the same int8 weights, scales and zero points, and the same log-probabilities,
for both recipes and for the layouts our models and the imported families take. The embedding tables, which
`quantize_dynamic` leaves in float32, hold int8 rows with a scale each."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from export.builder.build import export_float
from export.builder.int8 import Int8Recipe, matmul_int8, per_row_int8
from export.quantize import export_int8
from model.directory import DECODER_FILE, ENCODER_FILE, METADATA_FILE
from tests.int8_check import teacher_forced_log_probs
from tests.tiny import TINY_CONFIG, build_tiny_artifact

TABLES = ("embed.weight", "src_embed.weight")
SHARED = ("const_", "ints_", "scalar_")  # `GraphBuilder.const`'s names
LAYOUTS = {
    "post-norm, one vocabulary": {},
    "pre-norm, scaled embeddings, logits bias, separate vocabularies": {
        "norm_placement": "pre", "scale_embedding": True, "final_logits_bias": True, "src_vocab_size": 100,
    },
}  # fmt: skip


def weights_of(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def named(weights: dict[str, np.ndarray]) -> set[str]:
    """The initializers other than the builder's shared constants (numbered in the order a graph makes them)."""
    return {name for name in weights if not name.startswith(SHARED)}


def constants(weights: dict[str, np.ndarray]) -> set[tuple[str, bytes, tuple[int, ...]]]:
    return {(a.dtype.str, a.tobytes(), a.shape) for name, a in weights.items() if name.startswith(SHARED)}


def unfold_logits_bias(model: onnx.ModelProto) -> None:
    """A float step multiplies [x, 1] by the output weight with the logits bias as its last row; an int8 step
    adds the bias after its quantized product (`export.builder.decoder.padded_projection`). Rewrite the float
    form into the int8 one: MatMul(x, W) + bias, the bias no weight `quantize_dynamic` quantizes."""
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    for node in graph.node:
        concat = producers.get(node.input[0])
        if node.op_type != "MatMul" or node.input[1] not in weights or concat is None or concat.op_type != "Concat":
            continue
        folded = numpy_helper.to_array(weights[node.input[1]])
        weights[node.input[1]].CopyFrom(numpy_helper.from_array(folded[:-1], node.input[1]))
        graph.initializer.append(numpy_helper.from_array(folded[-1], "logits_bias"))
        product, node.input[0] = node.output[0], concat.input[0]
        node.output[0] = f"{product}_unbiased"
        graph.node.append(onnx.helper.make_node("Add", [node.output[0], "logits_bias"], [product]))
        nodes = list(graph.node)
        del graph.node[:]
        graph.node.extend(topological(nodes))
        return
    raise AssertionError("no MatMul of a Concat with the bias row")


def topological(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    made = {out for node in nodes for out in node.output}
    ready: set[str] = set()
    ordered: list[onnx.NodeProto] = []
    left = list(nodes)
    while left:
        node = next(n for n in left if all(i in ready or i not in made for i in n.input))
        ordered.append(node)
        ready.update(node.output)
        left.remove(node)
    return ordered


def quantize_dynamic_reference(fp32_dir: Path, out: Path, recipe: Int8Recipe, bias: bool) -> Path:
    """`quantize_dynamic` of the fp32 graphs whose embedding tables hold their int8 rows dequantized (and whose
    logits bias, with `bias`, is added after the product, as in the int8 step)."""
    out.mkdir()
    for name in (ENCODER_FILE, DECODER_FILE):
        model = onnx.load(str(fp32_dir / name))
        if bias and name == DECODER_FILE:
            unfold_logits_bias(model)
        for tensor in model.graph.initializer:
            if tensor.name in TABLES:
                quantized, scales = per_row_int8(numpy_helper.to_array(tensor), recipe.row_qmax)
                tensor.CopyFrom(numpy_helper.from_array(quantized * scales[:, None], tensor.name))
        onnx.save(model, str(out / f"{name}.f32"))
        quantize_dynamic(
            str(out / f"{name}.f32"), str(out / name), op_types_to_quantize=["MatMul"],
            per_channel=recipe.per_channel, reduce_range=recipe.reduce_range, weight_type=QuantType.QInt8,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},  # past the contrib op shape inference skips
        )  # fmt: skip
    return out


@pytest.mark.parametrize("seven_bit", [False, True], ids=["8-bit per tensor", "7-bit per channel"])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_int8_graphs_are_quantize_dynamics_to_the_bit(tmp_path: Path, layout: dict, seven_bit: bool) -> None:
    model_dir = build_tiny_artifact(tmp_path / "model", config=replace(TINY_CONFIG, **layout))
    recipe = Int8Recipe(per_channel=seven_bit, reduce_range=seven_bit)
    ours = export_int8(model_dir, tmp_path / "int8", seven_bit, seven_bit)
    fp32 = export_float(model_dir, tmp_path / "fp32", "fp32", 18)
    bias = layout.get("final_logits_bias", False)
    reference = quantize_dynamic_reference(fp32, tmp_path / "ref", recipe, bias)
    shutil.copy(ours / METADATA_FILE, reference / METADATA_FILE)
    for name in (ENCODER_FILE, DECODER_FILE):
        built, expected = weights_of(ours / name), weights_of(reference / name)
        quantized = [n for n in expected if n.endswith(("_quantized", "_scale", "_zero_point"))]
        assert len(quantized) >= 3 * 4, f"{name}: quantize_dynamic quantized no MatMul weights"
        for weight in quantized:
            assert built[weight].dtype == expected[weight].dtype, weight
            np.testing.assert_array_equal(built[weight], expected[weight], err_msg=weight)
        rows = {f"{table}{suffix}" for table in TABLES for suffix in ("_quantized", "_row_scale")}
        assert not named(built) - named(expected) - rows, "nothing else is new"
        assert constants(built) <= constants(expected), "no constant the float graph lacks"
        assert not [t for t in TABLES if t in built], "no float32 embedding table is left"
    np.testing.assert_array_equal(teacher_forced_log_probs(ours), teacher_forced_log_probs(reference))


def test_weights_too_small_for_a_float32_scale_take_scale_one_as_onnxruntime_does() -> None:
    weight = np.full((4, 3), 1e-42, np.float32)
    quantized, scale = matmul_int8(weight, Int8Recipe())
    assert scale == 1 and not quantized.any()


def test_weights_quantized_in_slices_equal_weights_quantized_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = np.random.default_rng(0).normal(0, 1, (64, 50)).astype(np.float32).T  # a transposed view, as built
    quantize = [lambda: matmul_int8(weight, Int8Recipe()), lambda: matmul_int8(weight, Int8Recipe(True, True))]
    quantize.append(lambda: per_row_int8(weight, 63))
    whole = [run() for run in quantize]
    monkeypatch.setattr("export.builder.int8.CHUNK_ELEMENTS", 7 * 64)
    for expected, run in zip(whole, quantize, strict=True):
        for a, b in zip(expected, run(), strict=True):
            np.testing.assert_array_equal(a, b)


def test_rows_are_quantized_as_the_shipped_int8_gate_measured_them() -> None:
    """The rows' arithmetic written out whole, as the recipe the shipped BLEU gate measured was written."""
    table = np.random.default_rng(2).normal(0, 1, (300, 32)).astype(np.float32)
    largest = np.abs(table).max(axis=1)
    scales = np.where(largest > 0, largest / 127, 1.0).astype(np.float32)
    quantized = np.clip(np.rint(table / scales[:, None]), -127, 127).astype(np.int8)
    for a, b in zip((quantized, scales), per_row_int8(table), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("qmax", [127, 63])
def test_rows_round_to_their_nearest_step_and_zero_rows_stay_zero(qmax: int) -> None:
    table = np.random.default_rng(0).normal(0, 1, (300, 32)).astype(np.float32)
    table[7] = 0  # a row of zeros (NLLB's and our exports hold some)
    table[11] *= 1000  # rows of very different norms: one scale per row keeps the small ones
    quantized, scales = per_row_int8(table, qmax)
    assert quantized.dtype == np.int8 and np.abs(quantized).max() == qmax
    assert np.all(np.abs(quantized * scales[:, None] - table) <= scales[:, None] / 2 + 1e-6)
    assert not quantized[7].any() and scales[7] == 1
    assert scales[11] > 500 * np.median(scales)
