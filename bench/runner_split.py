"""python -m bench.runner_split --model-dir DIR [--provider cuda] [--kv-caches static,fused] [--beams 1,4]

Where an offline decode's time goes, runner call by runner call, on the runner the server opens
(`open_runner`, `--slots` rows as served): each call of `encode`, `copy_slots` (the beam reorders) and `step`
timed by wall clock (every call ends with its outputs on the host or its device work synchronised), the rest
of the decode being the scheduler's and the beam search's Python; within `encode`, the zeroing of what earlier
sentences left in the slots (`_clean`) apart from the encoder and its cross-cache write (`_encode_into`).
Beside it, each captured bucket's graph replayed alone (`run_with_iobinding` on the bucket's fixed binding: no
uploads, no reads, no Python around it), which is what the step costs the device, to set against the
launch-free floor: the step's weights read once (`decoder step weights MB` over the memory bandwidth).

`--kernel-profile` (CUDA, with torch installed: its profiler reads onnxruntime's kernels through CUPTI in the
same process) adds the kernels of the step graph run uncaptured at the smallest and the largest bucket, and of
one beam reorder (`copy_slots` of 128 rows at 12 positions): each kernel's total time and count over
PROFILE_RUNS calls, which says what a captured step's time is made of.

`--sentences` random sources of `--source-len` tokens (a random model never stops sooner than `--max-len`)
decoded through `server.core.offline.translate_ids` as the engine decodes them. Prints one table per cache
placement and beam, and writes JSON to `--out`.

    python -m bench.runner_split --model-dir runs/gc/work/model --provider cuda --variant fp16 --out split.json
    python -m bench.runner_split --model-dir runs/gc/work/model --provider cuda --kernel-profile --beams 4
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from export.builder.static_step import capturable
from model.config import ModelConfig
from model.directory import read_metadata
from server.backend.runners import open_runner
from server.backend.runtime import PROVIDERS, OnnxRunner
from server.backend.static_cache import StaticCacheRunner
from server.core.offline import translate_ids

REPLAYS = 50  # timed replays of each bucket's graph
PROFILE_RUNS = 10  # profiled calls of each graph, after as many untimed ones
PROFILED_REORDER = (128, 12)  # rows and positions of the profiled beam reorder


class CallTimes:
    """Wall seconds of a runner's calls by name (and, for steps, by the bucket of rows they ran)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, runner: OnnxRunner, name: str, label: Callable[[tuple[Any, ...]], str]) -> None:
        call = getattr(runner, name)

        def timed(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args)
            finally:
                key = label(args)
                self.seconds[key] += time.perf_counter() - started
                self.calls[key] += 1

        setattr(runner, name, timed)


def step_label(runner: OnnxRunner) -> Callable[[tuple[Any, ...]], str]:
    """A step's key: its rows' bucket where the runner has buckets, else its row count rounded up to 8."""
    if isinstance(runner, StaticCacheRunner):
        return lambda args: f"step@{runner.buckets[runner.bucket_of(np.asarray(args[0]))]}"
    return lambda args: f"step@{-(-len(args[0]) // 8) * 8}"


def random_sources(vocab: int, eos: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[*rng.integers(4, vocab, size=length - 1).tolist(), eos] for _ in range(count)]


def split(runner: OnnxRunner, sources: list[list[int]], beam: int, max_len: int) -> dict[str, Any]:
    """One timed decode (after an untimed one): the runner's calls and the rest, in milliseconds."""
    translate_ids(runner, sources, beam, 1.0, max_len)  # warm-up: captures the buckets, sizes the arenas
    times, within = CallTimes(), CallTimes()
    times.wrap(runner, "encode", lambda args: "encode")
    times.wrap(runner, "copy_slots", lambda args: "copy_slots")
    times.wrap(runner, "step", step_label(runner))
    # inside encode: zeroing what earlier sentences left in the slots, then the encoder and the cross-cache write
    within.wrap(runner, "_clean", lambda args: "clean")
    within.wrap(runner, "_encode_into", lambda args: "encode_into")
    started = time.perf_counter()
    hypotheses = translate_ids(runner, sources, beam, 1.0, max_len)
    total = time.perf_counter() - started
    for name in ("encode", "copy_slots", "step", "_clean", "_encode_into"):
        del runner.__dict__[name]  # the class's methods again
    tokens = sum(len(h[0].tokens) for h in hypotheses)
    runner_s = sum(times.seconds.values())
    calls = {
        key: {"calls": times.calls[key], "ms_per_call": 1e3 * times.seconds[key] / times.calls[key]}
        for key in sorted(times.seconds)
    }
    parts = {
        key: {"calls": within.calls[key], "ms_per_call": 1e3 * within.seconds[key] / within.calls[key]}
        for key in sorted(within.seconds)
    }
    return {
        "beam": beam, "sentences": len(sources), "tokens": tokens, "total_ms": 1e3 * total,
        "tokens_per_s": tokens / total, "runner_ms": 1e3 * runner_s, "host_ms": 1e3 * (total - runner_s),
        "calls": calls, "within_encode": parts,
    }  # fmt: skip


def replay_ms(runner: StaticCacheRunner) -> dict[int, float]:
    """Each bucket's captured graph replayed alone on its binding, milliseconds per replay."""
    replays = {}
    for size, binding, options in zip(runner.buckets, runner.bindings, runner.run_options, strict=True):
        runner.static.run_with_iobinding(binding, options)
        started = time.perf_counter()
        for _ in range(REPLAYS):
            runner.static.run_with_iobinding(binding, options)
        replays[size] = 1e3 * (time.perf_counter() - started) / REPLAYS
    return replays


def kernel_profile(runner: StaticCacheRunner, variant_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Each kernel's total microseconds and calls over PROFILE_RUNS calls: the step graph uncaptured (its own
    session, bound as the bucket's replay is) at the smallest and the largest bucket, and one beam reorder."""
    from torch.profiler import ProfilerActivity, profile  # a parity-and-bench dependency, never the server's

    def kernels(call: Callable[[], object]) -> list[dict[str, Any]]:
        for _ in range(PROFILE_RUNS):
            call()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILE_RUNS):
                call()
        events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
        return [
            {"kernel": e.key, "total_us": e.self_device_time_total, "calls": e.count}
            for e in events if e.self_device_time_total > 0
        ]  # fmt: skip

    uncaptured = runner._session(variant_dir / runner.step_file, cuda_graph=False)
    captured, runner.static = runner.static, uncaptured  # _bind binds runner.static
    try:
        found = {}
        for size in (runner.buckets[0], runner.buckets[-1]):
            binding = runner._bind(size)
            found[f"step@{size}"] = kernels(partial(uncaptured.run_with_iobinding, binding))
    finally:
        runner.static = captured
    rows, length = PROFILED_REORDER
    src = np.arange(rows, dtype=np.int64)
    found[f"copy_slots@{rows}x{length}"] = kernels(lambda: runner._move("self", src, src[::-1].copy(), length))
    return found


def print_kernels(name: str, kernels: list[dict[str, Any]], shown: int = 12) -> None:
    total, count = sum(k["total_us"] for k in kernels), sum(k["calls"] for k in kernels)
    print(f"  {name}: {total / PROFILE_RUNS:.0f} us of kernels per call, {count // PROFILE_RUNS} kernels")
    for k in kernels[:shown]:
        print(f"    {k['total_us'] / PROFILE_RUNS:8.1f} us {k['calls'] // PROFILE_RUNS:4d}x  {k['kernel'][:90]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.runner_split", description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--variant", default="fp16")
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cpu")
    parser.add_argument("--kv-caches", default="static,fused", help="cache placements, e.g. device,static,fused")
    parser.add_argument("--beams", default="1,4")
    parser.add_argument("--sentences", type=int, default=32)
    parser.add_argument("--source-len", type=int, default=20)
    parser.add_argument("--max-len", type=int, default=16)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kernel-profile", action="store_true", help="CUDA: each kernel's time (needs torch)")
    args = parser.parse_args(argv)
    if args.kernel_profile and args.provider != "cuda":
        parser.error("--kernel-profile reads CUDA kernels: run it with --provider cuda")
    variant_dir = args.model_dir / "onnx" / args.variant
    meta = read_metadata(variant_dir)
    spec = meta.spec()
    sources = random_sources(spec.vocab_size, spec.eos_id, args.sentences, args.source_len)
    from bench.run import machine

    results: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "bench.runner_split", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(), "variant": args.variant, "provider": args.provider, "slots": args.slots, "runs": [],
    }  # fmt: skip
    for place in (p for p in args.kv_caches.split(",") if p):
        if place in ("static", "fused") and not capturable(ModelConfig.from_dict(meta.model_config)):
            skipped = f"head size {meta.head_dim} has no capturable step"  # GroupQueryAttention does not take it
            print(f"{place}: skipped, {skipped}")
            results["runs"].append({"kv_cache": place, "skipped": skipped})
            continue
        runner = open_runner(variant_dir, args.slots, args.provider, kv_cache=place)
        step_file = getattr(runner, "step_file", None)
        entry: dict[str, Any] = {"kv_cache": place, "splits": []}
        if step_file is not None:
            entry["decoder_step_weights_mb"] = (variant_dir / step_file).stat().st_size / 1e6
        for beam in (int(b) for b in args.beams.split(",")):
            found = split(runner, sources, beam, args.max_len)
            entry["splits"].append(found)
            print(
                f"{place} beam {beam}: {found['tokens_per_s']:.0f} tokens/s, {found['total_ms']:.1f} ms = runner"
                f" {found['runner_ms']:.1f} + host {found['host_ms']:.1f}"
            )
            for key, call in found["calls"].items():
                print(f"  {key}: {call['calls']} calls, {call['ms_per_call']:.3f} ms each")
            for key, call in found["within_encode"].items():
                print(f"    within encode, {key}: {call['calls']} calls, {call['ms_per_call']:.3f} ms each")
        if isinstance(runner, StaticCacheRunner):
            entry["replay_ms"] = replay_ms(runner)
            print(f"  {place} graph replay alone, ms by bucket: {entry['replay_ms']}")
            if args.kernel_profile:
                entry["kernels"] = kernel_profile(runner, variant_dir)
                for name, kernels in entry["kernels"].items():
                    print_kernels(name, kernels)
        results["runs"].append(entry)
        del runner
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
