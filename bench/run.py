"""Run every comparison on one machine and write results.json, results.md and PNG plots.

Offline engines (CTranslate2 float/int8 in both thread layouts, PyTorch eager, our ONNX decoder)
translate the test set in chunks of 8 batches, each engine batching a chunk its own way, for a fixed
time budget per engine and beam size; target tokens per second count generated tokens (EOS excluded)
the same way for all. Single-request latency is a batch of one, sentence after sentence, over the
same first sentences for every engine and the served path. The served path starts `translate-server`
on loopback and drives it with bench.loadgen: one request at a time (latency), closed loop at rising
concurrency (throughput at saturation), open loop with Poisson arrivals at fractions of that rate
(latency percentiles vs offered load). Every engine uses the same thread count; the server spends it
as one single-threaded engine per thread on CPU, its default layout. The served path runs once per
precision CTranslate2 runs at, and the ratios compare equal precisions, CTranslate2 in its best layout.

Usage: python -m bench.run --model-dir model/shipped --out bench/results [--quick] [--device cpu|cuda]
An imported OPUS-MT model: add --hf-dir with the transformers directory it was imported from
(bench.opus_size builds, imports, exports and measures one at opus-mt-de-en's shape).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import engines, loadgen
from bench.loadgen import Query, p99, percentile
from model.directions import Directions
from model.files import load_config, weights_sha256
from model.languages import match
from model.tokenizer import open_tokenizer

log = logging.getLogger("bench")
BEAMS = (1, 4)
CHUNK_BATCHES = 8  # batches per offline translate call
SINGLE_CAP_S = 600.0  # the served single-sentence run stops at its request count; this only bounds a stuck one
CHANNELS_PER_PROCESS = 4  # connections per server process of --processes: the kernel's spread is uneven


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


def load_workload(model_dir: Path, tsv: Path, limit: int, glossary: Path | None = None) -> Workload:
    """The first `limit` test sentences (0 = all) in the model's language pairs that fit its source length; with a
    `glossary`, each served German request carries it (`bench.loadgen.load_queries`)."""
    config = load_config(model_dir)
    tok = open_tokenizer(model_dir, config.tokenizer)
    kept = [
        (q, ids)
        for q in loadgen.load_queries(tsv, glossary=glossary)
        if (pair := model_pair(tok.directions, q)) is not None
        and len(ids := tok.encode_source(q.texts[0], pair[1], pair[0])) <= config.max_len
    ]
    kept = kept[: limit or None]
    if not kept:
        raise ValueError(f"no sentence of {tsv} in the model's pairs fits the model's {config.max_len} tokens")
    return Workload([ids for _, ids in kept], [q for q, _ in kept])


def model_pair(directions: Directions, query: Query) -> tuple[str, str] | None:
    """The model's (source, target) codes for a query's client codes (`de` is NLLB's `deu_Latn`), None where the
    model does not translate that direction."""
    source, target = match(query.source_language, directions.sources), match(query.target_language, directions.targets)
    return (source, target) if source and target and directions.translates(source, target) else None


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


def bench_offline(
    settings: engines.EngineSettings, work: Workload, budget: Budget, names: Sequence[str] = ()
) -> dict[str, Any]:
    """Every offline engine of the device (or those named): throughput, latency and agreement with PyTorch
    (where it runs) and with the uncaptured twin per beam."""
    results: dict[str, Any] = {}
    outputs: dict[str, dict[int, list[list[int]]]] = {}
    work_dir = Path(tempfile.mkdtemp(prefix="bench-ct2-"))
    for name in names or engines.DEVICE_ENGINES[settings.device]:
        try:
            engine = engines.create(name, settings, work_dir)
            log.info("measuring %s", name)
            entry: dict[str, Any] = {}
            per_beam: dict[int, list[list[int]]] = {}
            for beam in BEAMS:
                throughput, per_beam[beam] = offline_throughput(
                    engine, work.sources, beam, settings.max_batch, budget.offline_s
                )
                latency = single_latency(engine, work.sources, beam, budget.latency_requests)
                entry[f"beam{beam}"] = {"throughput": throughput, "latency": latency}
        except engines.Unavailable as err:
            log.warning("skipping %s: %s", name, err)
            results[name] = {"skipped": str(err)}
            continue
        except Exception as err:  # one engine failing on a device must not lose the others' measurements
            log.exception("%s failed", name)
            results[name] = {"skipped": f"failed: {type(err).__name__}: {err}"}
            continue
        results[name], outputs[name] = entry, per_beam
    reference = outputs.get("pytorch-eager", {})
    for name, per_beam in outputs.items():
        for beam, out in per_beam.items():
            if name != "pytorch-eager" and beam in reference:
                results[name][f"beam{beam}"]["agreement_with_pytorch"] = agreement(out, reference[beam])
            twin = outputs.get(engines.UNCAPTURED.get(name, ""), {})
            if beam in twin:
                results[name][f"beam{beam}"]["agreement_with_uncaptured"] = agreement(out, twin[beam])
    return results


START_ATTEMPTS = 3  # a free port can be taken by another process before the server binds it


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` different ports free now (each probed while the others are still held)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def served_layout(settings: engines.EngineSettings) -> tuple[int, int]:
    """(engines, intra-op threads each) for the served path: on CPU one single-threaded engine per thread
    of the budget (the server's own default on a node of that many cores, and CTranslate2's throughput
    layout); on CUDA 0, the server's own default (two engines on the GPU)."""
    return (settings.threads, 1) if settings.device == "cpu" else (0, settings.threads)


def served_slots(settings: engines.EngineSettings) -> list[str]:
    """The served path's slots per engine: on CPU as many decoding rows as one offline batch of beam-4 sentences
    (the offline engines' work per step, where a step costs by the row); on CUDA the server's own default (256,
    `server.edge.config.DEVICE_SLOTS`), where a step costs about the same at 8 rows as at 256 and 256 sentences
    in flight over two engines need 512 rows at beam 4."""
    return ["--max-slots", str(settings.max_batch * 4)] if settings.device == "cpu" else []


def start_server(
    settings: engines.EngineSettings, port: int, variant: str, extra: Sequence[str] = (), metrics_port: int = -1
) -> subprocess.Popen[bytes]:
    """`translate-server` on loopback, with `extra` flags after the bench's own; returns once it reports SERVING."""
    n_engines, threads = served_layout(settings)
    cmd = [
        sys.executable, "-m", "server.edge.main", "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", str(metrics_port),
        "--model-dir", str(settings.model_dir), "--variant", variant, "--provider", settings.device,
        "--engines", str(n_engines), "--threads", str(threads), "--max-queue", "100000", "--log-level", "WARNING",
        *served_slots(settings), *extra,
    ]  # fmt: skip
    log.info("starting %s", shlex.join(cmd))
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 120
    probe = [sys.executable, "-m", "server.edge.healthcheck", "--address", f"127.0.0.1:{port}"]
    while subprocess.run(probe, capture_output=True).returncode != 0 or not every_process_serving(port, extra):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise engines.Unavailable(f"server did not become SERVING (exit code {proc.poll()})")
        time.sleep(1)
    return proc


def every_process_serving(port: int, server_args: Sequence[str]) -> bool:
    """Whether a health check over each of several new connections says SERVING: one check reaches one server
    process of `--processes N`, and a run must not start while another still loads. Twice the run's
    connections, each new, leave a process that still loads unseen with a chance of about e^-8."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    connections = connections_for(server_args)
    if connections == 1:
        return True
    for _ in range(2 * connections):
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.RpcError:
                return False
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return False
    return True


def served_unavailable(settings: engines.EngineSettings, variant: str) -> str | None:
    for module in ("server/edge/main.py", "server/backend/runtime.py", "server/edge/healthcheck.py"):
        if not Path(module).is_file():
            return f"{module} is not in this checkout"
    if not (settings.model_dir / "onnx" / variant / "decoder_step.onnx").is_file():
        return f"no {variant} export in {settings.model_dir}/onnx (python -m export --model-dir {settings.model_dir})"
    return None


# The server's step metrics, summed over models and engines: (histogram, what the bench calls its mean).
ENGINE_HISTOGRAMS = {
    "translation_decode_step_duration_seconds": "step",
    "translation_encode_duration_seconds": "encode",
    "translation_step_active_slots": "rows",
    "translation_queue_wait_seconds": "queue",  # a sentence's wait for slots
    "translation_request_duration_seconds": "call",  # a call from the servicer's receipt to its answer
}
RESIDENT_GAUGE = "translation_child_process_resident_memory_bytes"  # by process; engines are "engine-<model>#<n>"


@dataclass
class EngineProbe:
    """Reads the served engines' step histograms from /metrics, so that a closed-loop run can say what one
    decoder step cost while it ran, how many rows it stepped, what share of the run's wall time the engine
    spent inside its decoder and encoder calls (the rest is host work between steps, or idling), and how long
    a call waited for slots and took inside the server; and the largest engine process's resident memory."""

    url: str

    def snapshot(self) -> dict[str, float]:
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url, timeout=10) as response:
            text = response.read().decode()
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name == RESIDENT_GAUGE:
                engines = [s.value for s in family.samples if s.labels.get("process", "").startswith("engine-")]
                totals["engine_bytes"] = max(engines, default=math.nan)
            short = ENGINE_HISTOGRAMS.get(family.name)
            if short is None:
                continue
            for sample in family.samples:
                for suffix in ("_sum", "_count"):
                    if sample.name.endswith(suffix):
                        totals[short + suffix] = totals.get(short + suffix, 0.0) + sample.value
        return totals


def engine_delta(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Per decoder step over one run: mean milliseconds, mean rows, and the busy share of the run's wall time;
    the largest engine's resident memory at its end (a level, not a difference)."""
    diff = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}

    def mean(name: str, scale: float = 1.0) -> float:
        count = diff.get(f"{name}_count", 0.0)
        return scale * diff.get(f"{name}_sum", 0.0) / count if count else math.nan

    busy = diff.get("step_sum", 0.0) + diff.get("encode_sum", 0.0)
    return {
        "steps": diff.get("step_count", 0.0),
        "step_ms": mean("step", 1000.0),
        "rows_per_step": mean("rows"),
        "encode_ms": mean("encode", 1000.0),
        # Where a call's time went: waiting for slots, and in the server at all (the client's latency beyond
        # that is gRPC and the event loop before the servicer saw the call)
        "queue_wait_ms": mean("queue", 1000.0),
        "server_call_ms": mean("call", 1000.0),
        "busy_share": busy / seconds if seconds else math.nan,  # engine-seconds per second: above 1 with 2 engines
        "engine_mb": after.get("engine_bytes", math.nan) / 1e6,
    }


async def load_sweep(
    address: str, work: Workload, budget: Budget, max_len: int, probe: EngineProbe | None = None, channels: int = 1
) -> dict[str, Any]:
    """Closed loop per beam at rising concurrency, then open loop (beam 4) around saturation, the calls over
    `channels` connections.

    Every request asks for `max_len` output tokens at most, the limit the offline engines decode with.
    With a probe, each closed-loop run also records the engines' step figures over that run (`engine_delta`).
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
            before, started = (probe.snapshot() if probe else {}), time.perf_counter()
            summary = await loadgen.run_grpc(
                address, work.queries, beam, budget.load_s, concurrency=conc, max_output_len=max_len, channels=channels
            )
            run = asdict(summary)
            if probe:
                run["engine"] = engine_delta(before, probe.snapshot(), time.perf_counter() - started)
            log.info("served beam %d concurrency %d: %.1f tokens/s %s", beam, conc, summary.tokens_per_s,
                     run.get("engine", ""))  # fmt: skip
            runs.append(run)
        results[f"beam{beam}"] = {
            "single": asdict(single),
            "closed": runs,
            "saturation_tokens_per_s": max(r["tokens_per_s"] for r in runs),
        }
    saturation_rps = max(r["achieved_rps"] for r in results["beam4"]["closed"])
    open_runs = []
    for fraction in budget.load_fractions:
        rate = max(0.5, fraction * saturation_rps)
        summary = await loadgen.run_grpc(
            address, work.queries, 4, budget.load_s, rate=rate, max_output_len=max_len, channels=channels
        )
        log.info("served open loop %.1f req/s: p99 %.0f ms", rate, summary.p99_ms)
        open_runs.append(asdict(summary))
    results["beam4"]["open"] = open_runs
    return results


def bench_served(
    settings: engines.EngineSettings, work: Workload, budget: Budget, variants: list[str], extra: Sequence[str] = ()
) -> dict[str, Any]:
    """The served path per variant: one server each (with `extra` server flags), started and stopped in turn."""
    return {variant: bench_served_variant(settings, work, budget, variant, extra) for variant in variants}


def bench_served_variant(
    settings: engines.EngineSettings, work: Workload, budget: Budget, variant: str, extra: Sequence[str] = ()
) -> dict[str, Any]:
    reason = served_unavailable(settings, variant)
    if reason:
        log.warning("skipping the served %s path: %s", variant, reason)
        return {"skipped": reason}
    for attempt in range(1, START_ATTEMPTS + 1):
        port, metrics_port = free_ports(2)
        try:
            proc = start_server(settings, port, variant, extra, metrics_port)
            break
        except engines.Unavailable as err:  # a port taken between our probe and the server's bind, say
            log.error("the served %s path %s did not start (try %d): %s", variant, shlex.join(extra), attempt, err)
            if attempt == START_ATTEMPTS:
                return {"skipped": f"failed: {err}"}
    n_engines, threads = served_layout(settings)
    try:
        probe = EngineProbe(f"http://127.0.0.1:{metrics_port}/metrics")
        channels = connections_for(extra)
        sweep = asyncio.run(load_sweep(f"127.0.0.1:{port}", work, budget, settings.max_len, probe, channels))
        layout = {"engines": n_engines, "threads_per_engine": threads, "server_args": list(extra), "channels": channels}
        return {"variant": variant, **layout, **sweep}
    except Exception as err:  # a failing arm is recorded, and the arms after it still run
        log.exception("the served %s path %s failed", variant, shlex.join(extra))
        return {"skipped": f"failed: {type(err).__name__}: {err}"}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def connections_for(server_args: Sequence[str]) -> int:
    """The connections a served run spreads its calls over: one, or CHANNELS_PER_PROCESS for each server process
    of `--processes N`, which the kernel hands connections to (SO_REUSEPORT), never single calls."""
    args = list(server_args)
    processes = next((int(args[i + 1]) for i, arg in enumerate(args[:-1]) if arg == "--processes"), 1)
    return CHANNELS_PER_PROCESS * processes if processes > 1 else 1


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    versions = {"python": platform.python_version()}
    for package in ("torch", "ctranslate2"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    try:  # the module that runs, which on a GPU node may be an onnxruntime-gpu put first on the path
        import onnxruntime

        cuda = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
        versions["onnxruntime"] = onnxruntime.__version__ + (" (CUDA)" if cuda else "")
    except ImportError:
        pass
    found = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "versions": versions}
    try:
        import torch

        if torch.cuda.is_available():
            found["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return found


# CTranslate2 compute type -> our variant of the same precision
SAME_PRECISION = {"float32": "fp32", "int8": "int8", "float16": "fp16"}


def best_layout(offline: dict[str, Any], compute_type: str, key: str) -> dict[str, Any] | None:
    """CTranslate2's best throughput and best p50 over its layouts (one worker, one worker per thread)."""
    runs = {
        name: offline[name][key]
        for name in (f"ctranslate2-{compute_type}", f"ctranslate2-{compute_type}-workers")
        if key in offline.get(name, {})
    }
    if not runs:
        return None
    fastest = max(runs, key=lambda name: runs[name]["throughput"]["tokens_per_s"])
    quickest = min(runs, key=lambda name: runs[name]["latency"]["p50_ms"])
    return {
        "tokens_per_s": runs[fastest]["throughput"]["tokens_per_s"], "throughput_layout": fastest,
        "p50_ms": runs[quickest]["latency"]["p50_ms"], "latency_layout": quickest,
    }  # fmt: skip


def ratios(offline: dict[str, Any], served: dict[str, Any]) -> dict[str, Any]:
    """Ours against CTranslate2 at the same precision, CTranslate2 in its best layout for each measure:
    throughput (higher is better) and single-sentence p50 latency (lower is better)."""
    out: dict[str, Any] = {}
    for compute_type, variant in SAME_PRECISION.items():
        per_beam: dict[str, Any] = {}
        for key in (f"beam{beam}" for beam in BEAMS):
            base = best_layout(offline, compute_type, key)
            if base is None:
                continue
            row: dict[str, Any] = {"ctranslate2": base}
            ours = offline.get(f"onnx-{variant}", {})
            if key in ours:
                row[f"onnx-{variant}"] = {
                    "throughput": ours[key]["throughput"]["tokens_per_s"] / base["tokens_per_s"],
                    "latency_p50": ours[key]["latency"]["p50_ms"] / base["p50_ms"],
                }
            path = served.get(variant, {})
            if key in path:
                row[f"served-{variant}"] = {
                    "throughput": path[key]["saturation_tokens_per_s"] / base["tokens_per_s"],
                    "latency_p50": path[key]["single"]["p50_ms"] / base["p50_ms"],
                }
            per_beam[key] = row
        if per_beam:
            out[compute_type] = per_beam
    return out


def ratios_to_transformers(offline: dict[str, Any], served: dict[str, Any]) -> dict[str, Any]:
    """Each served variant against transformers' batched `generate` on the same weights (fp16 on CUDA): the
    baseline most OPUS-MT users run. Throughput at saturation over generate's (higher is better), served
    single-sentence p50 over generate's one-sentence p50 (lower is better)."""
    generate = offline.get("transformers-generate", {})
    out: dict[str, Any] = {}
    for key in (f"beam{beam}" for beam in BEAMS):
        if key not in generate:
            continue
        base = generate[key]
        row: dict[str, Any] = {"transformers": {"tokens_per_s": base["throughput"]["tokens_per_s"],
                                                "p50_ms": base["latency"]["p50_ms"]}}  # fmt: skip
        for variant, path in served.items():
            if key in path:
                row[f"served-{variant}"] = {
                    "throughput": path[key]["saturation_tokens_per_s"] / base["throughput"]["tokens_per_s"],
                    "latency_p50": path[key]["single"]["p50_ms"] / base["latency"]["p50_ms"],
                }
        out[key] = row
    return out


def served_variants(requested: str, device: str) -> list[str]:
    """`auto`: each precision CTranslate2 is measured at on the device (fp32 and int8 on CPU, fp32 and fp16 on CUDA)."""
    if requested != "auto":
        return [v for v in requested.split(",") if v]
    return ["fp32", "int8"] if device == "cpu" else ["fp32", "fp16"]


def _names(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def _fractions(text: str) -> tuple[float, ...]:
    return tuple(float(f) for f in text.split(",") if f)


def _arm(text: str) -> tuple[str, str, list[str]]:
    """`LABEL=VARIANT FLAGS...` -> (label, variant, flags): a served run beside the variants'."""
    label, _, rest = text.partition("=")
    words = shlex.split(rest)
    if not label or not words:
        raise argparse.ArgumentTypeError(f"expected LABEL=VARIANT [FLAGS], got {text!r}")
    return label, words[0], words[1:]


def main(argv: list[str] | None = None, command: str = "") -> None:
    """`command`: what to record as the measuring command, when a wrapper (bench.opus_size) calls this."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("model/shipped"))
    parser.add_argument("--data", type=Path, default=Path("data/test.tsv"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads for every engine")
    parser.add_argument("--batch", type=int, default=32, help="sentences per offline batch")
    parser.add_argument("--max-len", type=int, default=128, help="most generated tokens per sentence")
    parser.add_argument("--sentences", type=int, default=0, help="use the first N test sentences (0 = all)")
    parser.add_argument("--served-variants", default="auto", help="variants served in turn, e.g. fp32,int8")
    parser.add_argument("--hf-dir", type=Path, help="an imported model's transformers directory (CTranslate2's source)")
    parser.add_argument("--glossary", type=Path, help="a de-en TSV glossary each served German request carries")
    parser.add_argument("--quick", action="store_true", help="seconds instead of minutes (smoke test)")
    parser.add_argument("--latency-requests", type=int, default=0, help="single-sentence requests (0 = the budget's)")
    parser.add_argument("--offline-s", type=float, default=0, help="seconds per engine and beam (0 = budget's)")
    parser.add_argument("--load-s", type=float, default=0, help="seconds per loadgen run (0 = the budget's)")
    parser.add_argument("--concurrency", default="", help="closed-loop levels, e.g. 64,256 (default: the budget's)")
    parser.add_argument(
        "--server-args", default="", help='more translate-server flags for the served path, e.g. "--processes 2"'
    )
    parser.add_argument("--engines", type=_names, default=[], help="offline engines to run (default: the device's)")
    parser.add_argument("--load-fractions", type=_fractions, default=(), help="open-loop rates, e.g. 0.5,1.0")
    parser.add_argument(
        "--served-arm", action="append", type=_arm, default=[], metavar="LABEL=VARIANT FLAGS",
        help='one more served run with its own flags, e.g. "fp16-4fronts=fp16 --processes 4"',
    )  # fmt: skip
    args = parser.parse_args(argv)
    unknown = set(args.engines) - set(engines.DEVICE_ENGINES[args.device])
    if unknown:
        parser.error(f"--engines: {sorted(unknown)} are not among {engines.DEVICE_ENGINES[args.device]}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    budget = QUICK if args.quick else FULL
    if args.latency_requests:
        budget = replace(budget, latency_requests=args.latency_requests)
    if args.offline_s:
        budget = replace(budget, offline_s=args.offline_s)
    if args.load_s:
        budget = replace(budget, load_s=args.load_s)
    if args.concurrency:
        budget = replace(budget, concurrency=tuple(int(c) for c in args.concurrency.split(",")))
    if args.load_fractions:
        budget = replace(budget, load_fractions=args.load_fractions)
    settings = engines.EngineSettings(
        args.model_dir, args.device, args.threads, args.max_len, args.batch, hf_dir=args.hf_dir
    )
    work = load_workload(args.model_dir, args.data, args.sentences, args.glossary)
    started = time.perf_counter()
    offline: dict[str, Any] = {}
    served: dict[str, Any] = {}
    host, model_sha256 = machine(), weights_sha256(args.model_dir)

    def gathered() -> dict[str, Any]:
        return {
            "command": command
            or shlex.join(["python", "-m", "bench.run", *(argv if argv is not None else sys.argv[1:])]),
            "machine": host,
            "settings": {
                **asdict(settings),
                "model_dir": str(settings.model_dir),
                "hf_dir": str(args.hf_dir or ""),
                "quick": args.quick,
            },
            "model_sha256": model_sha256,
            "sentences": len(work.sources),
            "budget": asdict(budget),
            "offline": offline,
            "served": served,
            "ratios_to_ctranslate2": ratios(offline, served),
            "ratios_to_transformers": ratios_to_transformers(offline, served),
            "wall_s": time.perf_counter() - started,
        }

    # what is measured so far is on disk after each run, so a run stopped at a node's time limit keeps it
    offline.update(bench_offline(settings, work, budget, args.engines))
    write_partial(gathered(), args.out)
    variants = served_variants(args.served_variants, args.device)
    served.update(bench_served(settings, work, budget, variants, shlex.split(args.server_args)))
    write_partial(gathered(), args.out)
    for label, variant, flags in args.served_arm:
        served[label] = bench_served_variant(settings, work, budget, variant, [*shlex.split(args.server_args), *flags])
        write_partial(gathered(), args.out)
    write_results(gathered(), args.out)


def write_partial(results: dict[str, Any], out: Path) -> None:
    """The results so far, as JSON only (`results.json`; the table and plots come with the whole run)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, allow_nan=True) + "\n")


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
