"""The int8 variant for the CPU execution provider: encoder and decoder step built from the weights with their
MatMul weights and embedding tables in int8 (export/builder/int8.py); activations stay float32 and are
quantized per call."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from export.builder.build import build_metadata, save_graph
from export.builder.decoder import decoder_step_graph
from export.builder.encoder import encoder_graph
from export.builder.int8 import Int8Recipe
from export.builder.weights import load_weights
from model.directory import DECODER_FILE, ENCODER_FILE
from model.files import load_config

log = logging.getLogger(__name__)


def export_int8(
    model_dir: Path, out_dir: Path, per_channel: bool = False, reduce_range: bool = False, opset: int = 18
) -> Path:
    """Build the int8 graphs of `model_dir` in `out_dir`.

    The default, 8-bit weights with one scale per tensor, is what the shipped BLEU gate measured. On x86
    CPUs without VNNI onnxruntime multiplies uint8 activations by int8 weights with an instruction whose
    int16 sums can saturate on full-range weights; for such a fleet, `reduce_range` (7-bit weights, as
    onnxruntime advises there) with `per_channel` (a scale per output column, winning back the bit) is the
    recipe to export and gate (`python -m export --int8-7bit`); `int8_flags_for` picks the recipe by the
    CPU's int8 class. docs/decisions.md gives both recipes' BLEU with the command that measures it.
    """
    started = time.perf_counter()
    recipe = Int8Recipe(per_channel, reduce_range)
    cfg = load_config(model_dir)
    weights = load_weights(model_dir, cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, build in ((ENCODER_FILE, encoder_graph), (DECODER_FILE, decoder_step_graph)):
        save_graph(build(weights, cfg, np.dtype(np.float32), opset, recipe), out_dir / name)
    build_metadata(model_dir, "int8", opset, recipe.describe()).write(out_dir)
    log.info("built int8 graphs in %s in %.1f s", out_dir, time.perf_counter() - started)
    return out_dir


def int8_flags_for(cpu_int8: str) -> tuple[bool, bool]:
    """(per_channel, reduce_range) of the int8 recipe that stays close to fp32 on a CPU of this int8 class
    (`model.directory.int8_kernels`): 8-bit per tensor where int8 dot products are exact (VNNI, Arm dot
    products), 7-bit per output channel elsewhere, where 8-bit weights saturate onnxruntime's int16 sums."""
    exact = cpu_int8 in ("vnni", "dotprod")
    return (not exact, not exact)


def int8_recipe(per_channel: bool = False, reduce_range: bool = False) -> str:
    """How `export_int8` made a graph, as its metadata records it (the BLEU gate checks it)."""
    return Int8Recipe(per_channel, reduce_range).describe()
