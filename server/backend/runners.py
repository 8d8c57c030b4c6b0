"""The runner for a cache placement (`--kv-cache`): the one place that chooses among them."""

from __future__ import annotations

import logging
from pathlib import Path

import onnxruntime as ort

from model.directory import FUSED_DECODER_FILE, FUSED_ENCODER_FILE, STATIC_DECODER_FILE, read_metadata
from server.backend import KV_CACHES
from server.backend.device_cache import DeviceCacheRunner
from server.backend.runtime import OnnxRunner
from server.backend.sessions import PROVIDERS
from server.backend.static_cache import CAPTURED_DTYPES, FusedStaticRunner, StaticCacheRunner
from server.backend.working_batch import WorkingBatchRunner

log = logging.getLogger(__name__)


def open_runner(
    variant_dir: Path, max_slots: int, provider: str = "cpu", intra_op_threads: int = 0, kv_cache: str = "auto",
    *, spin_threads: bool = True,
) -> OnnxRunner:  # fmt: skip
    """The runner for a cache placement; an explicit place fails loudly where "auto" falls back (the runner
    refuses an export it cannot run, e.g. `static` for a model without the capturable step)."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"unknown kv_cache {kv_cache!r}; choose from {', '.join(KV_CACHES)}")
    place = kv_cache if kv_cache != "auto" else auto_cache_place(variant_dir, provider)
    runner_class = {
        "device": DeviceCacheRunner, "working": WorkingBatchRunner, "static": StaticCacheRunner,
        "fused": FusedStaticRunner,
    }.get(place, OnnxRunner)  # fmt: skip
    return runner_class(variant_dir, max_slots, provider, intra_op_threads, spin_threads=spin_threads)


def auto_cache_place(variant_dir: Path, provider: str) -> str:
    """Device caches only where they pay. On CUDA the captured step over static buffers where the variant can
    take it (`captured_on_cuda`), built from fused ops where the export has that build (`fused`), else
    the uncaptured device caches. On CPU host memory is the device: numpy caches, kept as the working batch.
    Each choice's measurement is a line in docs/decisions.md."""
    if provider != "cuda":
        return "working"
    if PROVIDERS["cuda"] not in ort.get_available_providers():
        log.warning("kv_cache auto: the caches stay in host memory because this onnxruntime has no CUDA provider")
        return "working"
    if not captured_on_cuda(variant_dir):
        return "device"
    fused = all((variant_dir / name).is_file() for name in (FUSED_DECODER_FILE, FUSED_ENCODER_FILE))
    return "fused" if fused else "static"


def captured_on_cuda(variant_dir: Path) -> bool:
    """Whether the variant's step can be captured on CUDA: it has the capturable graph, in float16, the type
    onnxruntime's CUDA GroupQueryAttention takes (a float32 one runs on the CPU, and nothing is captured
    unless every node is on the GPU)."""
    return (variant_dir / STATIC_DECODER_FILE).is_file() and read_metadata(variant_dir).dtype in CAPTURED_DTYPES
