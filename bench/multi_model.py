"""python -m bench.multi_model [--model-dir DIR] [--seconds S] [--concurrency C]

How engines share the cores, under the same closed-loop load (beam 4) in three layouts: one model with one
engine of every core (`--engines 1`); one model with one single-threaded engine per core (the default on
CPU), requests to the least loaded; and the same model served twice under two names, one engine each,
every other request naming the second (two models on one node). Prints one JSON record per layout:
requests/s, target tokens/s, p50 and p99 latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.loadgen import Query, Summary, run_grpc
from bench.run import free_port
from model.data import read_tsv
from server.edge.loading import available_cores

SECOND = "second"


def serve(model_dirs: list[Path], flags: list[str], port: int) -> subprocess.Popen[bytes]:
    """`translate-server` on loopback with these models and flags, once SERVING."""
    command = [sys.executable, "-m", "server.edge.main", "--host", "127.0.0.1", "--port", str(port),
               "--metrics-port", "-1", "--log-level", "WARNING", *flags]  # fmt: skip
    for directory in model_dirs:
        command += ["--model-dir", str(directory)]
    process = subprocess.Popen(command)
    probe = [sys.executable, "-m", "server.edge.healthcheck", "--address", f"127.0.0.1:{port}"]
    deadline = time.monotonic() + 180
    while subprocess.run(probe, capture_output=True, check=False).returncode != 0:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the server did not turn SERVING (exit code {process.poll()})")
        time.sleep(0.5)
    return process


def measure(model_dirs: list[Path], flags: list[str], queries: list[Query], args: argparse.Namespace) -> Summary:
    port = free_port()
    process = serve(model_dirs, flags, port)
    try:
        address = f"127.0.0.1:{port}"
        asyncio.run(run_grpc(address, queries[:8], beam_size=4, duration_s=2, concurrency=2))  # warm both
        return asyncio.run(
            run_grpc(address, queries, beam_size=4, duration_s=args.seconds, concurrency=args.concurrency)
        )
    finally:
        process.terminate()
        process.wait(60)


# The engines as threads of the server process in every layout, so that only their number and the models differ
# (with two or more engines the default puts each in a process of its own: docs/service.md#engine-processes).
THREADS = ["--no-engine-processes"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.multi_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("model/shipped"), help="exported model to serve")
    parser.add_argument("--data", type=Path, default=Path("data/test.tsv"))
    parser.add_argument("--seconds", type=float, default=30.0, help="measured load per layout")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    args = parser.parse_args(argv)
    pairs = read_tsv(args.data)
    alone = [Query((p.de,), "de", "en") for p in pairs]
    with tempfile.TemporaryDirectory() as tmp:
        second = Path(tmp) / SECOND
        shutil.copytree(args.model_dir, second, symlinks=True)
        mixed = [
            Query(q.texts, q.source_language, q.target_language, SECOND if i % 2 else "") for i, q in enumerate(alone)
        ]
        cores = available_cores()
        layouts = {
            f"one model, one engine of {cores} threads": ([args.model_dir], ["--engines", "1", *THREADS], alone),
            f"one model, {cores} engines of one thread": ([args.model_dir], ["--engines", str(cores), *THREADS], alone),
            "two models, one engine each, mixed load": ([args.model_dir, second], ["--engines", "1", *THREADS], mixed),
        }
        results = {name: measure(dirs, flags, queries, args) for name, (dirs, flags, queries) in layouts.items()}
    for layout, summary in results.items():
        record = {"layout": layout} | asdict(summary)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in record.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
