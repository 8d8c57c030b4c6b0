"""int8 dynamic quantization of the fp32 graphs for the CPU execution provider."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from onnxruntime.quantization import QuantType, quantize_dynamic

from export.kv_ops import export_kv_ops
from server.metadata import DECODER_FILE, ENCODER_FILE, read_metadata


def export_int8(fp32_dir: Path, out_dir: Path, per_channel: bool = False) -> Path:
    """Quantize MatMul weights to int8; activations stay float32 and are quantized per call."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (ENCODER_FILE, DECODER_FILE):
        quantize_dynamic(
            str(fp32_dir / name), str(out_dir / name), op_types_to_quantize=["MatMul"],
            per_channel=per_channel, weight_type=QuantType.QInt8,
        )  # fmt: skip
    meta = replace(read_metadata(fp32_dir), variant="int8")
    meta.write(out_dir)
    export_kv_ops(out_dir, meta.n_decoder_layers, meta.n_heads, meta.dtype)  # caches stay float32
    return out_dir
