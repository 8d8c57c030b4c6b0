"""Export an artifact to encoder.onnx + decoder_step.onnx (self-attention KV cache, no `If` node)."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
import torch
from onnx import TensorProto, helper
from torch import Tensor, nn

from export.kv_ops import export_kv_ops
from model.artifact import load_artifact, weights_sha256
from model.directory import DECODER_FILE, ENCODER_FILE, FORMAT_VERSION, ExportMetadata
from model.tokenizer import open_tokenizer
from model.transformer import Transformer

log = logging.getLogger(__name__)

SUPPORTED_OPSETS = range(17, 21)
EXPORTER = f"torch {torch.__version__} torch.onnx.export(dynamo=False)"


class EncoderGraph(nn.Module):
    """src_ids (B,S), src_mask (B,S) -> cross_k_i, cross_v_i per decoder layer, each (B,H,S,Dh)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, src_ids: Tensor, src_mask: Tensor) -> tuple[Tensor, ...]:
        memory = self.model.encode(src_ids, src_mask)
        return tuple(t for kv in self.model.cross_kv(memory) for t in kv)


class DecoderStepGraph(nn.Module):
    """One step for every row against a gathered cache; log_softmax inside, float32 out."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model
        self.n_layers = model.cfg.n_decoder_layers

    def forward(self, tokens: Tensor, positions: Tensor, src_mask: Tensor, past_keep: Tensor, *kv: Tensor) -> tuple:
        n = self.n_layers
        cross = [(kv[2 * i], kv[2 * i + 1]) for i in range(n)]
        past_k = [kv[2 * n + 2 * i] for i in range(n)]
        past_v = [kv[2 * n + 2 * i + 1] for i in range(n)]
        logits, new_k, new_v = self.model.decode_step(tokens, positions, past_k, past_v, past_keep, cross, src_mask)
        log_probs = self.model.log_probs(logits)
        return (log_probs, *[t for pair in zip(new_k, new_v, strict=True) for t in pair])


def layer_names(prefix_k: str, prefix_v: str, n: int) -> list[str]:
    return [name for i in range(n) for name in (f"{prefix_k}_{i}", f"{prefix_v}_{i}")]


def export_encoder(model: Transformer, path: Path, opset: int) -> None:
    n = model.cfg.n_decoder_layers
    src = torch.full((2, 3), 7, dtype=torch.long)
    mask = torch.ones(2, 3, dtype=torch.bool)
    outputs = layer_names("cross_k", "cross_v", n)
    axes = {"src_ids": {0: "B", 1: "S"}, "src_mask": {0: "B", 1: "S"}} | {o: {0: "B", 2: "S"} for o in outputs}
    torch.onnx.export(
        EncoderGraph(model), (src, mask), str(path), input_names=["src_ids", "src_mask"], output_names=outputs,
        dynamic_axes=axes, opset_version=opset, dynamo=False,
    )  # fmt: skip


def export_decoder(model: Transformer, path: Path, opset: int) -> None:
    cfg = model.cfg
    n, b, s, p = cfg.n_decoder_layers, 2, 3, 4
    kv_shape_s, kv_shape_p = (b, cfg.n_heads, s, cfg.head_dim), (b, cfg.n_heads, p, cfg.head_dim)
    dtype = next(model.parameters()).dtype
    cross = [torch.randn(kv_shape_s, dtype=dtype) for _ in range(2 * n)]
    past = [torch.randn(kv_shape_p, dtype=dtype) for _ in range(2 * n)]
    args = (
        torch.tensor([5, 6]), torch.tensor([4, 4]), torch.ones(b, s, dtype=torch.bool),
        torch.ones(b, p, dtype=torch.bool), *cross, *past,
    )  # fmt: skip
    cross_names, past_names = layer_names("cross_k", "cross_v", n), layer_names("past_k", "past_v", n)
    new_names = layer_names("new_k", "new_v", n)
    inputs = ["tokens", "positions", "src_mask", "past_keep", *cross_names, *past_names]
    axes: dict[str, dict[int, str]] = {"tokens": {0: "B"}, "positions": {0: "B"}, "src_mask": {0: "B", 1: "S"}}
    axes |= {"past_keep": {0: "B", 1: "P"}, "log_probs": {0: "B"}}
    axes |= {c: {0: "B", 2: "S"} for c in cross_names} | {c: {0: "B", 2: "P"} for c in past_names}
    axes |= {c: {0: "B"} for c in new_names}
    torch.onnx.export(
        DecoderStepGraph(model), args, str(path), input_names=inputs, output_names=["log_probs", *new_names],
        dynamic_axes=axes, opset_version=opset, dynamo=False,
    )  # fmt: skip


def add_candidate_selection(path: Path) -> None:
    """Append the beam's candidate ranking to a decoder graph: inputs row_scores (B,) and top_k (1,),
    outputs top_scores, top_ids (B, k) = TopK(log_probs + row_scores[:, None], top_k).

    A serving step then hands back k candidates per row instead of a (B, V) row of log-probabilities:
    on CUDA the vocabulary-wide rows never leave the device, and on CPU onnxruntime's TopK replaces a
    numpy partition. ONNX TopK breaks ties to the lower index, as the reference beam search does, and
    the float32 add is the reference's own (torch adds scores to log-probs in float32).
    `log_probs` stays an output, for parity checks.
    """
    model = onnx.load(str(path))
    graph = model.graph
    graph.input.extend([
        helper.make_tensor_value_info("row_scores", TensorProto.FLOAT, ["B"]),
        helper.make_tensor_value_info("top_k", TensorProto.INT64, [1]),
    ])  # fmt: skip
    graph.initializer.append(helper.make_tensor("candidate_axis", TensorProto.INT64, [1], [1]))
    graph.node.extend([
        helper.make_node("Unsqueeze", ["row_scores", "candidate_axis"], ["row_scores_column"]),
        helper.make_node("Add", ["log_probs", "row_scores_column"], ["candidate_scores"]),
        helper.make_node(
            "TopK", ["candidate_scores", "top_k"], ["top_scores", "top_ids"], axis=-1, largest=1, sorted=1
        ),
    ])  # fmt: skip
    graph.output.extend([
        helper.make_tensor_value_info("top_scores", TensorProto.FLOAT, ["B", "K"]),
        helper.make_tensor_value_info("top_ids", TensorProto.INT64, ["B", "K"]),
    ])  # fmt: skip
    onnx.save(model, str(path))


def expose_present(path: Path, n_layers: int) -> None:
    """Name each layer's past + new `Concat` `present_k_i` / `present_v_i` and make it a graph output.

    A runner that keeps its self-attention cache as the working batch feeds these (B, H, P + 1, Dh) back
    as the next step's past (`server.backend.working_batch`); the Concat is computed either way, so
    runners that fetch only the new keys/values pay nothing for the extra outputs.
    """
    model = onnx.load(str(path))
    graph = model.graph
    concat_of_past = {node.input[0]: node for node in graph.node if node.op_type == "Concat"}
    past_inputs = {arg.name: arg for arg in graph.input}
    for i in range(n_layers):
        for kind in ("k", "v"):
            node = concat_of_past[f"past_{kind}_{i}"]
            old, new = node.output[0], f"present_{kind}_{i}"
            for consumer in graph.node:
                consumer.input[:] = [new if name == old else name for name in consumer.input]
            node.output[0] = new
            output = graph.output.add()
            output.CopyFrom(past_inputs[f"past_{kind}_{i}"])  # (B, H, P, Dh), then P + 1 along the past
            output.name = new
            output.type.tensor_type.shape.dim[2].dim_param = "P1"
    onnx.save(model, str(path))


def check_graph(path: Path) -> None:
    """onnx.checker plus the no-`If` rule (an If blocks CUDA graphs and forces host-device copies)."""
    onnx.checker.check_model(str(path))
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    if "If" in ops:
        raise RuntimeError(f"{path} contains an If node")


FLOAT_RECIPES = {
    "fp32": "float32 graphs traced from the weights",
    "fp16": "float16 graphs traced from model.half(); log_softmax and top-k in float32",
}


def build_metadata(model_dir: Path, model: Transformer, variant: str, opset: int) -> ExportMetadata:
    cfg = model.cfg
    tokenizer = open_tokenizer(model_dir, cfg.tokenizer, cfg.tokenizer_sha256)
    return ExportMetadata(
        format_version=FORMAT_VERSION,
        model_config=cfg.to_dict(), variant=variant, dtype="float16" if variant == "fp16" else "float32",
        opset=opset, exporter=EXPORTER, source_sha256=weights_sha256(model_dir),
        n_decoder_layers=cfg.n_decoder_layers, n_heads=cfg.n_heads, head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size, pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id,
        tag_ids=dict(tokenizer.tag_ids), language_pairs=[[s, t] for s, t in tokenizer.pairs],
        max_source_len=cfg.max_len, max_target_len=cfg.max_len, recipe=FLOAT_RECIPES[variant],
    )  # fmt: skip


def export_float(model_dir: Path, out_dir: Path, variant: str, opset: int) -> Path:
    """Export fp32 (or fp16 from a half model: MASK_VALUE -1e4 is finite in half precision)."""
    model = load_artifact(model_dir)
    if variant == "fp16":
        model = model.half()
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        export_encoder(model, out_dir / ENCODER_FILE, opset)
        export_decoder(model, out_dir / DECODER_FILE, opset)
    add_candidate_selection(out_dir / DECODER_FILE)
    expose_present(out_dir / DECODER_FILE, model.cfg.n_decoder_layers)
    for name in (ENCODER_FILE, DECODER_FILE):
        check_graph(out_dir / name)
    meta = build_metadata(model_dir, load_artifact(model_dir), variant, opset)
    meta.write(out_dir)
    export_kv_ops(out_dir, meta.n_decoder_layers, meta.n_heads, meta.dtype)
    log.info("exported %s to %s", variant, out_dir)
    return out_dir
