"""int8 dynamic quantization of the fp32 graphs for the CPU execution provider."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from onnxruntime.quantization import QuantType, quantize_dynamic

from server.metadata import DECODER_FILE, ENCODER_FILE, read_metadata


def export_int8(fp32_dir: Path, out_dir: Path, per_channel: bool = False) -> Path:
    """Quantize MatMul weights to int8; activations stay float32 and are quantized per call."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (ENCODER_FILE, DECODER_FILE):
        quantize_dynamic(
            str(fp32_dir / name), str(out_dir / name), op_types_to_quantize=["MatMul"],
            per_channel=per_channel, weight_type=QuantType.QInt8,
        )  # fmt: skip
    replace(read_metadata(fp32_dir), variant="int8").write(out_dir)
    return out_dir


def copy_variant(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)
