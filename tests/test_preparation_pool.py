"""Long calls' preparation (server/edge/preparation_pool.py through PreparationLane): stopped at a checkpoint once
the call's deadline passes or it is cancelled, and in turns, so no call holds the workers from the others."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter

import grpc
import pytest
from prometheus_client import CollectorRegistry

from server.core.events import QueueFullError
from server.edge import preparation
from server.edge.errors import status_for
from server.edge.metrics import Metrics
from server.edge.preparation import INLINE_PREPARE_CHARS, PreparationLane
from server.edge.preparation_pool import CallToken, Turns
from server.edge.request_parts import _detect_all
from server.edge.servicer import _timed_preparation
from server.text.checkpoints import CallEnded, checkpoint

LONG = INLINE_PREPARE_CHARS + 1  # prepared in the pool


def test_a_call_whose_deadline_has_passed_stops_at_its_first_checkpoint() -> None:
    steps: list[int] = []

    def work() -> None:
        for step in range(1000):
            checkpoint()
            steps.append(step)

    async def late() -> BaseException | None:
        lane = PreparationLane()
        try:
            await lane.prepare(work, chars=LONG, deadline=time.monotonic() - 1.0)
        except CallEnded as err:
            return err
        return None

    error = asyncio.run(late())
    assert isinstance(error, CallEnded) and error.deadline_passed
    assert steps == []
    assert status_for(error)[0] == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_cancelled_call_stops_its_work_at_the_next_checkpoint() -> None:
    steps: list[int] = []
    at_three, release, stopped = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        try:
            for step in range(1000):
                checkpoint()
                steps.append(step)
                if step == 3:
                    at_three.set()
                    release.wait(timeout=30)
        finally:
            stopped.set()

    async def cancelled() -> None:
        task = asyncio.ensure_future(PreparationLane().prepare(work, chars=LONG))
        await asyncio.to_thread(at_three.wait, 30)
        task.cancel()  # the client went away, or grpc ended the call at its deadline
        await asyncio.gather(task, return_exceptions=True)
        release.set()
        await asyncio.to_thread(stopped.wait, 30)

    asyncio.run(cancelled())
    assert steps == [0, 1, 2, 3]


def test_long_calls_take_turns_so_a_later_call_runs_while_they_still_go_on() -> None:
    """More endless calls than a default thread pool has workers: a later call still gets its turn."""
    stop = threading.Event()

    def endless() -> None:
        while not stop.is_set():
            checkpoint()
            time.sleep(0.001)

    async def crowded() -> str:
        lane = PreparationLane()
        hogs = [asyncio.ensure_future(lane.prepare(endless, chars=LONG)) for _ in range(40)]
        try:
            return await asyncio.wait_for(lane.prepare(lambda: "mine", chars=LONG), timeout=60)
        finally:
            stop.set()
            await asyncio.gather(*hogs, return_exceptions=True)

    assert asyncio.run(crowded()) == "mine"


@pytest.mark.parametrize("refused", [False, True])
def test_a_long_call_is_prepared_only_once_calls_stop_arriving(monkeypatch: pytest.MonkeyPatch, refused: bool) -> None:
    """A pool thread holding the GIL delays every call the loop has not answered yet, as preparing on the loop
    would (news-length calls in `bench.burst`: refusals 0.5-0.8 s after the floor): the pool waits for the
    lane's lull too."""
    monkeypatch.setattr(preparation, "MAX_DEFERRAL_S", 60.0)  # no flood guard: the lull alone decides
    monkeypatch.setattr(preparation, "REFUSING_MAX_DEFERRAL_S", 60.0)
    monkeypatch.setattr(preparation, "REFUSING_FOR_S", 60.0)
    log: list[str] = []
    began = threading.Event()

    def work() -> str:
        began.set()
        for _ in range(3):
            checkpoint()
            log.append("prepare")
        return "done"

    async def burst() -> tuple[bool, str]:
        lane = PreparationLane()
        admitted = asyncio.ensure_future(lane.prepare(work, chars=LONG))
        for _ in range(20_000):  # until the thread would long have run, had it not waited
            with contextlib.suppress(QueueFullError), lane.arrival():
                if refused:
                    raise QueueFullError("queue is full")
            log.append("arrive")
            await asyncio.sleep(0)
        began_during_burst = began.is_set()
        return began_during_burst, await asyncio.wait_for(admitted, timeout=60)

    began_during_burst, result = asyncio.run(burst())
    assert not began_during_burst, "the pool ran while calls kept arriving"
    assert result == "done" and log[20_000:] == ["prepare"] * 3


def test_a_call_waiting_for_its_turn_is_woken_only_when_it_may_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each thread woken for nothing takes the GIL from the event loop: with 128 waiting, a turn handed on
    woke them all."""
    looks: Counter[int] = Counter()
    check = CallToken.check

    def counted(token: CallToken) -> None:
        looks[id(token)] += 1
        check(token)

    monkeypatch.setattr(CallToken, "check", counted)
    turns, order = Turns(1), []
    running = CallToken(None)
    turns.take(running)
    tokens = [CallToken(None) for _ in range(5)]

    def one(index: int) -> None:
        turns.take(tokens[index])
        order.append(index)
        turns.give()

    threads = [threading.Thread(target=one, args=(index,)) for index in range(len(tokens))]
    for count, thread in enumerate(threads, start=1):
        thread.start()
        while turns.waiting() < count:  # in arrival order
            time.sleep(0.001)
    turns.pause()
    turns.give()  # paused: nobody may run, nobody is woken
    turns.resume()
    for thread in threads:
        thread.join(timeout=30)
    assert order == [0, 1, 2, 3, 4]
    assert [looks[id(token)] for token in tokens] == [1] * 5, "each looked once as it came, then ran when woken"


class CountingDetector:
    loaded = True

    def __init__(self) -> None:
        self.read = 0

    def detect(self, text: str) -> None:
        self.read += 1


def test_detection_stops_at_a_checkpoint_between_texts() -> None:
    from server.text.checkpoints import checkpoints

    detector, passed = CountingDetector(), 0

    def ended_after_two() -> None:
        nonlocal passed
        passed += 1
        if passed > 2:
            raise CallEnded(deadline_passed=False)

    try:
        with checkpoints(ended_after_two):
            _detect_all(detector, lambda: ["Hallo Welt"] * 100)  # type: ignore[arg-type]
    except CallEnded as err:
        assert status_for(err)[0] == grpc.StatusCode.CANCELLED
    assert detector.read == 2


def test_preparation_time_is_observed_by_outcome() -> None:
    metrics = Metrics(CollectorRegistry())
    with _timed_preparation(metrics, "m"):
        pass
    for error in (CallEnded(deadline_passed=True), ValueError("over a limit")):
        try:
            with _timed_preparation(metrics, "m"):
                raise error
        except (CallEnded, ValueError):
            pass

    def count(outcome: str) -> float | None:
        labels = {"model": "m", "outcome": outcome}
        return metrics.registry.get_sample_value("translation_preparation_seconds_count", labels)

    assert (count("done"), count("ended"), count("failed")) == (1.0, 1.0, 1.0)
