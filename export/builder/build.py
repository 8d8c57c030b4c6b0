"""A float variant (fp32 or fp16) of a model directory: the graphs built from its weights, checked, with
their metadata, and beside the fused graphs the weightless cache graphs their runner moves rows with."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from export.builder.decoder import decoder_step_graph, shares_cross_groups
from export.builder.encoder import encoder_graph
from export.builder.fused_encoder import fused_encoder_graph
from export.builder.fused_step import capturable, check_capturable, fused_step_graph
from export.builder.weights import Weights, load_weights
from export.kv_ops import export_kv_ops
from model.config import ModelConfig
from model.directory import (
    DECODER_FILE,
    ENCODER_FILE,
    FORMAT_VERSION,
    FUSED_DECODER_FILE,
    FUSED_ENCODER_FILE,
    ExportMetadata,
)
from model.files import load_config, weights_sha256
from model.tokenizer import open_tokenizer

log = logging.getLogger(__name__)

SUPPORTED_OPSETS = range(17, 21)  # LayerNormalization is an ONNX op from opset 17
EXPORTER = f"export.builder (onnx {onnx.__version__} helper, from model.safetensors)"
DTYPES: dict[str, np.dtype] = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16)}
FLOAT_RECIPES = {
    "fp32": "float32 graphs built from the weights",
    "fp16": "float16 graphs built from the weights; log_softmax and top-k in float32",
}


PROTOBUF_LIMIT = 2**31 - 2**27  # bytes of weights kept inside a graph file: protobuf stops at 2 GiB


def check_graph(model: onnx.ModelProto, path: Path) -> None:
    """The no-`If` rule: an If blocks CUDA graphs and forces host-device copies."""
    if "If" in {node.op_type for node in model.graph.node}:
        raise RuntimeError(f"{path} contains an If node")


def save_graph(model: onnx.ModelProto, path: Path) -> None:
    """Write a built graph and check it; the caller's model is spent (its weights move to the file)."""
    check_graph(model, path)
    # past protobuf's 2 GiB (NLLB-600M's fp32 step) the weights go to a side file that onnxruntime reads
    large = sum(len(t.raw_data) for t in model.graph.initializer) > PROTOBUF_LIMIT
    onnx.save(model, str(path), save_as_external_data=large, location=f"{path.name}.data")
    model.Clear()  # the checker reads the file: a graph of weights is not held twice
    onnx.checker.check_model(str(path))


def build_metadata(model_dir: Path, variant: str, opset: int, recipe: str = "") -> ExportMetadata:
    cfg = load_config(model_dir)
    tokenizer = open_tokenizer(model_dir, cfg.tokenizer, cfg.tokenizer_sha256)
    return ExportMetadata(
        format_version=FORMAT_VERSION,
        model_config=cfg.to_dict(), variant=variant, dtype="float16" if variant == "fp16" else "float32",
        opset=opset, exporter=EXPORTER, source_sha256=weights_sha256(model_dir),
        n_decoder_layers=cfg.n_decoder_layers, n_heads=cfg.n_heads, head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size, pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id,
        tag_ids=dict(tokenizer.tag_ids), languages=tokenizer.directions.to_json(),
        max_source_len=cfg.max_len, max_target_len=cfg.max_len, recipe=recipe or FLOAT_RECIPES[variant],
        cross_groups=shares_cross_groups(np.float16 if variant == "fp16" else np.float32),
    )  # fmt: skip


def export_float(model_dir: Path, out_dir: Path, variant: str, opset: int, capturable_fp32: bool = False) -> Path:
    """Build fp32, or fp16 (weights rounded to float16, mask constants finite in half precision).

    The fused capturable step and the fused encoder (the CUDA path's graphs, with the kv_* graphs that move
    its cache rows) are built in float16, the one type CUDA captures them in (onnxruntime's GroupQueryAttention
    takes no float32 there); in float32 only when asked (`capturable_fp32`: the CPU tests of their arithmetic),
    since each is another full copy of the weights that nothing serves."""
    started = time.perf_counter()
    cfg = load_config(model_dir)
    weights = load_weights(model_dir, cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    graphs: dict[str, Callable[[Weights, ModelConfig, np.dtype, int], onnx.ModelProto]] = {
        ENCODER_FILE: encoder_graph,
        DECODER_FILE: decoder_step_graph,
    }
    fused = capturable(cfg) and (variant == "fp16" or capturable_fp32)
    if not capturable(cfg):
        log.info("no %s: head_dim %d is not a size GroupQueryAttention takes", FUSED_DECODER_FILE, cfg.head_dim)
    if fused:
        graphs[FUSED_DECODER_FILE] = fused_step_graph
        graphs[FUSED_ENCODER_FILE] = fused_encoder_graph
    for name, build in graphs.items():
        model = build(weights, cfg, np.dtype(DTYPES[variant]), opset)
        if name == FUSED_DECODER_FILE:
            check_capturable(model, out_dir / name)
        save_graph(model, out_dir / name)
    meta = build_metadata(model_dir, variant, opset)
    meta.write(out_dir)
    if fused:
        export_kv_ops(out_dir, meta.n_decoder_layers, meta.n_heads, meta.dtype)
    log.info("built %s graphs in %s in %.1f s", variant, out_dir, time.perf_counter() - started)
    return out_dir
