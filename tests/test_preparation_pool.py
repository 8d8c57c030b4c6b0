"""Long calls' preparation (server/edge/preparation_pool.py through PreparationLane): stopped at a checkpoint once
the call's deadline passes or it is cancelled, and in turns, so no call holds the workers from the others."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import Counter
from functools import partial
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from server.core.events import QueueFullError
from server.edge import preparation, preparation_pool
from server.edge.errors import status_for
from server.edge.metrics import Metrics
from server.edge.preparation import INLINE_PREPARE_CHARS, PreparationLane
from server.edge.preparation_pool import MIN_TURN_S, CallToken, PreparationPool, Turns
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


class Handing(queue.SimpleQueue):  # type: ignore[type-arg]
    """The pool's queue of calls for its threads, which records each call handed to a thread (each wakes one)."""

    def __init__(self) -> None:
        self.handed = 0

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self.handed += item is not None  # None: a thread's stop
        super().put(item, block, timeout)


class FakeClock:
    """The pool's `time`: it stands still unless a test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def _until_waiting(turns: Turns, count: int) -> None:
    while turns.waiting() < count:  # a thread on its way to wait for its turn
        time.sleep(0.001)


@pytest.mark.parametrize("refused", [False, True])
def test_long_calls_admitted_during_a_burst_wake_no_thread_before_their_turn(
    monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    """The pool is paused while calls arrive; a thread woken for one of its calls then takes the GIL from the event
    loop only to wait (news-length calls in `bench.burst`: a thread woken per admitted call, mid-burst)."""
    monkeypatch.setattr(preparation, "MAX_DEFERRAL_S", 60.0)  # no flood guard: the lull alone decides
    monkeypatch.setattr(preparation, "REFUSING_MAX_DEFERRAL_S", 60.0)
    monkeypatch.setattr(preparation, "REFUSING_FOR_S", 60.0)
    pool = PreparationPool()
    pool._tasks = tasks = Handing()

    async def burst() -> tuple[int, list[int]]:
        lane = PreparationLane(pool)
        admitted = []
        for turn in range(2_000):
            with contextlib.suppress(QueueFullError), lane.arrival():
                if refused:
                    raise QueueFullError("queue is full")
            if turn % 400 == 0:
                admitted.append(asyncio.ensure_future(lane.prepare(partial(int, turn), chars=LONG)))
            await asyncio.sleep(0)
        handed_during_burst = tasks.handed
        return handed_during_burst, await asyncio.wait_for(asyncio.gather(*admitted), timeout=60)

    handed_during_burst, prepared = asyncio.run(burst())
    assert handed_during_burst == 0, "a thread was woken for a call while calls kept arriving"
    assert prepared == [0, 400, 800, 1200, 1600] and tasks.handed == 5


def test_a_call_gets_a_thread_only_at_its_first_turn_and_never_once_withdrawn() -> None:
    turns = Turns(1, threads=2)
    handed: list[int] = []
    tokens = [CallToken(None) for _ in range(4)]
    for index, token in enumerate(tokens):
        token.start = partial(handed.append, index)
    turns.pause()
    for token in tokens:
        turns.enter(token)
    assert handed == [], "a paused pool hands no call to a thread"
    turns.withdraw(tokens[0])  # its call was cancelled while it waited
    turns.resume()
    assert handed == [1], "only the call whose turn it is"
    turns.take(tokens[1])  # its thread, here
    turns.give()  # the call's work is done
    assert handed == [1, 2]
    turns.take(tokens[2])
    turns.give()
    assert handed == [1, 2], "both threads hold a call: the next one waits for one to be free"
    turns.leave(tokens[1])
    assert handed == [1, 2, 3]


def test_a_running_call_keeps_its_turn_at_checkpoints_for_a_minimum_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn handed on at every checkpoint passes the GIL between the pool's threads, a thread woken at each."""
    clock = FakeClock()
    monkeypatch.setattr(preparation_pool, "time", clock)
    turns, order = Turns(1), []
    running, waiting = CallToken(None), CallToken(None)
    turns.take(running)

    def other() -> None:
        turns.take(waiting)
        order.append("other")
        turns.give()

    thread = threading.Thread(target=other)
    thread.start()
    _until_waiting(turns, 1)
    clock.now = MIN_TURN_S / 2
    turns.checkpoint(running)
    assert order == [], "the running call kept its turn"
    clock.now = MIN_TURN_S
    turns.checkpoint(running)  # gives its turn, and takes it back once the other call is done
    thread.join(timeout=30)
    assert order == ["other"]


def test_a_slice_ends_at_its_time_without_waiting_for_the_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """The event loop, busy with a burst, pauses the pool late; the running call stops at its slice's end anyway."""
    clock = FakeClock()
    monkeypatch.setattr(preparation_pool, "time", clock)
    turns, steps = Turns(1), []
    token = CallToken(None)
    turns.resume(for_s=0.005)
    turns.take(token)

    def work() -> None:
        for step in range(3):
            turns.checkpoint(token)
            steps.append(step)
            clock.now += 0.003
        turns.give()

    thread = threading.Thread(target=work)
    thread.start()
    _until_waiting(turns, 1)
    assert steps == [0, 1], "stopped at its first checkpoint past the slice's end"
    turns.resume()
    thread.join(timeout=30)
    assert steps == [0, 1, 2]


def test_more_calls_than_threads_all_run_and_a_cancelled_one_never_does() -> None:
    ran: list[int] = []

    def work(index: int) -> int:
        for _ in range(3):
            checkpoint()
        ran.append(index)
        return index

    async def crowded() -> list[int]:
        pool = PreparationPool(threads=2)
        pool.pause()
        calls = [asyncio.ensure_future(pool.run(partial(work, index), None)) for index in range(6)]
        await asyncio.sleep(0)
        calls[3].cancel()
        await asyncio.sleep(0)
        pool.resume()
        done = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=60)
        pool.shutdown()
        return [result for result in done if isinstance(result, int)]

    assert asyncio.run(crowded()) == [0, 1, 2, 4, 5]
    assert sorted(ran) == [0, 1, 2, 4, 5]


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
