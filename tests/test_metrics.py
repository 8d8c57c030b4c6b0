"""Every series moves by exactly what was done, on a fresh registry per test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, enable_created_metrics, generate_latest

from server.core import engine as engine_module
from server.core import offline
from server.core.engine import Engine
from server.core.events import EngineLimits, Event, RequestDone, RequestFailed, SentenceDone
from server.core.work import DecodeOptions
from server.edge.metrics import Metrics, StepStats, start_metrics_server
from server.edge.process_metrics import disable_created_metrics, register_process_collectors
from server.processes.engine_messages import GcCounts
from tests.fakes import Collector, FakeRunner, reference_decode
from tests.serving import ROOT, sample_value, wait_until


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return sample_value(registry, name, **labels)


def test_request_and_first_result(registry: CollectorRegistry) -> None:
    """Latency counts calls answered OK or cut off by their deadline; refusals are only counted. Broken once
    on purpose (`RESOURCE_EXHAUSTED` among the timed codes), the refusal added a third de-en duration."""
    metrics = Metrics(registry)
    metrics.observe_request("Translate", "OK", "de-en", 0.03)
    metrics.observe_request("Translate", "OK", "de-en", 0.5)
    metrics.observe_request("TranslateStream", "DEADLINE_EXCEEDED", "en-de", 2.0)
    metrics.observe_first_result("TranslateStream", 0.004)
    assert value(registry, "translation_requests_total", method="Translate", code="OK", lang_pair="de-en") == 2
    labels = {"method": "TranslateStream", "code": "DEADLINE_EXCEEDED", "lang_pair": "en-de"}
    assert value(registry, "translation_requests_total", **labels) == 1
    duration = "translation_request_duration_seconds"
    assert value(registry, f"{duration}_count", method="Translate", lang_pair="de-en") == 2
    assert value(registry, f"{duration}_count", method="TranslateStream", lang_pair="en-de") == 1  # ran to its deadline
    metrics.observe_request("Translate", "RESOURCE_EXHAUSTED", "de-en", 0.001)  # a refusal: counted, not timed
    metrics.observe_request("Translate", "INVALID_ARGUMENT", "", 0.001)
    assert value(registry, f"{duration}_count", method="Translate", lang_pair="de-en") == 2
    assert value(registry, f"{duration}_count", method="Translate", lang_pair="") == 0
    assert value(registry, f"{duration}_sum", method="Translate", lang_pair="de-en") == pytest.approx(0.53)
    assert value(registry, f"{duration}_bucket", method="Translate", lang_pair="de-en", le="0.05") == 1
    ttfr = "translation_time_to_first_result_seconds"
    assert value(registry, f"{ttfr}_bucket", method="TranslateStream", le="0.005") == 1
    assert value(registry, f"{ttfr}_bucket", method="TranslateStream", le="0.0025") == 0


def test_model_info_and_capacity(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry)
    metrics.set_model_info("shipped", "int8", "CPUExecutionProvider", 18)
    metrics.for_model("shipped").set_capacity(32)
    metrics.for_model("opus-mt-de-en").set_capacity(16)
    info = {"model": "shipped", "variant": "int8", "provider": "CPUExecutionProvider", "opset": "18"}
    assert value(registry, "translation_model_info", **info) == 1
    assert value(registry, "translation_max_slots", model="shipped") == 32  # each engine's series by model
    assert value(registry, "translation_max_slots", model="opus-mt-de-en") == 16


def test_step_stats(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry).for_model("shipped")
    stats = StepStats(
        duration_s=0.002,
        encode_duration_s=0.004,
        active_slots=6,
        encode_real_tokens=9,
        encode_padded_tokens=12,
        step_real_tokens=12,
        step_padded_tokens=24,
        queue_waits_s=(0.1, 0.3),
    )
    metrics.observe_step(stats)
    assert value(registry, "translation_decode_step_duration_seconds_sum") == pytest.approx(0.002)
    assert value(registry, "translation_encode_duration_seconds_sum") == pytest.approx(0.004)
    assert value(registry, "translation_step_active_slots_sum") == 6
    assert value(registry, "translation_queue_wait_seconds_count") == 2
    assert value(registry, "translation_queue_wait_seconds_sum") == pytest.approx(0.4)
    assert value(registry, "translation_padding_efficiency_ratio_sum", stage="encode") == pytest.approx(0.75)
    assert value(registry, "translation_padding_efficiency_ratio_sum", stage="decode") == pytest.approx(0.5)
    metrics.set_load(queue_depth=7, active_slots=6)
    assert value(registry, "translation_queue_depth") == 7
    assert value(registry, "translation_active_slots") == 6


def test_names_carry_prefix_and_unit(registry: CollectorRegistry) -> None:
    Metrics(registry)
    # prometheus_client drops a counter's `_total` from the family name; put it back
    names = {f"{f.name}_total" if f.type == "counter" else f.name for f in registry.collect()}
    assert len(names) == 28 and all(name.startswith("translation_") for name in names), names
    units = ("_seconds", "_total", "_ratio", "_slots", "_depth", "_info", "_in_flight", "_bytes", "_entries")
    assert all(name.endswith(units) for name in names), names


def test_the_readme_lists_every_series_the_service_registers_and_no_other(registry: CollectorRegistry) -> None:
    """docs/service.md sends readers to the README's table for the series. Broken once on purpose (the
    cache's byte gauge registered as `translation_cache_size_bytes`), the rename showed on both sides."""
    Metrics(registry)
    register_process_collectors(registry, lambda: {"server-0": os.getpid()})
    names = {f"{f.name}_total" if f.type == "counter" else f.name for f in registry.collect()}
    registered = {name for name in names if name.startswith("translation_")}
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Metrics and the dashboard", 1)[1].split("\n## ", 1)[0]
    listed: set[str] = set()
    for cell in re.findall(r"^\|([^|]*)\|", table, flags=re.MULTILINE):
        family = ""
        for name in re.findall(r"`(translation_\w+|_\w+)", cell):
            if name.startswith("_"):  # `_entries` after `translation_cache_lookups_total`: the same family
                listed.add(family + name)
            else:
                listed.add(name)
                family = "_".join(name.split("_")[:2])
    wildcards = {name for name in listed if name.endswith("_")}  # `translation_child_process_*`
    covered = {name for name in registered if any(name.startswith(prefix) for prefix in wildcards)}
    assert listed - wildcards == registered - covered and covered


def test_step_time_is_the_runners_alone_and_a_failed_step_is_not_one(
    registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step histogram times the runner's copies and step call, not the beam update after them,
    and records nothing for an iteration whose runner raised.

    A clock that moves only when the runner steps (1 s) or the scheduler updates (100 s) makes the sum
    exact. Broken once on purpose (the engine timing the whole iteration, its runner call and the update
    after it), the sum came out 100 s per step over the runner's 1 s."""
    clock = FakeClock()
    for module in (offline, engine_module):  # where an iteration could be timed
        monkeypatch.setattr(module, "time", clock)
    runner = FakeRunner(max_slots=4)
    runner.fail_on_step = 0  # the first request's first step fails it (a lone request is not retried)
    step_log_probs = runner.step_log_probs

    def timed_step(*args: object, **kwargs: object) -> object:
        clock.now += 1.0  # the runner's own work
        return step_log_probs(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "step_log_probs", timed_step)
    engine = Engine(runner, EngineLimits(max_slots=4), Metrics(registry).for_model("tiny"))
    update = engine._scheduler.update

    def slow_update(*args: object, **kwargs: object) -> object:
        clock.now += 100.0  # the engine's own work: must not show up as step time
        return update(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine._scheduler, "update", slow_update)
    engine.start()
    try:
        for want in (RequestFailed, RequestDone):
            collector = Collector()
            engine.submit([[5, 9, 10, 3]], DecodeOptions(beam_size=1, max_output_len=3), collector, lang_pair="de-en")
            assert isinstance(collector.wait(), want)
    finally:
        engine.stop()
    steps = value(registry, "translation_decode_step_duration_seconds_count")
    assert steps == runner.step_calls - 1 >= 2  # the failed call is not a step
    assert value(registry, "translation_decode_step_duration_seconds_sum") == 1.0 * steps
    assert value(registry, "translation_step_active_slots_count") == steps
    assert value(registry, "translation_queue_wait_seconds_count") == 2, "the failed iteration's sentence waited too"


class FakeClock:
    """Stands for the `time` module of the decoding core: `perf_counter` reads `now`, which the test moves;
    the rest (deadlines' `monotonic`) is the real module's."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def test_engine_reports_what_it_decoded(registry: CollectorRegistry) -> None:
    runner = FakeRunner(max_slots=4)
    engine = Engine(runner, EngineLimits(max_slots=4), Metrics(registry).for_model("tiny"))
    sources = [[5, 9, 10, 3], [5, 11, 12, 13, 14, 3], [5, 8, 3]]
    options = DecodeOptions(beam_size=2)
    finished = threading.Event()

    def on_event(event: Event) -> None:
        if isinstance(event, RequestDone | RequestFailed):
            finished.set()

    engine.start()
    try:
        engine.submit(sources, options, on_event, lang_pair="de-en")
        assert finished.wait(30)
    finally:
        engine.stop()
    best = [reference_decode(s, 2, 1.0, 12)[0] for s in sources]
    assert value(registry, "translation_sentences_total", lang_pair="de-en") == 3
    assert value(registry, "translation_input_tokens_total", lang_pair="de-en") == 4 + 6 + 3
    assert value(registry, "translation_output_tokens_total", lang_pair="de-en") == sum(len(h.tokens) for h in best)
    assert value(registry, "translation_decode_step_duration_seconds_count") == runner.step_calls
    assert value(registry, "translation_encode_duration_seconds_count") == len(runner.encode_calls)
    assert value(registry, "translation_step_active_slots_sum") == sum(runner.step_batch_sizes)
    assert value(registry, "translation_queue_wait_seconds_count") == 3
    assert value(registry, "translation_padding_efficiency_ratio_count", stage="decode") == runner.step_calls
    assert value(registry, "translation_padding_efficiency_ratio_count", stage="encode") == len(runner.encode_calls)
    assert value(registry, "translation_queue_depth") == 0
    assert value(registry, "translation_active_slots") == 0
    assert value(registry, "translation_max_slots") == 4


def test_sentence_done_output_tokens_count_the_best_hypothesis(registry: CollectorRegistry) -> None:
    runner = FakeRunner(max_slots=2)
    engine = Engine(runner, EngineLimits(max_slots=2), Metrics(registry).for_model("tiny"))
    done: list[SentenceDone] = []
    finished = threading.Event()

    def on_event(event: Event) -> None:
        if isinstance(event, SentenceDone):
            done.append(event)
        if isinstance(event, RequestDone):
            finished.set()

    engine.start()
    try:
        engine.submit([[4, 7, 3]], DecodeOptions(beam_size=2, num_hypotheses=2), on_event, lang_pair="en-de")
        assert finished.wait(30)
    finally:
        engine.stop()
    assert value(registry, "translation_output_tokens_total", lang_pair="en-de") == len(done[0].hypotheses[0].tokens)


def test_metrics_server_serves_the_registry(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry)
    metrics.observe_request("Translate", "OK", "de-en", 0.01, model="shipped")
    port = start_metrics_server(0, registry, addr="127.0.0.1")
    assert port > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        body = reply.read().decode()
    assert 'translation_requests_total{code="OK",lang_pair="de-en",method="Translate",model="shipped"} 1.0' in body


def test_failed_requests_count_their_unfinished_sentences_by_stage(registry: CollectorRegistry) -> None:
    engine = Engine(FakeRunner(max_slots=2), EngineLimits(max_slots=2), Metrics(registry).for_model("tiny"))
    events: list[Event] = []
    expired = time.monotonic() - 1.0
    engine.submit([[5, 9, 3], [5, 8, 3], [5, 7, 3]], DecodeOptions(beam_size=1), events.append, expired, "de-en")
    engine.submit([[4, 9, 10, 3]], DecodeOptions(beam_size=2), events.append, None, "en-de")
    engine.step()  # the first request expires before any of its sentences got slots; the second starts
    engine.stop()  # never started as a thread: stop() fails what is left, the second request mid-decode
    failed = "translation_sentences_failed_total"
    assert value(registry, failed, lang_pair="de-en", reason="DEADLINE_EXCEEDED", stage="queued") == 3
    assert value(registry, failed, lang_pair="de-en", reason="DEADLINE_EXCEEDED", stage="decoding") == 0
    assert value(registry, failed, lang_pair="en-de", reason="UNAVAILABLE", stage="decoding") == 1
    assert value(registry, "translation_queue_wait_seconds_count") == 1, "only the sentence that got slots waited"
    assert [type(e) for e in events] == [RequestFailed, RequestFailed]


def test_process_platform_and_gc_series_describe_this_process(registry: CollectorRegistry) -> None:
    register_process_collectors(registry)
    assert value(registry, "process_resident_memory_bytes") > 1_000_000
    assert value(registry, "process_cpu_seconds_total") > 0
    assert value(registry, "process_open_fds") > 0
    assert value(registry, "python_gc_collections_total", generation="0") >= 0
    assert value(registry, "python_info", implementation="CPython") == 1


def test_gc_pauses_are_timed_per_generation() -> None:
    import gc

    from server.core.gc_pauses import BUCKETS, GcPauses

    pauses = GcPauses()
    pauses.install()
    pauses.install()  # once, however often
    try:
        assert pauses.installed
        gc.collect(2)
        gc.collect(0)
        gc.collect(0)
    finally:
        pauses.uninstall()
    gc.collect(2)  # after uninstall: not counted
    counts = pauses.snapshot()
    assert [sum(c) for c in counts.counts] == [2, 0, 1] and len(counts.counts[2]) == len(BUCKETS) + 1
    assert 0 < counts.sums[2] < 10 and counts.sums[1] == 0 and not pauses.installed


def test_the_process_collectors_export_this_interpreters_gc_pauses(registry: CollectorRegistry) -> None:
    import gc

    from server.core.gc_pauses import BUCKETS

    register_process_collectors(registry)
    name = "translation_gc_pause_seconds"
    before = value(registry, f"{name}_count", generation="2")
    gc.collect(2)
    assert value(registry, f"{name}_count", generation="2") == before + 1
    buckets = [value(registry, f"{name}_bucket", generation="2", le=str(b)) for b in [*BUCKETS, "+Inf"]]
    assert buckets == sorted(buckets) and buckets[-1] == before + 1  # cumulative, every pause in +Inf
    assert value(registry, f"{name}_sum", generation="2") > 0


def test_child_processes_have_their_own_labelled_series_until_they_exit(registry: CollectorRegistry) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(60)"])
    try:
        children = {"engine-tiny#0": child.pid}
        register_process_collectors(registry, lambda: children)
        name = "translation_child_process_resident_memory_bytes"
        wait_until(lambda: value(registry, name, process="engine-tiny#0") > 64 << 20)  # its 64 MiB, not ours
        assert value(registry, "translation_child_process_cpu_seconds_total", process="engine-tiny#0") >= 0
        assert value(registry, "process_resident_memory_bytes") != value(registry, name, process="engine-tiny#0")
    finally:
        child.kill()
        child.wait()
    assert registry.get_sample_value(name, {"process": "engine-tiny#0"}) is None  # listed, but gone: left out


def test_child_interpreters_gc_series_are_labelled_per_process(registry: CollectorRegistry) -> None:
    reported = {"engine-tiny#0": GcCounts((7, 2, 1), (300, 40, 5), (0, 0, 1)), "engine-tiny#1": GcCounts.now()}
    register_process_collectors(registry, dict, lambda: reported)
    series = "translation_child_python_gc_collections_total"
    assert [value(registry, series, generation=g, process="engine-tiny#0") for g in "012"] == [7, 2, 1]
    collected = "translation_child_python_gc_objects_collected_total"
    assert value(registry, collected, generation="1", process="engine-tiny#0") == 40
    uncollectable = "translation_child_python_gc_objects_uncollectable_total"
    assert value(registry, uncollectable, generation="2", process="engine-tiny#0") == 1
    this_process = value(registry, "python_gc_collections_total", generation="0")
    assert value(registry, series, generation="0", process="engine-tiny#1") <= this_process  # read before


def test_a_childs_gc_pauses_are_a_histogram_labelled_with_it(registry: CollectorRegistry) -> None:
    from server.core.gc_pauses import BUCKETS, PauseCounts

    below_all, above_all = [1] + [0] * len(BUCKETS), [0] * len(BUCKETS) + [1]  # 3 young, 1 full over 250 ms
    timed = PauseCounts((tuple(3 * n for n in below_all), (0,) * (len(BUCKETS) + 1), tuple(above_all)), (3e-5, 0, 0.4))
    reported = {"engine-tiny#0": GcCounts((3, 0, 1), (0, 0, 0), (0, 0, 0), timed), "engine-tiny#1": GcCounts.now()}
    register_process_collectors(registry, dict, lambda: reported)
    name = "translation_child_gc_pause_seconds"
    assert value(registry, f"{name}_count", generation="0", process="engine-tiny#0") == 3
    assert value(registry, f"{name}_bucket", generation="0", process="engine-tiny#0", le=str(BUCKETS[0])) == 3
    assert value(registry, f"{name}_bucket", generation="2", process="engine-tiny#0", le=str(BUCKETS[-1])) == 0
    assert value(registry, f"{name}_bucket", generation="2", process="engine-tiny#0", le="+Inf") == 1
    assert value(registry, f"{name}_sum", generation="2", process="engine-tiny#0") == 0.4


def test_no_created_series_once_disabled(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry)
    metrics.observe_request("Translate", "OK", "de-en", 0.03)
    assert "_created" in generate_latest(registry).decode()  # prometheus-client's default: the switch matters
    disable_created_metrics()
    try:
        text = generate_latest(registry).decode()
    finally:
        enable_created_metrics()
    assert "_created" not in text and "translation_requests_total{" in text
