"""The runner for a cache placement (`--kv-cache`): the one place that chooses between the two."""

from __future__ import annotations

import logging
from pathlib import Path

import onnxruntime as ort

from model.directory import MetadataError, read_metadata
from server.backend import KV_CACHES
from server.backend.captured import CAPTURED_FILES, CapturedRunner, capture_refusal
from server.backend.runtime import OnnxRunner
from server.backend.sessions import PROVIDERS
from server.backend.working_batch import WorkingBatchRunner

log = logging.getLogger(__name__)


def open_runner(
    variant_dir: Path, max_slots: int, provider: str = "cpu", intra_op_threads: int = 0, kv_cache: str = "auto",
    *, spin_threads: bool = True,
) -> OnnxRunner:  # fmt: skip
    """The runner for a cache placement; an explicit place fails loudly where "auto" falls back (`fused` off
    CUDA, or for a variant the captured step cannot run: the runner refuses it, naming why)."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"unknown kv_cache {kv_cache!r}; choose from {', '.join(KV_CACHES)}")
    place = kv_cache if kv_cache != "auto" else auto_cache_place(variant_dir, provider)
    if place == "fused" and provider != "cuda":
        raise MetadataError(
            f"--kv-cache fused is the CUDA path (a step captured as CUDA graphs), not one for --provider {provider}: "
            "serve with --kv-cache working or auto"
        )
    runner_class = CapturedRunner if place == "fused" else WorkingBatchRunner
    return runner_class(variant_dir, max_slots, provider, intra_op_threads, spin_threads=spin_threads)


def auto_cache_place(variant_dir: Path, provider: str) -> str:
    """The working batch on CPU, where host memory is the device; on CUDA the fused captured step where the
    variant can take it (`why_not_captured`), else the working batch, with a warning saying why. Each choice's
    measurement is a line in docs/decisions.md."""
    if provider != "cuda":
        return "working"
    if PROVIDERS["cuda"] not in ort.get_available_providers():
        log.warning("kv_cache auto: the caches stay in host memory because this onnxruntime has no CUDA provider")
        return "working"
    reason = why_not_captured(variant_dir)
    if reason:
        log.warning(
            "kv_cache auto: the working batch serves %s on CUDA, not the captured step: %s", variant_dir.name, reason
        )
        return "working"
    return "fused"


def why_not_captured(variant_dir: Path) -> str | None:
    """Why the captured step cannot run this variant on CUDA, or None: a head size its attention kernel does not
    take, a type CUDA does not capture it in (float32's attention runs on the CPU, and nothing is captured unless
    every node is on the GPU), or graphs the export did not build."""
    meta = read_metadata(variant_dir)
    refusal = capture_refusal(meta.head_dim, meta.dtype, "cuda", variant_dir.name)
    if refusal:
        return refusal
    missing = [name for name in CAPTURED_FILES if not (variant_dir / name).is_file()]
    return f"the export has no {', '.join(missing)}" if missing else None
