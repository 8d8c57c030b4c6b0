"""The encoder batched across arrivals: the server at two admission waits, alternated, under the same load.

Starts `translate-server` (its defaults, the shipped model unless `--model-dir`) once per arm and round with
`--admission-wait-ms W`, drives it with `bench.loadgen` in a closed loop (`--concurrency` calls in flight,
one sentence each, after a warm-up run), and reads from the server's /metrics what its engines did meanwhile:
encoder calls and their seconds, decoder steps and rows per step. The arms alternate within each round,
because a shared machine drifts between minutes.

Usage:
    python -m bench.admission --waits 0,20 --beams 1,4 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from bench.burst import server
from bench.loadgen import load_queries, run_grpc
from bench.run import EngineProbe, free_ports

ROOT = Path(__file__).resolve().parents[1]


def one_run(args: argparse.Namespace, wait_ms: float, beam: int) -> dict[str, Any]:
    (metrics_port,) = free_ports(1)
    flags = ["--metrics-port", str(metrics_port), "--log-level", "WARNING", "--admission-wait-ms", str(wait_ms)]
    flags += ["--model-dir", str(args.model_dir)] if args.model_dir else []
    with server(flags, args.log) as address:  # bench.burst's: SERVING before it yields, stopped after
        queries = load_queries(args.data)
        asyncio.run(run_grpc(address, queries, beam, args.warmup_s, concurrency=args.concurrency))
        probe = EngineProbe(f"http://localhost:{metrics_port}/metrics")
        before = probe.snapshot()
        load = asyncio.run(run_grpc(address, queries, beam, args.duration, concurrency=args.concurrency))
        after = probe.snapshot()
    diff = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    steps, encodes = diff.get("step_count", 0.0), diff.get("encode_count", 0.0)
    return {
        "wait_ms": wait_ms,
        "beam": beam,
        "tokens_per_s": load.tokens_per_s,
        "p50_ms": load.p50_ms,
        "p99_ms": load.p99_ms,
        "errors": load.errors,
        "encoder_calls": encodes,
        "encoder_s": diff.get("encode_sum", 0.0),
        "steps": steps,
        "rows_per_step": diff.get("rows_sum", 0.0) / steps if steps else 0.0,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="default: the server's (the shipped model)")
    parser.add_argument("--data", type=Path, default=ROOT / "data/test.tsv")
    parser.add_argument("--waits", type=lambda s: [float(w) for w in s.split(",")], default=[0.0, 20.0])
    parser.add_argument("--beams", type=lambda s: [int(b) for b in s.split(",")], default=[1, 4])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of measured load per run")
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--log", type=Path, default=Path("/tmp/bench-admission-server.log"), help="the server's log")
    args = parser.parse_args(argv)
    runs = []
    for beam in args.beams:
        for _ in range(args.rounds):
            for wait_ms in args.waits:
                run = one_run(args, wait_ms, beam)
                runs.append(run)
                print(json.dumps(run), flush=True)
    return runs


if __name__ == "__main__":
    main()
