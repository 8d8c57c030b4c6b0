"""onnxruntime sessions as every runner opens them, and the small helpers the cache placements share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
CUDA_OPTIONS = {"use_tf32": "0"}
# onnxruntime fusions a CPU session leaves out: its SkipLayerNormalization kernel runs slower on a CPU than the
# Add and LayerNormalization it replaces (docs/decisions.md).
CPU_DISABLED_OPTIMIZERS = ["SkipLayerNormFusion"]

Feeds = dict[str, npt.NDArray[np.generic]]


def make_session(
    path: Path, provider: str, intra_op_threads: int, spin_threads: bool = True, cuda_graph: bool = False
) -> ort.InferenceSession:
    """A session for `provider`; `spin_threads=False` makes idle intra-op threads sleep, not busy-wait;
    `cuda_graph` has CUDA capture the graph per `gpu_graph_id` and replay it (inputs at fixed addresses).

    Spinning (onnxruntime's default) shaves a little off each op when the process owns its cores.
    A server shares them with gRPC and Python threads, which spinning starves: on small nodes turning
    it off serves faster (docs/decisions.md).
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads  # 0 = onnxruntime's default (all cores)
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin_threads else "0")
    wanted = PROVIDERS[provider]
    providers: list[str | tuple[str, dict[str, str]]] = [wanted]
    disabled = CPU_DISABLED_OPTIMIZERS if wanted == "CPUExecutionProvider" else []
    if wanted == "CUDAExecutionProvider":
        # float32 graphs compute in float32: TF32 tensor cores (onnxruntime's CUDA default) round matmul
        # inputs to 10 mantissa bits and move log-probs by ~4e-3, beyond parity with PyTorch; fp16 is the
        # fast variant there.
        options_cuda = CUDA_OPTIONS | ({"enable_cuda_graph": "1"} if cuda_graph else {})
        providers = [(wanted, options_cuda), "CPUExecutionProvider"]
    return ort.InferenceSession(str(path), sess_options=options, providers=providers, disabled_optimizers=disabled)


def kv_names(prefix_k: str, prefix_v: str, n_layers: int) -> list[str]:
    """Graph argument names in cache order: index 2*i is layer i's key, 2*i+1 its value."""
    return [name for i in range(n_layers) for name in (f"{prefix_k}_{i}", f"{prefix_v}_{i}")]


def moved_pairs(sources: list[int], destinations: list[int]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The (source, destination) slot pairs of a copy that move something, as two arrays."""
    src = np.asarray(sources, dtype=np.int64)
    dst = np.asarray(destinations, dtype=np.int64)
    moved = src != dst
    return src[moved], dst[moved]
