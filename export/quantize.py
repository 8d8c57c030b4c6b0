"""int8 dynamic quantization of the fp32 graphs for the CPU execution provider."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from onnxruntime.quantization import QuantType, quantize_dynamic

from export.int8_embeddings import quantize_embeddings
from model.directory import DECODER_FILE, ENCODER_FILE, read_metadata


def export_int8(fp32_dir: Path, out_dir: Path, per_channel: bool = False, reduce_range: bool = False) -> Path:
    """Quantize MatMul weights and embedding tables to int8 (`export.int8_embeddings`: one scale per row);
    activations stay float32 and are quantized per call.

    The default, 8-bit weights with one scale per tensor, is what the shipped BLEU gate measured. On x86
    CPUs without VNNI onnxruntime multiplies uint8 activations by int8 weights with an instruction whose
    int16 sums can saturate on full-range weights; for such a fleet, `reduce_range` (7-bit weights, as
    onnxruntime advises there) with `per_channel` (a scale per output column, winning back the bit) is the
    recipe to export and gate (`python -m export --int8-7bit`); `int8_flags_for` picks the recipe by the
    CPU's int8 class. docs/decisions.md gives both recipes' BLEU with the command that measures it.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (ENCODER_FILE, DECODER_FILE):
        quantize_dynamic(
            str(fp32_dir / name), str(out_dir / name), op_types_to_quantize=["MatMul"],
            per_channel=per_channel, reduce_range=reduce_range, weight_type=QuantType.QInt8,
        )  # fmt: skip
        quantize_embeddings(out_dir / name, reduce_range)
    meta = replace(read_metadata(fp32_dir), variant="int8", recipe=int8_recipe(per_channel, reduce_range))
    meta.write(out_dir)
    return out_dir


def int8_flags_for(cpu_int8: str) -> tuple[bool, bool]:
    """(per_channel, reduce_range) of the int8 recipe that stays close to fp32 on a CPU of this int8 class
    (`model.directory.int8_kernels`): 8-bit per tensor where int8 dot products are exact (VNNI, Arm dot
    products), 7-bit per output channel elsewhere, where 8-bit weights saturate onnxruntime's int16 sums."""
    exact = cpu_int8 in ("vnni", "dotprod")
    return (not exact, not exact)


def int8_recipe(per_channel: bool = False, reduce_range: bool = False) -> str:
    """How `export_int8` made a graph, as its metadata records it (the BLEU gate checks it)."""
    bits = "7-bit" if reduce_range else "8-bit"
    scales = "a scale per output channel" if per_channel else "one scale per tensor"
    return (f"int8 dynamic quantization of MatMul weights ({bits}, {scales}) and of the embedding tables "
            "(a scale per row) from the fp32 graphs")  # fmt: skip
