"""Long calls' preparation (server/edge/preparation_pool.py through PreparationLane): stopped at a checkpoint once
the call's deadline passes or it is cancelled, and in turns, so no call holds the workers from the others."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
from prometheus_client import CollectorRegistry

from server.core.checkpoints import CallEnded, checkpoint
from server.edge.errors import status_for
from server.edge.metrics import Metrics
from server.edge.preparation import INLINE_PREPARE_CHARS, PreparationLane
from server.edge.request_parts import _detect_all
from server.edge.servicer import _timed_preparation

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


class CountingDetector:
    loaded = True

    def __init__(self) -> None:
        self.read = 0

    def detect(self, text: str) -> None:
        self.read += 1


def test_detection_stops_at_a_checkpoint_between_texts() -> None:
    from server.core.checkpoints import checkpoints

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
