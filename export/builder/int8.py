"""The int8 recipe of the CPU graphs: weights quantized as the builder writes them, with the arithmetic and
the layout of onnxruntime's `quantize_dynamic`, so that no float32 graph has to be built, held and rewritten
first (the rewrite holds several copies of the largest graph at once; docs/decisions.md).

A MatMul weight W (in, out) becomes symmetric int8 with one scale per tensor, or one per output column with
7-bit values (`reduce_range`, for x86 CPUs without VNNI), and its input is quantized per call:

    DynamicQuantizeLinear(x) -> MatMulInteger(x_q, W_q, x_zp, W_zp) -> Cast -> Mul(x_scale * W_scale)

An embedding table a Gather reads becomes int8 with one scale per row, which keeps rows of very different
norms apart (NLLB's and our exports hold zero rows):

    Gather(table int8 (V, D), ids) -> Cast -> Mul(Gather(row scales (V, 1), ids))

The output projection tied to the table keeps the MatMul recipe. Gathering the step's rows from the
projection's own (D, V) weight instead saves no resident memory (onnxruntime packs that weight for its kernel
and frees the original) and costs a strided Gather and a scale per column.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CHUNK_ELEMENTS = 1 << 24  # elements quantized at once: bounds the float temporaries of a 256k-wide projection


@dataclass(frozen=True)
class Int8Recipe:
    """How a graph's weights become int8 (`export.quantize.int8_flags_for` picks one for a CPU class)."""

    per_channel: bool = False  # one scale per output column instead of one per tensor
    reduce_range: bool = False  # 7-bit weights: onnxruntime's int16 sums on CPUs without VNNI cannot saturate

    @property
    def qmax(self) -> int:
        """The largest magnitude an int8 MatMul weight takes (onnxruntime's reduced range is -64..64)."""
        return 64 if self.reduce_range else 127

    @property
    def row_qmax(self) -> int:
        """The largest magnitude an int8 embedding row takes."""
        return 63 if self.reduce_range else 127

    def describe(self) -> str:
        """The recipe as an export's metadata records it (the BLEU gate trusts a measurement for one recipe)."""
        bits = "7-bit" if self.reduce_range else "8-bit"
        scales = "a scale per output channel" if self.per_channel else "one scale per tensor"
        tables = "the embedding tables (a scale per row)"
        return f"int8 dynamic quantization of MatMul weights ({bits}, {scales}) and of {tables}"


def matmul_int8(weight: np.ndarray, recipe: Int8Recipe) -> tuple[np.ndarray, np.ndarray]:
    """A MatMul weight (in, out) as int8 and its float32 scale: () per tensor, (out,) per output column.

    onnxruntime's `quantize_data` for symmetric int8, to the bit: the range widened to take zero, scale =
    2 * absmax / (qmax - qmin) in float64 stored as float32 (1 where it would underflow), values
    rint(w / scale) in float32, zero points 0. Worked in slices of rows, so that a 256k-wide projection
    needs no full-size temporaries."""
    slices = row_slices(weight)
    absmax = np.max([np.abs(weight[rows]).max(axis=0) for rows in slices], axis=0)  # (out,)
    if not recipe.per_channel:
        absmax = absmax.max()
    scale64 = 2 * np.asarray(absmax, np.float64) / (2 * recipe.qmax)  # qmin = -qmax
    scale = np.where(scale64 < np.finfo(np.float32).tiny, 1.0, scale64).astype(np.float32)
    quantized = np.empty(weight.shape, np.int8)
    for rows in slices:
        quantized[rows] = np.clip(np.rint(weight[rows].astype(np.float32, copy=False) / scale), -128, 127)
    return quantized, scale


def per_row_int8(table: np.ndarray, qmax: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 rows of `table` (V, D) and their float32 scales (V,): row ~ quantized * scale.
    An all-zero row gets scale 1 (it dequantizes to zeros either way)."""
    quantized, scales = np.empty(table.shape, np.int8), np.empty(table.shape[0], np.float32)
    for rows in row_slices(table):
        largest = np.abs(table[rows]).max(axis=1)
        scales[rows] = np.where(largest > 0, largest / qmax, 1.0)
        quantized[rows] = np.clip(np.rint(table[rows] / scales[rows, None]), -qmax, qmax)
    return quantized, scales


def row_slices(array: np.ndarray) -> list[slice]:
    """Slices of whole rows of about CHUNK_ELEMENTS elements each, covering `array`."""
    step = max(1, CHUNK_ELEMENTS // max(1, array.shape[-1]))
    return [slice(start, start + step) for start in range(0, array.shape[0], step)]
