"""Milliseconds per call of an exported graph alone: the decoder step and the encoder, at given shapes.

Runs the graphs as the server opens them (`make_session`: one intra-op thread, no spinning) on seeded
random feeds, with no scheduler, cache gathers or gRPC around them: what a served step would cost if
onnxruntime had the core to itself. `--parallel 1,2` also runs that many copies at once, each on its own
thread of this process, as the server's engine threads do; compared with the server's own step time
(`translation_decode_step_duration_seconds`) it says how much serving adds around onnxruntime.
`--profile` adds, per graph and batch size, onnxruntime's profile of `--calls` more calls on one thread:
each operator type's share of the kernel time.

Usage:
    python -m bench.step_time --variant-dir model/shipped/onnx/int8 --rows 1,8,32 --past 20 --source 16 --parallel 1,2
    python -m bench.step_time --variant-dir model/shipped/onnx/int8 --rows 1,64 --parallel 1 --profile
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from server.backend.runtime import make_session

WARMUP_CALLS = 10
GRAPHS = ("decoder_step", "encoder")


@dataclass(frozen=True)
class StepTime:
    graph: str  # decoder_step or encoder
    rows: int  # sentences (decoder rows, or encoder batch)
    parallel: int  # copies running at once on threads of one process
    ms_per_call: float  # the mean over the copies


def random_feeds(session: ort.InferenceSession, dims: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """A feed for every input, its symbolic dimensions taken from `dims`: token ids in 4..19 (inside any
    vocabulary), every row at position `dims["P"]`, masks all true, floats standard normal, `top_k` 1."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for graph_input in session.get_inputs():
        shape = [dims[d] if isinstance(d, str) else d for d in graph_input.shape]
        if "int64" in graph_input.type:
            feeds[graph_input.name] = rng.integers(4, 20, size=shape).astype(np.int64)
        elif "bool" in graph_input.type:
            feeds[graph_input.name] = np.ones(shape, dtype=bool)
        else:
            dtype = np.float16 if "float16" in graph_input.type else np.float32
            feeds[graph_input.name] = rng.standard_normal(shape).astype(dtype)
    if "positions" in feeds:
        feeds["positions"][:] = dims["P"]
    if "top_k" in feeds:
        feeds["top_k"] = np.asarray([1], dtype=np.int64)
    return feeds


def time_calls(path: Path, dims: dict[str, int], calls: int, parallel: int) -> float:
    """Mean milliseconds per call over `parallel` sessions of `path` stepping at once, each on its own thread."""
    sessions = [make_session(path, "cpu", intra_op_threads=1, spin_threads=False) for _ in range(parallel)]
    results: list[float] = []
    start = threading.Barrier(parallel)

    def run(session: ort.InferenceSession) -> None:
        feeds = random_feeds(session, dims)
        for _ in range(WARMUP_CALLS):
            session.run(None, feeds)
        start.wait()
        began = time.perf_counter()
        for _ in range(calls):
            session.run(None, feeds)
        results.append((time.perf_counter() - began) / calls * 1000)

    threads = [threading.Thread(target=run, args=(session,)) for session in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(results) / len(results)


def operator_shares(path: Path, dims: dict[str, int], calls: int) -> dict[str, float]:
    """Each operator type's share of the kernel time over `calls` profiled calls, largest first."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as scratch:
        options.profile_file_prefix = str(Path(scratch) / "profile")
        session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        feeds = random_feeds(session, dims)
        for _ in range(calls):
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    kernel_us: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            kernel_us[event["args"]["op_name"]] += event["dur"]
    total = sum(kernel_us.values())
    return {op: us / total for op, us in kernel_us.most_common()}


def step_times(args: argparse.Namespace) -> list[StepTime]:
    times = []
    for graph in args.graphs:
        for rows in args.rows:
            dims = {"B": rows, "P": args.past, "S": args.source, "K": 1}
            for parallel in args.parallel:
                ms = time_calls(args.variant_dir / f"{graph}.onnx", dims, args.calls, parallel)
                times.append(StepTime(graph, rows, parallel, ms))
                past = f"past {args.past}, " if graph == "decoder_step" else ""
                shape = f"{rows:>3} rows, {past}source {args.source}"
                print(f"{graph:>12}: {shape}, {parallel} at once: {ms:7.3f} ms per call", flush=True)
            if args.profile:
                shares = operator_shares(args.variant_dir / f"{graph}.onnx", dims, args.calls)
                print("   " + ", ".join(f"{op} {share:.0%}" for op, share in shares.items() if share >= 0.02))
    return times


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant-dir", type=Path, required=True, help="an exported variant, e.g. onnx/int8")
    parser.add_argument("--graphs", type=lambda s: s.split(","), default=list(GRAPHS), help="decoder_step,encoder")
    parser.add_argument("--rows", type=_ints, default=[1, 8, 32], help="batch sizes, comma-separated")
    parser.add_argument("--past", type=int, default=20, help="past target positions of a decoder step")
    parser.add_argument("--source", type=int, default=16, help="source tokens")
    parser.add_argument("--parallel", type=_ints, default=[1, 2], help="copies at once, on threads of this process")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per copy")
    parser.add_argument("--profile", action="store_true", help="also print each operator type's share of a run")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    step_times(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
