"""The engine thread around the scheduler: concurrency, failures, cancellation, drain and shutdown
with the fake runner, then equality with the offline decoder on a real exported tiny model."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from server.core.engine import Engine
from server.core.events import (
    ENGINE_FAILED_MESSAGE,
    SHUTDOWN_MESSAGE,
    DrainingError,
    EngineFailedError,
    EngineLimits,
    Event,
    FailureReason,
    QueueFullError,
    RequestDone,
    RequestFailed,
    SentenceDone,
)
from server.core.runner import Candidates, RowBias
from server.core.work import DecodeOptions
from server.edge.metrics import Metrics, ModelMetrics
from tests.fakes import WAIT_S, Collector, FakeRunner, reference_decode
from tests.serving import sample_value

ROOT = Path(__file__).resolve().parents[1]


class GatedRunner(FakeRunner):
    """A FakeRunner whose steps wait for the test to open a gate: freezes the engine mid-decode."""

    def __init__(self, max_slots: int) -> None:
        super().__init__(max_slots)
        self.gate = threading.Semaphore(0)
        self.entered = threading.Event()  # a step has reached the gate

    def step_log_probs(self, slots: list[int], tokens: list[int], positions: list[int]) -> np.ndarray:
        self.entered.set()
        assert self.gate.acquire(timeout=WAIT_S), "the test never opened the gate"
        return super().step_log_probs(slots, tokens, positions)

    def open(self, steps: int = 10_000) -> None:
        for _ in range(steps):
            self.gate.release()


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def build(runner: FakeRunner, metrics: ModelMetrics | None = None, **limits: int) -> Engine:
        engine = Engine(runner, EngineLimits(max_slots=runner.max_slots, **limits), metrics)
        engine.start()
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        if isinstance(engine._runner, GatedRunner):
            engine._runner.open()
        engine.stop()


def src(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [5, *rng.integers(6, 24, int(rng.integers(1, 9))).tolist(), 3]


def expected(source: list[int], options: DecodeOptions) -> list[tuple[tuple[int, ...], float]]:
    hyps = reference_decode(source, options.beam_size, options.length_penalty, options.max_output_len or 12)
    return [(h.tokens, h.score) for h in hyps[: options.num_hypotheses]]


def test_concurrent_requests_with_mixed_beams_equal_each_alone(engine_factory: Callable[..., Engine]) -> None:
    runner = FakeRunner(max_slots=8)
    engine = engine_factory(runner)
    jobs: list[tuple[list[list[int]], DecodeOptions, Collector]] = []
    lock = threading.Lock()

    def client(worker: int) -> None:
        for n in range(6):
            seed = 100 * worker + n
            options = DecodeOptions(beam_size=1 + seed % 4, length_penalty=0.6 + 0.2 * (seed % 3))
            sentences = [src(seed * 7 + i) for i in range(1 + seed % 3)]
            collector = Collector()
            engine.submit(sentences, options, collector, lang_pair="de-en")
            with lock:
                jobs.append((sentences, options, collector))
            time.sleep(0.001 * (seed % 3))

    threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for sentences, options, collector in jobs:
        assert collector.wait() == RequestDone()
        assert collector.hypotheses() == {i: expected(s, options) for i, s in enumerate(sentences)}
    assert len(jobs) == 24 and max(runner.step_batch_sizes) > 4
    assert engine.queue_depth == 0 and engine.active_slots == 0


def test_a_runner_failure_fails_only_the_requests_in_that_call(
    engine_factory: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    runner = GatedRunner(max_slots=2)
    engine = engine_factory(runner)
    in_batch, queued = Collector(), Collector()
    engine.submit([src(1)], DecodeOptions(beam_size=2), in_batch)
    engine.submit([src(2)], DecodeOptions(beam_size=2), queued)  # waits: no free slot
    runner.open(1)
    _wait_until(lambda: runner.step_calls >= 1)
    runner.fail_on_step = runner.step_calls
    runner.open()
    failed = in_batch.wait()
    assert failed == RequestFailed(FailureReason.INTERNAL, "internal error while translating")
    assert "injected" not in failed.message and "InjectedFailure" in caplog.text  # logged, never leaked
    assert queued.wait() == RequestDone()
    assert queued.hypotheses() == {0: expected(src(2), DecodeOptions(beam_size=2))}


def test_a_submission_the_scheduler_refuses_fails_with_its_inbox_mates_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in `Scheduler.add` (validate passed, add did not) must answer every submission taken
    from the inbox with it, not only those the scheduler already held."""
    engine = Engine(FakeRunner(max_slots=2), EngineLimits(max_slots=2))
    real_add = engine._scheduler.add

    def add_refusing_once(*args: object, **kwargs: object) -> None:
        monkeypatch.setattr(engine._scheduler, "add", real_add)
        raise ValueError("bug")

    monkeypatch.setattr(engine._scheduler, "add", add_refusing_once)
    first, second, later = Collector(), Collector(), Collector()
    engine.submit([src(1)], DecodeOptions(beam_size=1), first)
    engine.submit([src(2)], DecodeOptions(beam_size=1), second)  # same inbox: taken in one iteration
    engine.start()
    try:
        internal = RequestFailed(FailureReason.INTERNAL, "internal error while translating")
        assert first.wait() == internal and second.wait() == internal
        engine.submit([src(3)], DecodeOptions(beam_size=1), later)
        assert later.wait() == RequestDone(), "the loop survives"
    finally:
        engine.stop()


class ShortRowsRunner(FakeRunner):
    """Returns one candidate per row too few: a runtime bug the engine must not pass to the beams."""

    def step(
        self, slots: list[int], tokens: list[int], positions: list[int], row_scores: list[float], k: int,
        bias: RowBias | None = None,
    ) -> Candidates:  # fmt: skip
        ranked = super().step(slots, tokens, positions, row_scores, k, bias)
        return Candidates(ranked.scores[:, :-1], ranked.ids[:, :-1])


def test_malformed_runner_output_fails_the_batch(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory(ShortRowsRunner(max_slots=2))
    collector = Collector()
    engine.submit([src(20)], DecodeOptions(beam_size=1), collector)
    assert collector.wait() == RequestFailed(FailureReason.INTERNAL, "internal error while translating")


def test_a_bug_in_an_iteration_fails_in_flight_requests_and_the_loop_survives(
    engine_factory: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_factory(FakeRunner(max_slots=2))
    real_update = engine._scheduler.update

    def broken_update(*args: object) -> None:
        monkeypatch.setattr(engine._scheduler, "update", real_update)  # only the first call breaks
        raise KeyError("bug")

    monkeypatch.setattr(engine._scheduler, "update", broken_update)
    first, second = Collector(), Collector()
    engine.submit([src(21)], DecodeOptions(beam_size=1), first)
    assert first.wait() == RequestFailed(FailureReason.INTERNAL, "internal error while translating")
    engine.submit([src(22)], DecodeOptions(beam_size=1), second)
    assert second.wait() == RequestDone()
    _wait_until(lambda: engine.active_slots == 0)


class OutOfVocabularySecondRow(FakeRunner):
    """A runner bug: the second row of a step gets a candidate id outside the vocabulary."""

    def step(
        self, slots: list[int], tokens: list[int], positions: list[int], row_scores: list[float], k: int,
        bias: RowBias | None = None,
    ) -> Candidates:  # fmt: skip
        candidates = super().step(slots, tokens, positions, row_scores, k, bias)
        ids = candidates.ids.copy()
        if len(slots) > 1:
            ids[1, 0] = self.spec.vocab_size + 5
        return Candidates(candidates.scores, ids, candidates.bias_scores)


def test_bad_candidates_for_one_request_fail_it_alone_and_its_batch_mate_finishes() -> None:
    """The scheduler retires a finished request inside `update`; a bad row later in that update fails only
    the request whose row it is, and the finished one keeps its answer."""
    engine = Engine(OutOfVocabularySecondRow(max_slots=4), EngineLimits(max_slots=4))
    done_first, failing = Collector(), Collector()
    engine.submit([src(30)], DecodeOptions(beam_size=1, max_output_len=1), done_first)  # finishes at step 1
    engine.submit([src(31)], DecodeOptions(beam_size=1), failing)  # both in the loop's first step
    engine.start()
    try:
        assert failing.wait() == RequestFailed(FailureReason.INTERNAL, "internal error while translating")
        assert done_first.wait() == RequestDone()
        assert done_first.hypotheses() == {0: expected(src(30), DecodeOptions(beam_size=1, max_output_len=1))}
        assert engine.drain(timeout=WAIT_S) and not engine._owners.request_ids()
    finally:
        engine.stop()


def test_cancel_while_decoding_frees_the_slots(engine_factory: Callable[..., Engine]) -> None:
    runner = GatedRunner(max_slots=4)
    engine = engine_factory(runner)
    collector = Collector()
    handle = engine.submit([src(3)], DecodeOptions(beam_size=4), collector)
    runner.open(1)
    _wait_until(lambda: engine.active_slots == 4)  # published once the first step is done; the second waits
    assert runner.step_calls == 1
    handle.cancel()
    runner.open()
    assert collector.wait() == RequestFailed(FailureReason.CANCELLED, "the request was cancelled")
    assert not any(isinstance(e, SentenceDone) for e in collector.events)
    _wait_until(lambda: engine.active_slots == 0)


def test_a_cancel_at_the_deadline_fails_as_deadline_exceeded(engine_factory: Callable[..., Engine]) -> None:
    """The servicer cancels with `deadline_passed=True` when grpc ended the call at its deadline."""
    runner = GatedRunner(max_slots=1)
    engine = engine_factory(runner)
    collector = Collector()
    handle = engine.submit([src(3)], DecodeOptions(beam_size=1), collector, deadline=time.monotonic() + 3600)
    handle.cancel(deadline_passed=True)
    runner.open()
    assert collector.wait() == RequestFailed(
        FailureReason.DEADLINE_EXCEEDED, "the deadline passed before the translation finished"
    )


def test_deadline_while_queued(engine_factory: Callable[..., Engine]) -> None:
    """A request whose deadline passes while it waits for a slot fails `DEADLINE_EXCEEDED` and is never
    encoded. The gate holds the only slot's sentence mid-step while the second one's deadline passes.
    Broken once on purpose (`_expire` passing over requests that still have a queued sentence), the late
    sentence was encoded into the freed slot before it failed: the reason alone could not tell."""
    runner = GatedRunner(max_slots=1)
    engine = engine_factory(runner)
    first, late = Collector(), Collector()
    engine.submit([src(4)], DecodeOptions(beam_size=1), first)
    assert runner.entered.wait(WAIT_S)  # the first sentence holds the only slot
    deadline = time.monotonic() + 0.05
    engine.submit([src(5)], DecodeOptions(beam_size=1), late, deadline=deadline)
    while time.monotonic() <= deadline:  # the deadline passing is the subject: wait for it on the same clock
        time.sleep(0.01)
    runner.open()
    assert late.wait() == RequestFailed(
        FailureReason.DEADLINE_EXCEEDED, "the deadline passed before the translation finished"
    )
    assert first.wait() == RequestDone()
    encoded = [item.source_ids for call in runner.encode_calls for item in call]
    assert encoded == [src(4)], "the expired sentence never reached the runner"
    assert engine.queue_depth == 0 and engine.active_slots == 0


def test_queue_full_enqueues_nothing(engine_factory: Callable[..., Engine]) -> None:
    runner = GatedRunner(max_slots=1)
    engine = engine_factory(runner, max_queue_sentences=2)
    engine.submit([src(6), src(7)], DecodeOptions(beam_size=1), Collector())
    with pytest.raises(QueueFullError):
        engine.submit([src(8), src(9)], DecodeOptions(beam_size=1), Collector())
    assert engine.queue_depth in (1, 2)  # both waiting, or one already given the slot; the refused ones add none


def test_admission_holds_queue_places_and_refuses_what_they_cannot_take(engine_factory: Callable[..., Engine]) -> None:
    runner = GatedRunner(max_slots=1)
    engine = engine_factory(runner, max_queue_sentences=4)
    greedy = DecodeOptions(beam_size=1)
    with engine.admission(3) as first:
        with pytest.raises(QueueFullError), engine.admission(2):  # 3 of 4 places held: refused before any work
            pass
        with engine.admission(1) as second, pytest.raises(QueueFullError):  # needing more than it held, a call
            engine.submit([src(1), src(2)], greedy, Collector(), admitted=second)  # counts the others' places
        engine.submit([src(3), src(4), src(5)], greedy, Collector(), admitted=first)  # its own places are free to it
        assert (first.sentences, engine.queue_depth) == (0, 3)
    # The second call left without submitting: its place is free again, and then taken.
    with engine.admission(1), pytest.raises(QueueFullError), engine.admission(1):
        pass
    runner.open()


def test_drain_finishes_in_flight_work_and_refuses_new(engine_factory: Callable[..., Engine]) -> None:
    runner = FakeRunner(max_slots=4)
    engine = engine_factory(runner)
    collectors = [Collector() for _ in range(5)]
    for i, collector in enumerate(collectors):
        engine.submit([src(10 + i)], DecodeOptions(beam_size=2), collector)
    assert engine.drain(timeout=WAIT_S)
    with pytest.raises(DrainingError):
        engine.submit([src(1)], DecodeOptions(), Collector())
    assert all(c.wait() == RequestDone() for c in collectors)


def test_drain_times_out_and_stop_fails_the_rest_unavailable(engine_factory: Callable[..., Engine]) -> None:
    runner = GatedRunner(max_slots=2)
    engine = engine_factory(runner)
    collector = Collector()
    engine.submit([src(11)], DecodeOptions(beam_size=2), collector)
    assert not engine.drain(timeout=0.05)  # the first step is held at the gate

    def open_once_stopping() -> None:  # once stop() has told the loop to end, the held step returns: no second starts
        _wait_until(lambda: engine._stopping)
        runner.open(1)

    opener = threading.Thread(target=open_once_stopping)
    opener.start()
    engine.stop()
    opener.join()
    assert collector.wait() == RequestFailed(FailureReason.UNAVAILABLE, SHUTDOWN_MESSAGE)
    assert runner.step_calls == 1


def test_idle_engine_sleeps_and_wakes_on_submit(engine_factory: Callable[..., Engine]) -> None:
    """With no work the loop waits on its condition and runs no iteration; a submit wakes it, and once the
    work is done it waits again. Broken once on purpose (the wait's predicate always true: a loop spinning
    through empty iterations), the thread never waited on the condition and the wait below timed out."""
    runner = FakeRunner(max_slots=2)
    engine = engine_factory(runner)
    iterations = 0
    step = engine.step

    def counted_step() -> None:
        nonlocal iterations
        iterations += 1
        step()

    engine.step = counted_step  # type: ignore[method-assign]
    _wait_until(lambda: _loop_waits(engine))
    assert (iterations, runner.step_calls) == (0, 0)  # no work, no iteration
    collector = Collector()
    engine.submit([src(12)], DecodeOptions(beam_size=1), collector)
    assert collector.wait() == RequestDone()
    _wait_until(lambda: _loop_waits(engine))
    assert iterations == runner.step_calls > 0  # one iteration per decoder step, none while idle


def _loop_waits(engine: Engine) -> bool:
    """The engine's thread is blocked in its condition's wait (CPython's Condition keeps its waiters)."""
    with engine._cond:
        return len(engine._cond._waiters) == 1  # type: ignore[attr-defined]


def test_warmup_runs_real_steps_and_stays_out_of_the_metrics(engine_factory: Callable[..., Engine]) -> None:
    registry = CollectorRegistry()
    runner = FakeRunner(max_slots=4)
    engine = engine_factory(runner, Metrics(registry).for_model("tiny"))
    engine.warmup()
    assert runner.step_calls >= 1
    for series in ("translation_decode_step_duration_seconds", "translation_encode_duration_seconds"):
        assert sample_value(registry, f"{series}_count") == 0, series
    assert sample_value(registry, "translation_queue_wait_seconds_count") == 0
    assert sample_value(registry, "translation_sentences_total", lang_pair="de-en") == 0
    warm_steps = runner.step_calls
    collector = Collector()
    engine.submit([src(12)], DecodeOptions(beam_size=1), collector)  # traffic after it is observed
    assert collector.wait() == RequestDone()
    steps = sample_value(registry, "translation_decode_step_duration_seconds_count")
    assert steps == runner.step_calls - warm_steps > 0
    assert sample_value(registry, "translation_queue_wait_seconds_count") == 1


def test_a_stalled_runner_call_is_abandoned_and_its_thread_leaves_quietly_if_it_returns(
    engine_factory: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    runner = GatedRunner(max_slots=2)
    engine = engine_factory(runner)
    assert engine.abandon_if_stalled(0.0, time.monotonic() + 100) is None  # idle: no runner call
    decoding, queued = Collector(), Collector()
    engine.submit([src(15)], DecodeOptions(beam_size=2), decoding)
    assert runner.entered.wait(WAIT_S)  # inside the gated step now
    engine.submit([src(16)], DecodeOptions(beam_size=1), queued)
    assert engine.abandon_if_stalled(100.0, time.monotonic()) is None  # not long enough yet
    stalled = engine.abandon_if_stalled(100.0, time.monotonic() + 200)
    assert stalled is not None and stalled > 100
    unavailable = RequestFailed(FailureReason.UNAVAILABLE, ENGINE_FAILED_MESSAGE)
    assert decoding.wait() == unavailable and queued.wait() == unavailable
    assert engine.failed and engine.abandon_if_stalled(0.0, time.monotonic() + 200) is None  # once only
    with pytest.raises(EngineFailedError):
        engine.submit([src(17)], DecodeOptions(beam_size=1), Collector())
    engine.stop()  # must not join the stuck thread: it returns while the thread still waits at the gate
    thread = engine._thread
    assert thread is not None and thread.is_alive()
    runner.open()  # the call returns: the thread must leave without delivering or publishing
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert engine.queue_depth == 0 and engine.active_slots == 0
    assert len(decoding.events) == 1 and len(queued.events) == 1, "nothing delivered after the abandonment"
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text


def test_stop_with_a_timeout_abandons_a_runner_call_that_outlasts_it(engine_factory: Callable[..., Engine]) -> None:
    runner = GatedRunner(max_slots=2)
    engine = engine_factory(runner)
    collector = Collector()
    engine.submit([src(18)], DecodeOptions(beam_size=1), collector)
    assert runner.entered.wait(WAIT_S)
    started = time.monotonic()
    engine.stop(join_timeout_s=0.2)
    assert time.monotonic() - started >= 0.2  # it waited its timeout for the thread ...
    assert engine._thread is not None and engine._thread.is_alive()  # ... and returned with the call still stuck
    assert collector.wait() == RequestFailed(FailureReason.UNAVAILABLE, ENGINE_FAILED_MESSAGE)
    runner.open()


def test_a_raising_callback_does_not_stop_the_engine(engine_factory: Callable[..., Engine]) -> None:
    engine = engine_factory(FakeRunner(max_slots=2))

    def bad(event: Event) -> None:
        raise ValueError("client bug")

    engine.submit([src(13)], DecodeOptions(beam_size=1), bad)
    collector = Collector()
    engine.submit([src(14)], DecodeOptions(beam_size=1), collector)
    assert collector.wait() == RequestDone()


def test_stress_every_request_ends_exactly_once_and_nothing_is_left(engine_factory: Callable[..., Engine]) -> None:
    """Threads submit, cancel and let deadlines lapse at random: each request gets one final event,
    finished ones are exact, and the engine ends with an empty queue and all slots free."""
    runner = FakeRunner(max_slots=6)
    engine = engine_factory(runner, max_queue_sentences=60)
    outcomes: list[tuple[list[list[int]], DecodeOptions, Collector]] = []
    refused = 0
    lock = threading.Lock()

    def client(worker: int) -> None:
        nonlocal refused
        rng = np.random.default_rng(worker)
        for n in range(25):
            options = DecodeOptions(beam_size=int(rng.integers(1, 5)), stream_tokens=bool(rng.integers(2)))
            sentences = [src(1000 * worker + 10 * n + i) for i in range(int(rng.integers(1, 4)))]
            deadline = time.monotonic() + float(rng.uniform(0.0, 0.05)) if rng.random() < 0.2 else None
            collector = Collector()
            try:
                handle = engine.submit(sentences, options, collector, deadline=deadline)
            except QueueFullError:
                with lock:
                    refused += 1
                continue
            if rng.random() < 0.2:
                time.sleep(float(rng.uniform(0.0, 0.01)))
                handle.cancel()
            with lock:
                outcomes.append((sentences, options, collector))

    threads = [threading.Thread(target=client, args=(w,)) for w in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    codes: dict[str, int] = {}
    for sentences, options, collector in outcomes:
        final = collector.wait()
        assert sum(isinstance(e, RequestDone | RequestFailed) for e in collector.events) == 1
        if isinstance(final, RequestDone):
            assert collector.hypotheses() == {i: expected(s, options) for i, s in enumerate(sentences)}
            codes["OK"] = codes.get("OK", 0) + 1
        else:
            assert isinstance(final, RequestFailed) and final.reason in {
                FailureReason.CANCELLED,
                FailureReason.DEADLINE_EXCEEDED,
            }
            codes[final.reason.name] = codes.get(final.reason.name, 0) + 1
    assert len(outcomes) + refused == 150 and codes.get("OK", 0) > 0
    _wait_until(lambda: engine.queue_depth == 0 and engine.active_slots == 0)


def _wait_until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


# ------------------------------------------------------------------ the real onnxruntime runner


@pytest.fixture(scope="module")
def exported_tiny(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model exported to fp32 ONNX; returns the variant dir."""
    import shutil

    model_dir = tmp_path_factory.mktemp("engine_model")
    shutil.copytree(tiny_model_dir, model_dir, dirs_exist_ok=True)
    cmd = [sys.executable, "-m", "export", "--model-dir", str(model_dir), "--variants", "fp32"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return model_dir / "onnx" / "fp32"


def test_engine_equals_offline_decoding_on_the_onnx_runner(exported_tiny: Path) -> None:
    from server.backend.working_batch import WorkingBatchRunner
    from server.core.offline import translate_ids

    runner = WorkingBatchRunner(exported_tiny, max_slots=6, intra_op_threads=1)
    spec = runner.spec
    rng = np.random.default_rng(0)
    jobs = []
    for n in range(10):
        length = int(rng.integers(1, 12))
        ids = [spec.tag_ids["en" if n % 2 else "de"], *rng.integers(6, spec.vocab_size, length).tolist(), spec.eos_id]
        beam_size = 1 + n % 4
        jobs.append(([ids], DecodeOptions(beam_size=beam_size, max_output_len=10, num_hypotheses=min(beam_size, 2))))
    engine = Engine(runner, EngineLimits(max_slots=6))
    engine.start()
    try:
        collectors = [Collector() for _ in jobs]
        for (sentences, options), collector in zip(jobs, collectors, strict=True):
            engine.submit(sentences, options, collector)
        results = [(c.wait(), c.hypotheses()) for c in collectors]
    finally:
        engine.stop()
    alone = WorkingBatchRunner(exported_tiny, max_slots=4, intra_op_threads=1)
    for (sentences, options), (final, got) in zip(jobs, results, strict=True):
        assert final == RequestDone()
        want = translate_ids(
            alone, sentences, options.beam_size, options.length_penalty, options.max_output_len, options.num_hypotheses
        )
        best = want[0]
        assert [tokens for tokens, _ in got[0]] == [h.tokens for h in best]
        assert [score for _, score in got[0]] == pytest.approx([h.score for h in best], abs=1e-4)
