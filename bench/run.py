"""Run every comparison on one machine and write results.json, results.md and PNG plots.

Offline engines (CTranslate2 float/int8 in both thread layouts, PyTorch eager, our ONNX decoder)
translate the test set in chunks of 8 batches, each engine batching a chunk its own way, for a fixed
time budget per engine and beam size; target tokens per second count generated tokens (EOS excluded)
the same way for all. Single-request latency is a batch of one, sentence after sentence, over the
same first sentences for every engine and the served path. The served path starts `translate-server`
on loopback and drives it with bench.loadgen: one request at a time (latency), closed loop at rising
concurrency (throughput at saturation), open loop with Poisson arrivals at fractions of that rate
(latency percentiles vs offered load). Every engine uses the same thread count.

Usage: python -m bench.run --model-dir model/shipped --out bench/results [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import engines, loadgen
from bench.loadgen import Query, p99, percentile
from model.artifact import TOKENIZER_FILE, load_config, weights_sha256
from model.tokenizer import Tokenizer

log = logging.getLogger("bench")
BEAMS = (1, 4)
CHUNK_BATCHES = 8  # batches per offline translate call
SINGLE_CAP_S = 600.0  # the served single-sentence run stops at its request count; this only bounds a stuck one


@dataclass(frozen=True)
class Budget:
    """How long each measurement runs; --quick shrinks every one of them."""

    offline_s: float  # per engine and beam size, at least one batch
    latency_requests: int  # single-sentence requests per engine and beam size: the same first sentences for all
    load_s: float  # per loadgen run
    concurrency: tuple[int, ...]  # closed-loop levels
    load_fractions: tuple[float, ...]  # open-loop rates as fractions of the saturation rate


FULL = Budget(30.0, 200, 10.0, (1, 4, 16, 64, 128), (0.25, 0.5, 0.75, 1.0, 1.25))
QUICK = Budget(2.0, 4, 2.0, (1, 8), (0.5, 1.0))


@dataclass(frozen=True)
class Workload:
    sources: list[list[int]]  # token ids, both directions interleaved
    queries: list[Query]  # the same sentences as text, for the served path


def load_workload(model_dir: Path, tsv: Path, limit: int) -> Workload:
    """The first `limit` test sentences (0 = all) that fit the model's source length."""
    tok = Tokenizer(model_dir / TOKENIZER_FILE)
    max_len = load_config(model_dir).max_len
    kept = [
        (q, ids)
        for q in loadgen.load_queries(tsv)
        if len(ids := tok.encode_source(q.text, q.target_language)) <= max_len
    ]
    kept = kept[: limit or None]
    if not kept:
        raise ValueError(f"no sentence of {tsv} fits the model's {max_len} source tokens")
    return Workload([ids for _, ids in kept], [q for q, _ in kept])


def offline_throughput(
    engine: engines.OfflineEngine, sources: list[list[int]], beam: int, batch: int, budget_s: float
) -> tuple[dict[str, float], list[list[int]]]:
    """Translate chunks of `CHUNK_BATCHES` batches in order until the budget is spent; tokens/s and the outputs.

    A chunk is handed over whole: an engine batches it its own way (CTranslate2 sorts it by length
    into batches of `batch` and runs them on its workers in parallel).
    """
    engine.translate(sources[:2], beam)  # warm-up: lazy allocations, thread pools
    outputs: list[list[int]] = []
    chunk = batch * CHUNK_BATCHES
    start = time.perf_counter()
    while len(outputs) < len(sources) and (not outputs or time.perf_counter() - start < budget_s):
        outputs += engine.translate(sources[len(outputs) : len(outputs) + chunk], beam)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    return {"sentences": len(outputs), "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}, outputs


def latency_summary(times_ms: list[float]) -> dict[str, float]:
    """p50 and p90 of `times_ms`; p99 only from 100 samples up (below that it is just the maximum)."""
    p50, p90 = percentile(times_ms, 50), percentile(times_ms, 90)
    return {"requests": len(times_ms), "p50_ms": p50, "p90_ms": p90, "p99_ms": p99(times_ms)}


def single_latency(engine: engines.OfflineEngine, sources: list[list[int]], beam: int, n: int) -> dict[str, float]:
    """Milliseconds of one sentence as a batch of one, over the first `n` sentences."""
    times = []
    for src in sources[:n]:
        start = time.perf_counter()
        engine.translate([src], beam)
        times.append((time.perf_counter() - start) * 1000)
    return latency_summary(times)


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Share of sentences whose ids equal the reference's, over the sentences both translated."""
    n = min(len(outputs), len(reference))
    same = sum(a == b for a, b in zip(outputs[:n], reference[:n], strict=True))
    return {"compared": n, "identical": same, "rate": same / n if n else math.nan}


def bench_offline(settings: engines.EngineSettings, work: Workload, budget: Budget) -> dict[str, Any]:
    """Every offline engine of the device: throughput, latency and agreement with PyTorch per beam."""
    results: dict[str, Any] = {}
    outputs: dict[str, dict[int, list[list[int]]]] = {}
    work_dir = Path(tempfile.mkdtemp(prefix="bench-ct2-"))
    for name in engines.DEVICE_ENGINES[settings.device]:
        try:
            engine = engines.create(name, settings, work_dir)
        except engines.Unavailable as err:
            log.warning("skipping %s: %s", name, err)
            results[name] = {"skipped": str(err)}
            continue
        log.info("measuring %s", name)
        entry: dict[str, Any] = {}
        outputs[name] = {}
        for beam in BEAMS:
            throughput, outputs[name][beam] = offline_throughput(
                engine, work.sources, beam, settings.max_batch, budget.offline_s
            )
            latency = single_latency(engine, work.sources, beam, budget.latency_requests)
            entry[f"beam{beam}"] = {"throughput": throughput, "latency": latency}
        results[name] = entry
    reference = outputs.get("pytorch-eager", {})
    for name, per_beam in outputs.items():
        for beam, out in per_beam.items():
            if name != "pytorch-eager" and beam in reference:
                results[name][f"beam{beam}"]["agreement_with_pytorch"] = agreement(out, reference[beam])
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(settings: engines.EngineSettings, port: int, variant: str) -> subprocess.Popen[bytes]:
    """`translate-server` on loopback; returns once it reports SERVING."""
    cmd = [
        sys.executable, "-m", "server.edge.main", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1",
        "--model-dir", str(settings.model_dir), "--variant", variant, "--provider", settings.device,
        "--threads", str(settings.threads), "--max-queue", "100000", "--log-level", "WARNING",
        # as many decoding rows as one offline batch of beam-4 sentences: the same work per step as the offline engines
        "--max-slots", str(settings.max_batch * 4),
    ]  # fmt: skip
    log.info("starting %s", shlex.join(cmd))
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 120
    probe = [sys.executable, "-m", "server.edge.healthcheck", "--address", f"127.0.0.1:{port}"]
    while subprocess.run(probe, capture_output=True).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise engines.Unavailable(f"server did not become SERVING (exit code {proc.poll()})")
        time.sleep(1)
    return proc


def served_unavailable(settings: engines.EngineSettings, variant: str) -> str | None:
    for module in ("server/edge/main.py", "server/backend/runtime.py", "server/edge/healthcheck.py"):
        if not Path(module).is_file():
            return f"{module} is not in this checkout"
    if not (settings.model_dir / "onnx" / variant / "decoder_step.onnx").is_file():
        return f"no {variant} export in {settings.model_dir}/onnx (python -m export --model-dir {settings.model_dir})"
    return None


async def load_sweep(address: str, work: Workload, budget: Budget, max_len: int) -> dict[str, Any]:
    """Closed loop per beam at rising concurrency, then open loop (beam 4) around saturation.

    Every request asks for `max_len` output tokens at most, the limit the offline engines decode with.
    """
    results: dict[str, Any] = {}
    for beam in BEAMS:
        # One request at a time over the sentences the offline engines' latency is measured on.
        single = await loadgen.run_grpc(
            address, work.queries, beam, SINGLE_CAP_S, concurrency=1, max_output_len=max_len,
            max_requests=budget.latency_requests,
        )  # fmt: skip
        runs = []
        for conc in budget.concurrency:
            summary = await loadgen.run_grpc(
                address, work.queries, beam, budget.load_s, concurrency=conc, max_output_len=max_len
            )
            log.info("served beam %d concurrency %d: %.1f tokens/s", beam, conc, summary.tokens_per_s)
            runs.append(asdict(summary))
        results[f"beam{beam}"] = {
            "single": asdict(single),
            "closed": runs,
            "saturation_tokens_per_s": max(r["tokens_per_s"] for r in runs),
        }
    saturation_rps = max(r["achieved_rps"] for r in results["beam4"]["closed"])
    open_runs = []
    for fraction in budget.load_fractions:
        rate = max(0.5, fraction * saturation_rps)
        summary = await loadgen.run_grpc(address, work.queries, 4, budget.load_s, rate=rate, max_output_len=max_len)
        log.info("served open loop %.1f req/s: p99 %.0f ms", rate, summary.p99_ms)
        open_runs.append(asdict(summary))
    results["beam4"]["open"] = open_runs
    return results


def bench_served(settings: engines.EngineSettings, work: Workload, budget: Budget, variant: str) -> dict[str, Any]:
    reason = served_unavailable(settings, variant)
    if reason:
        log.warning("skipping the served path: %s", reason)
        return {"skipped": reason}
    port = free_port()
    proc = start_server(settings, port, variant)
    try:
        return {"variant": variant, **asyncio.run(load_sweep(f"127.0.0.1:{port}", work, budget, settings.max_len))}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    import ctranslate2
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__, "ctranslate2": ctranslate2.__version__}
    try:
        import onnxruntime

        versions["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "versions": versions}


def ratios_to(offline: dict[str, Any], served: dict[str, Any], ct2: str) -> dict[str, Any]:
    """Each engine's throughput and p50 latency relative to `ct2` (throughput: higher is better)."""
    out: dict[str, Any] = {}
    base = offline.get(ct2, {})
    for key in (f"beam{beam}" for beam in BEAMS if f"beam{beam}" in base):
        ref_tps, ref_p50 = base[key]["throughput"]["tokens_per_s"], base[key]["latency"]["p50_ms"]
        row = {
            name: {
                "throughput": e[key]["throughput"]["tokens_per_s"] / ref_tps,
                "latency_p50": e[key]["latency"]["p50_ms"] / ref_p50,
            }
            for name, e in offline.items()
            if key in e and name != ct2
        }
        if key in served:
            single = served[key]["single"]  # the offline engines' latency sentences, one request at a time
            row["served"] = {
                "throughput": served[key]["saturation_tokens_per_s"] / ref_tps,
                "latency_p50": single["p50_ms"] / ref_p50,
            }
        out[key] = row
    return out


def ratios(offline: dict[str, Any], served: dict[str, Any]) -> dict[str, Any]:
    """Ratios against every CTranslate2 compute type that ran."""
    return {name: ratios_to(offline, served, name) for name in offline if name.startswith("ctranslate2")}


def served_variant(requested: str, model_dir: Path, device: str) -> str:
    """`auto`: the device's quantized variant when it is exported (int8 on CPU, fp16 on CUDA), else fp32."""
    if requested != "auto":
        return requested
    preferred = "int8" if device == "cpu" else "fp16"
    return preferred if (model_dir / "onnx" / preferred / "decoder_step.onnx").is_file() else "fp32"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("model/shipped"))
    parser.add_argument("--data", type=Path, default=Path("data/test.tsv"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads for every engine")
    parser.add_argument("--batch", type=int, default=32, help="sentences per offline batch")
    parser.add_argument("--max-len", type=int, default=128, help="most generated tokens per sentence")
    parser.add_argument("--sentences", type=int, default=0, help="use the first N test sentences (0 = all)")
    parser.add_argument("--served-variant", default="auto", help="variant the server loads")
    parser.add_argument("--quick", action="store_true", help="seconds instead of minutes (smoke test)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    budget = QUICK if args.quick else FULL
    settings = engines.EngineSettings(args.model_dir, args.device, args.threads, args.max_len, args.batch)
    work = load_workload(args.model_dir, args.data, args.sentences)
    started = time.perf_counter()
    offline = bench_offline(settings, work, budget)
    served = bench_served(settings, work, budget, served_variant(args.served_variant, args.model_dir, args.device))
    results = {
        "command": shlex.join(["python", "-m", "bench.run", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "settings": {**asdict(settings), "model_dir": str(settings.model_dir), "quick": args.quick},
        "model_sha256": weights_sha256(args.model_dir),
        "sentences": len(work.sources),
        "budget": asdict(budget),
        "offline": offline,
        "served": served,
        "ratios_to_ctranslate2": ratios(offline, served),
        "wall_s": time.perf_counter() - started,
    }
    write_results(results, args.out)


def write_results(results: dict[str, Any], out: Path) -> None:
    from bench.plots import plot_all, render_markdown

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, allow_nan=True) + "\n")
    (out / "results.md").write_text(render_markdown(results))
    for path in plot_all(results, out):
        log.info("wrote %s", path)
    log.info("wrote %s and %s", out / "results.json", out / "results.md")


if __name__ == "__main__":
    main()
