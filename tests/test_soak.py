"""Soak: sustained concurrent load on the real runtime (the tiny model exported to ONNX, served with the
CPU default cache, the working batch), then checks.

Short form in CI (SOAK_SECONDS, default 20); the long form is the same test with a longer run:
    SOAK_SECONDS=600 OMP_NUM_THREADS=1 python -m pytest -q -s tests/test_soak.py
It proves that under load no response is lost, duplicated or crossed with another client's, the
Prometheus counters equal what the clients saw, and memory stops growing after warm-up: the Python
memory allocated under the project's modules (`server/`, `model/`; tracemalloc, numpy buffers aside)
grows by less than LEAK_LIMIT_BYTES per request after warm-up, and the resident set (onnxruntime's
arena and numpy buffers included) by at most RSS_GROWTH_LIMIT_MIB.
Set SOAK_REPORT=path.json to keep the figures (docs/reliability.md quotes a run).

Deliberate break: `SOAK_INJECT_LEAK_BYTES=1024` keeps 1 KiB per request from `Scheduler.add` (called by
the engine, so under `server/`); the soak then fails on the per-request bound (docs/reliability.md
gives the figures of that run).
"""

from __future__ import annotations

import gc
import json
import os
import random
import resource
import statistics
import threading
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from server.backend.working_batch import WorkingBatchRunner
from server.core.scheduler import Scheduler
from server.edge.config import EnginesConfig
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc
from tests.serving import (
    ROOT,
    RunningServer,
    export_tiny_onnx,
    onnx_model,
    request,
    runner_of,
    running_server,
    sample_value,
    server_config,
    wait_until,
)
from tests.tiny import TINY_PAIRS

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "20"))
SOAK_CLIENTS = int(os.environ.get("SOAK_CLIENTS", "6"))
WARMUP_FRACTION = 0.25  # memory is compared from the end of this first part of the run ...
WARMUP_CALLS = 60  # ... and of at least this many calls
RSS_GROWTH_LIMIT_MIB = 16.0  # a 20 s run grows about 1 MiB; allocator caches settle well within this, a leak does not
# Python memory under the project's modules may grow this much per request after warm-up: a quarter of the
# 1 KiB per request the soak must catch, above what requests in flight at the warm-up snapshot hold.
LEAK_LIMIT_BYTES = 256
# The run goes on past SOAK_SECONDS until this many calls finished after warm-up: over fewer, what caches
# still settling and requests in flight hold could hide 1 KiB per request (a count, not a speed).
MIN_REQUESTS_MEASURED = 300
TRACE_FRAMES = 4  # a project frame within 4 of an allocation; deeper stacks slow the server by half again
PROJECT_FILES = [f"{ROOT}/server/*", f"{ROOT}/model/*"]
NUMPY_DOMAIN = 389047  # tracemalloc domain of numpy's array buffers: their bound is the resident set's
INJECT_LEAK_BYTES = int(os.environ.get("SOAK_INJECT_LEAK_BYTES", "0"))
SAMPLE_EVERY_S = 0.25
MAX_SLOTS = 16


def rss_mib() -> float:
    """Current resident set size of this process (server and clients alike)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, not current: a weaker bound


@dataclass(frozen=True)
class Call:
    """One client call as the client saw it."""

    method: str  # Translate | TranslateStream
    lang_pair: str
    beam: int
    texts: tuple[str, ...]
    code: str  # gRPC status code name
    translations: tuple[str, ...]  # by text index; empty unless OK
    sentences: int  # sentences the server reported translating


def call_once(stub: pb_grpc.TranslatorStub, rng: random.Random) -> Call:
    source, target = rng.choice([("de", "en"), ("en", "de")])
    side = 0 if source == "de" else 1
    texts = tuple(rng.choice(TINY_PAIRS)[side] for _ in range(rng.randint(1, 3)))
    beam = rng.randint(1, 3)
    method = rng.choice(["Translate", "TranslateStream"])
    message = request(list(texts), source, target, beam_size=beam)
    try:
        if method == "Translate":
            results = list(stub.Translate(message, timeout=120).results)
        else:
            results = [m.result for m in stub.TranslateStream(message, timeout=120) if m.HasField("result")]
    except grpc.RpcError as error:
        code = error.code().name  # type: ignore[attr-defined]
        return Call(method, f"{source}-{target}", beam, texts, code, (), 0)
    indexes = [r.index for r in results]
    assert sorted(indexes) == list(range(len(texts))), f"lost or duplicated results: {indexes} for {len(texts)} texts"
    by_index = sorted(results, key=lambda r: r.index)
    sentences = sum(r.sentences for r in results)
    return Call(method, f"{source}-{target}", beam, texts, "OK", tuple(r.translation for r in by_index), sentences)


class Tally:
    """What the clients saw, kept as running totals: the harness shares the server's process, so it must
    not hold every call, or its own growth would read as the server's. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.codes: Counter[str] = Counter()
        self.per_series: Counter[tuple[str, str]] = Counter()  # OK calls by (method, lang_pair)
        self.sentences: Counter[str] = Counter()  # by lang_pair
        self.answers: dict[tuple[str, int, str], set[str]] = {}  # (lang_pair, beam, text) -> translations
        self.texts = 0

    def add(self, call: Call) -> None:
        with self._lock:
            self.codes[call.code] += 1
            if call.code != "OK":
                return
            self.per_series[(call.method, call.lang_pair)] += 1
            self.sentences[call.lang_pair] += call.sentences
            self.texts += len(call.texts)
            for text, translation in zip(call.texts, call.translations, strict=True):
                self.answers.setdefault((call.lang_pair, call.beam, text), set()).add(translation)

    @property
    def calls(self) -> int:
        return sum(self.codes.values())


@dataclass
class Load:
    tally: Tally
    rss: list[tuple[float, float]]  # (seconds since start, MiB)
    seconds: float
    after_warmup: tracemalloc.Snapshot  # the project's Python memory at the end of the warm-up
    calls_at_warmup: int  # calls finished by then
    warm_at: float  # seconds since start


def project_memory() -> tracemalloc.Snapshot:
    """Python objects alive now that were allocated with a project frame on the stack; numpy buffers aside.
    Unreachable cycles (a finished request and its sentences) are collected first: they are not kept."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot()
    filters = [tracemalloc.Filter(True, pattern, all_frames=True) for pattern in PROJECT_FILES]
    return snapshot.filter_traces([*filters, tracemalloc.DomainFilter(False, NUMPY_DOMAIN)])


def run_load(served: RunningServer, seconds: float, clients: int) -> Load:
    tally = Tally()
    rss: list[tuple[float, float]] = []
    started = time.monotonic()
    end = started + seconds
    done = threading.Event()
    warm: list[tuple[tracemalloc.Snapshot, int, float]] = []

    def measured_enough() -> bool:
        return bool(warm) and tally.calls - warm[0][1] >= MIN_REQUESTS_MEASURED

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < end or not measured_enough():
            tally.add(call_once(served.stub, rng))

    def sampler() -> None:
        while not done.wait(SAMPLE_EVERY_S):
            elapsed = time.monotonic() - started
            rss.append((elapsed, rss_mib()))
            if not warm and elapsed >= WARMUP_FRACTION * seconds and tally.calls >= WARMUP_CALLS:
                warm.append((project_memory(), tally.calls, time.monotonic() - started))

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(clients)]
    watcher = threading.Thread(target=sampler)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    watcher.join()
    assert warm, "the run ended before its warm-up"
    return Load(tally, rss, time.monotonic() - started, *warm[0])


def counter(served: RunningServer, name: str, **labels: str) -> float:
    return sample_value(served.registry, name, **labels)


def test_sustained_load_loses_nothing_counts_everything_and_does_not_leak(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    export_tiny_onnx(tiny_model_dir)
    model = onnx_model(tiny_model_dir, max_slots=MAX_SLOTS)  # kv_cache "auto", as the server's default
    assert isinstance(runner_of(model), WorkingBatchRunner), "auto on CPU serves the working batch"
    if INJECT_LEAK_BYTES:
        inject_leak(monkeypatch, INJECT_LEAK_BYTES)
    tracemalloc.start(TRACE_FRAMES)
    try:
        with running_server(model, server_config(engines=EnginesConfig(max_slots=MAX_SLOTS, max_queue=4096))) as served:
            load = run_load(served, SOAK_SECONDS, SOAK_CLIENTS)
            engine = served.server.engine
            assert engine is not None
            wait_until(lambda: engine.queue_depth == 0 and engine.active_slots == 0)  # nothing left behind
            at_end = project_memory()
            check_answers_and_counters(served, load.tally)
    finally:
        tracemalloc.stop()

    report = soak_report(load, at_end)
    print(f"\nsoak: {json.dumps(report)}")
    if path := os.environ.get("SOAK_REPORT"):
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    assert report["project_bytes_per_request"] < LEAK_LIMIT_BYTES, (report, top_growth(load.after_warmup, at_end))
    assert report["rss_growth_mib"] <= RSS_GROWTH_LIMIT_MIB, report


def inject_leak(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """The deliberate break: every request admitted keeps `size` bytes for good."""
    kept: list[bytes] = []
    add = Scheduler.add

    def leaking_add(self: Scheduler, *args: object, **kwargs: object) -> object:
        kept.append(os.urandom(size))
        return add(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Scheduler, "add", leaking_add)


def top_growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot) -> list[str]:
    """Where the project's memory grew most, for the failure message."""
    return [str(stat) for stat in after.compare_to(before, "traceback")[:3]]


def check_answers_and_counters(served: RunningServer, tally: Tally) -> None:
    """Every call OK, no answer crossed, and the server's counters equal what the clients saw."""
    assert tally.codes == {"OK": tally.calls}, f"every call succeeds under this load: {tally.codes}"
    crossed = {key: got for key, got in tally.answers.items() if len(got) > 1}
    assert not crossed, f"a text got different translations: another client's answer? {crossed}"

    for (method, pair), seen in tally.per_series.items():
        served_count = counter(served, "translation_requests_total", method=method, code="OK", lang_pair=pair)
        assert served_count == seen, (method, pair)
    for pair in ("de-en", "en-de"):
        assert counter(served, "translation_sentences_total", lang_pair=pair) == tally.sentences[pair]


def soak_report(load: Load, at_end: tracemalloc.Snapshot) -> dict[str, float]:
    """The run's figures; memory growth is the last tenth's median over the median just after warm-up, and
    the project's Python memory at the end (idle) over its snapshot at the end of the warm-up."""
    assert len(load.rss) >= 8, "too few memory samples"
    settled = [m for t, m in load.rss if load.warm_at <= t < load.warm_at + 0.1 * load.seconds]
    final = [m for t, m in load.rss if t >= 0.9 * load.seconds]
    after_warmup = statistics.median(settled or [load.rss[0][1]])
    rss_end = statistics.median(final or [load.rss[-1][1]])
    tally = load.tally
    measured = tally.calls - load.calls_at_warmup
    project_growth = sum(stat.size_diff for stat in at_end.compare_to(load.after_warmup, "filename"))
    return {
        "seconds": round(load.seconds, 1),
        "clients": SOAK_CLIENTS,
        "requests": tally.calls,
        "texts": tally.texts,
        "sentences": sum(tally.sentences.values()),
        "requests_per_s": round(tally.calls / load.seconds, 1),
        "rss_start_mib": round(load.rss[0][1], 1),
        "rss_after_warmup_mib": round(after_warmup, 1),
        "rss_end_mib": round(rss_end, 1),
        "rss_peak_mib": round(max(m for _, m in load.rss), 1),
        "rss_growth_mib": round(rss_end - after_warmup, 1),
        "requests_after_warmup": measured,
        "project_growth_kib": round(project_growth / 1024, 1),
        "project_bytes_per_request": round(project_growth / max(measured, 1), 1),
        "streamed_requests": sum(n for (method, _), n in tally.per_series.items() if method == "TranslateStream"),
    }
