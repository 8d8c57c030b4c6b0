"""The served path's ceiling without a model: what one server process answers when its engine costs a fixed time.

On a GPU the decoder step and the encoder are calls that wait on the device with the interpreter lock
released; what is left on the host is the server's own Python: gRPC and the event loop, splitting and
tokenizing, the engine's scheduling. This starts `translate-server`'s front in this process with the
shipped model's tokenizer and engines whose runner sleeps `--step-ms` per decoder step and `--encode-ms`
per encoder call (releasing the lock as a CUDA call does, ranking the same candidates for every row), and
drives it over gRPC with `bench.loadgen` from another process: calls of `--texts-per-request` sentences (one by
default), `--max-len` tokens each.
At steps near zero it measures the front's own ceiling; at a GPU's measured step and encoder times
(docs/benchmarks.md#at-opus-mt-de-ens-shape-on-one-h100) it stands in for that GPU's served path.

Usage:
    python -m bench.front_capacity --step-ms 0.1 --encode-ms 0.1      # the front's ceiling on this machine
    python -m bench.front_capacity --step-ms 1.5 --encode-ms 7        # an H100's captured step and encoder
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from bench.run import free_port
from model.directory import ModelSpec, read_metadata
from model.files import load_config
from model.tokenizer import open_tokenizer
from server.core.runner import Candidates, EncodeItem, RowBias
from server.edge.config import EnginesConfig, ObservabilityConfig, ServerConfig, ServingConfig
from server.edge.convert import ModelDescription
from server.edge.loading import LoadedModel
from server.edge.server import create_server

ROOT = Path(__file__).resolve().parents[1]


def fixed_candidates(row_scores: list[float], k: int, bias: RowBias | None = None) -> Candidates:
    """Every row's k candidates as a runner ranks them, the same tokens for all: ids 10.., each 1 below the last;
    a bias's entries scored the row's score plus their value, as if each asked token had log-probability 0."""
    offsets = np.arange(1, k + 1, dtype=np.float32)
    row = np.asarray(row_scores, np.float32)[:, None]
    scores = (row - offsets[None, :]).astype(np.float32)
    ids = np.broadcast_to(np.arange(10, 10 + k, dtype=np.int64), scores.shape).copy()
    if bias is None:
        return Candidates(scores, ids)
    return Candidates(scores, ids, (row + bias.values).astype(np.float32))


@dataclass
class SleepingRunner:
    """A device stand-in: each call sleeps its time (the lock released), then ranks fixed candidates."""

    spec: ModelSpec
    max_slots: int
    step_s: float
    encode_s: float

    def encode(self, items: list[EncodeItem]) -> None:
        time.sleep(self.encode_s)

    def step(
        self, slots: list[int], tokens: list[int], positions: list[int], row_scores: list[float], k: int,
        bias: RowBias | None = None,
    ) -> Candidates:  # fmt: skip
        time.sleep(self.step_s)
        return fixed_candidates(row_scores, k, bias)

    def copy_slots(self, sources: list[int], destinations: list[int]) -> None:
        pass


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = args.model_dir
    spec = read_metadata(next((model_dir / "onnx").iterdir())).spec()
    tokenizer = open_tokenizer(model_dir, load_config(model_dir).tokenizer)
    description = ModelDescription(
        name="stand-in", variant="fp32", available_variants=["fp32"], provider="sleeping", opset=0,
        model_sha256="0" * 64, dtype="float32",
    )  # fmt: skip
    step_s, encode_s = args.step_ms / 1000, args.encode_ms / 1000
    runners = [SleepingRunner(spec, args.slots, step_s, encode_s) for _ in range(args.engines)]
    config = ServerConfig(
        serving=ServingConfig(port=free_port(), host="127.0.0.1"),
        engines=EnginesConfig(
            max_slots=args.slots, max_queue=100_000, engines=args.engines, admission_wait_ms=args.admission_wait_ms
        ),
        observability=ObservabilityConfig(metrics_port=-1, log_level="WARNING"),
    )
    models = [LoadedModel(r, tokenizer, description) for r in runners]
    server, port = await create_server(config, models, CollectorRegistry())
    command = [
        sys.executable, "-m", "bench.loadgen", "--address", f"127.0.0.1:{port}", "--concurrency",
        str(args.concurrency), "--duration", str(args.duration), "--beam-size", str(args.beam),
        "--max-output-len", str(args.max_len), "--data", str(args.data),
        "--texts-per-request", str(args.texts_per_request),
    ]  # fmt: skip
    try:
        client = await asyncio.create_subprocess_exec(*command, cwd=ROOT, stdout=subprocess.PIPE)
        out, _ = await client.communicate()
    finally:
        await server.shutdown(0.0)
    summary = json.loads(out)
    keys = ("achieved_rps", "tokens_per_s", "p50_ms", "p99_ms", "errors")
    return {"settings": {k: str(v) for k, v in vars(args).items()}, **{k: summary[k] for k in keys}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.front_capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=ROOT / "model/shipped", help="whose tokenizer and ids")
    parser.add_argument("--data", type=Path, default=ROOT / "data/test.tsv")
    parser.add_argument("--step-ms", type=float, default=1.5)
    parser.add_argument("--encode-ms", type=float, default=7.0)
    parser.add_argument("--engines", type=int, default=1, help="engine threads in the server process")
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--max-len", type=int, default=16)
    parser.add_argument("--admission-wait-ms", type=float, default=EnginesConfig.admission_wait_ms)
    parser.add_argument(
        "--texts-per-request", type=int, default=1, help="sentences per call (the front's cost is per call)"
    )
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
