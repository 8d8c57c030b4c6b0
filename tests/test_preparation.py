"""Admission sizing and the preparation lane (server/edge/admission.py, server/edge/preparation.py), on a bare
event loop: a burst's admissions and refusals all come before any of its calls is split and tokenized."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from functools import partial

import pytest

from server.core.events import QueueFullError
from server.core.splitter import split
from server.edge import preparation
from server.edge.admission import counted_sentences, sentences_to_hold
from server.edge.preparation import PreparationLane

Log = list[tuple[str, int]]  # ("arrive" or "prepare", index) in the order they happened


def recording(log: Log, index: int) -> Callable[[], int]:
    def work() -> int:
        log.append(("prepare", index))
        return index

    return work


def arrive(lane: PreparationLane, refused: bool = False) -> None:
    """A call reaches the servicer; `refused`: the queue refuses it."""
    with contextlib.suppress(QueueFullError), lane.arrival():
        if refused:
            raise QueueFullError("queue is full")


async def arrivals(lane: PreparationLane, log: Log, turns: int, refused: bool = False) -> None:
    """A call reaches the servicer in each of `turns` turns of the loop, as in a burst."""
    for index in range(turns):
        arrive(lane, refused)
        log.append(("arrive", index))
        await asyncio.sleep(0)


def test_nothing_is_prepared_while_calls_keep_arriving_and_then_all_in_admission_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(preparation, "MAX_DEFERRAL_S", 60.0)  # no flood guard: the lull alone decides

    async def burst() -> tuple[list[tuple[str, int]], list[int]]:
        lane, log = PreparationLane(), Log()
        admitted = [asyncio.ensure_future(lane.prepare(recording(log, i), chars=20)) for i in range(3)]
        await arrivals(lane, log, 200)
        return log, list(await asyncio.gather(*admitted))

    log, results = asyncio.run(burst())
    assert results == [0, 1, 2]
    assert log[200:] == [("prepare", 0), ("prepare", 1), ("prepare", 2)], "after the last arrival, in order"


def test_calls_tens_of_turns_apart_as_a_burst_begins_are_no_lull(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a burst's start its calls reach the servicer tens of turns of the loop apart: preparing between
    them would hand the engines work that decodes beside the burst's refusals."""
    monkeypatch.setattr(preparation, "MAX_DEFERRAL_S", 60.0)
    monkeypatch.setattr(preparation, "QUIET_INTERVAL_S", 0.2)  # turns decide here, not a loaded machine's timers

    async def ramp() -> Log:
        lane, log = PreparationLane(), Log()
        admitted = asyncio.ensure_future(lane.prepare(recording(log, 0), chars=20))
        for index in range(10):
            arrive(lane)
            log.append(("arrive", index))
            for _ in range(20):
                await asyncio.sleep(0)
        await admitted
        return log

    log = asyncio.run(ramp())
    assert log.index(("prepare", 0)) == 10, "prepared after the calls, not between them"


def test_under_an_endless_flood_one_call_is_prepared_per_deferral(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preparation, "MAX_DEFERRAL_S", 0.02)

    async def flood() -> list[float]:
        lane, log, times = PreparationLane(), Log(), []

        def work() -> None:  # longer than a slice: one call per deferral
            times.append(time.monotonic())
            time.sleep(preparation.PREPARE_SLICE_S)

        admitted = [asyncio.ensure_future(lane.prepare(work, chars=20)) for _ in range(3)]
        arriving = asyncio.ensure_future(arrivals(lane, log, 10**9))
        await asyncio.gather(*admitted)
        arriving.cancel()
        return times

    times = asyncio.run(flood())
    assert len(times) == 3 and all(b - a >= 0.02 for a, b in itertools.pairwise(times))


def test_while_the_queue_refuses_the_lane_waits_on_a_timer_instead_of_turning_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loop turned without pause through a burst takes a core from gRPC's threads reading the calls
    (refusals waited 60-100 ms longer in `bench.burst`): the loop idles between arrivals."""
    monkeypatch.setattr(preparation, "REFUSING_MAX_DEFERRAL_S", 60.0)
    monkeypatch.setattr(preparation, "REFUSING_FOR_S", 60.0)  # a loaded machine's timers may space them widely
    monkeypatch.setattr(preparation, "REFUSING_QUIET_INTERVAL_S", 0.05)

    async def spaced_burst() -> tuple[Log, float, float]:
        lane, log = PreparationLane(), Log()
        admitted = asyncio.ensure_future(lane.prepare(recording(log, 0), chars=20))
        wall, cpu = time.monotonic(), time.thread_time()
        for index in range(60):  # refused calls in the next turns of the loop, then one every 5 ms
            arrive(lane, refused=True)
            log.append(("arrive", index))
            await asyncio.sleep(0 if index < 3 else preparation.REFUSING_QUIET_INTERVAL_S / 10)
        cpu, wall = time.thread_time() - cpu, time.monotonic() - wall
        await admitted
        return log, cpu, wall

    log, cpu, wall = asyncio.run(spaced_burst())
    assert log[-1] == ("prepare", 0) and len(log) == 61, "prepared once the calls stopped"
    assert cpu < 0.5 * wall, f"the loop ran {cpu / wall:.0%} of the burst's time: it spun"


@pytest.mark.parametrize("refusing", [False, True])
def test_a_lone_call_is_prepared_at_once_and_one_followed_by_others_waits_for_a_timed_lull(
    monkeypatch: pytest.MonkeyPatch, refusing: bool
) -> None:
    monkeypatch.setattr(preparation, "MAX_DEFERRAL_S", 60.0)
    monkeypatch.setattr(preparation, "REFUSING_MAX_DEFERRAL_S", 60.0)
    monkeypatch.setattr(preparation, "QUIET_INTERVAL_S", 0.3)
    monkeypatch.setattr(preparation, "REFUSING_QUIET_INTERVAL_S", 0.3)

    async def scenario() -> tuple[float, float]:
        lane = PreparationLane()
        started = time.monotonic()
        arrive(lane)
        await asyncio.wait_for(lane.prepare(lambda: None, chars=20), timeout=5)
        lone = time.monotonic() - started
        started = time.monotonic()
        arrive(lane)
        followed = asyncio.ensure_future(lane.prepare(lambda: None, chars=20))
        await arrivals(lane, Log(), 3, refused=refusing)  # more calls, in the next turns of the loop
        await asyncio.wait_for(followed, timeout=5)
        return lone, time.monotonic() - started

    lone, followed = asyncio.run(scenario())
    assert lone < 0.15 <= followed


def test_while_the_queue_refuses_a_pause_shorter_than_its_quiet_interval_is_no_lull(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client's sending pauses for a few milliseconds within a burst: a slice there would put the rest of
    the burst's refusals behind it."""
    monkeypatch.setattr(preparation, "REFUSING_MAX_DEFERRAL_S", 60.0)
    monkeypatch.setattr(preparation, "REFUSING_FOR_S", 60.0)
    monkeypatch.setattr(preparation, "REFUSING_QUIET_INTERVAL_S", 0.2)

    async def paused_burst() -> Log:
        lane, log = PreparationLane(), Log()
        admitted = asyncio.ensure_future(lane.prepare(recording(log, 0), chars=20))
        for index in range(8):  # refused calls 20 ms apart: ten times the lull of a queue that admits
            arrive(lane, refused=True)
            log.append(("arrive", index))
            await asyncio.sleep(0.02)
        await admitted
        return log

    log = asyncio.run(paused_burst())
    assert log[-1] == ("prepare", 0) and len(log) == 9, "prepared once the refused calls stopped"


def test_under_an_endless_flood_of_refusals_a_slice_keeps_its_share_of_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lane waits up to REFUSING_MAX_DEFERRAL_S for a lull, then prepares for PREPARATION_SHARE of that
    wait: admitted calls still move, and each refusal waits behind one slice at most."""
    monkeypatch.setattr(preparation, "REFUSING_MAX_DEFERRAL_S", 0.2)
    monkeypatch.setattr(preparation, "PREPARE_SLICE_S", 0.0)  # the share alone sets the slice

    async def flood() -> tuple[float, list[float]]:
        lane, log, times = PreparationLane(), Log(), []

        def work() -> None:  # 2 ms a call: a slice of a tenth of 0.2 s prepares several
            times.append(time.monotonic())
            time.sleep(0.002)

        arrive(lane, refused=True)
        started = time.monotonic()
        admitted = [asyncio.ensure_future(lane.prepare(work, chars=20)) for _ in range(40)]
        arriving = asyncio.ensure_future(arrivals(lane, log, 10**9, refused=True))
        await asyncio.gather(*admitted)
        arriving.cancel()
        return started, times

    started, times = asyncio.run(flood())
    assert times[0] - started >= 0.2, "nothing prepared before the deferral while calls are refused"
    first_slice = [t for t in times if t - times[0] < 0.02]
    assert len(first_slice) >= 3, f"a slice of a tenth of the wait, not one call: {len(first_slice)} prepared"
    assert all(b - a < 0.2 + 0.1 for a, b in itertools.pairwise(times)), "the lane prepares every deferral"


def test_a_lull_prepares_calls_for_a_slice_of_time_one_at_least(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short calls under steady load take one lull between them, not one each; a long one takes its own."""
    monkeypatch.setattr(preparation, "PREPARE_SLICE_S", 0.05)

    async def scenario() -> list[int]:
        lane, prepared_per_lull = PreparationLane(), []
        runs = lane.prepared

        def work(seconds: float) -> None:
            time.sleep(seconds)

        calls = [0.001] * 5 + [0.2, 0.001]
        admitted = [asyncio.ensure_future(lane.prepare(partial(work, seconds), chars=20)) for seconds in calls]
        while not all(call.done() for call in admitted):
            await asyncio.sleep(0)
            if lane.prepared != runs:
                prepared_per_lull.append(lane.prepared - runs)
                runs = lane.prepared
        return prepared_per_lull

    assert asyncio.run(scenario()) == [6, 1]  # five short ones and the long one, then the last


def test_a_call_that_ends_while_it_waits_is_never_prepared_and_a_failure_reaches_its_own_call() -> None:
    async def scenario() -> tuple[list[tuple[str, int]], BaseException | None]:
        lane, log = PreparationLane(), Log()
        gone = asyncio.ensure_future(lane.prepare(recording(log, 0), chars=20))

        def failing() -> int:
            raise ValueError("over a limit")

        failed = asyncio.ensure_future(lane.prepare(failing, chars=20))
        kept = asyncio.ensure_future(lane.prepare(recording(log, 2), chars=20))
        await asyncio.sleep(0)
        gone.cancel()  # the client went away before its turn
        await kept
        return log, failed.exception()

    log, error = asyncio.run(scenario())
    assert log == [("prepare", 2)]
    assert isinstance(error, ValueError)


def test_a_long_request_is_prepared_in_a_worker_thread_at_once() -> None:
    async def long_one() -> bool:
        lane, loop = PreparationLane(), threading.get_ident()
        return await lane.prepare(lambda: threading.get_ident() != loop, chars=preparation.INLINE_PREPARE_CHARS + 1)

    assert asyncio.run(long_one())


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        ("Das Haus ist groß. Er wartete lange. Sie schrieben ein Buch.", 3),
        ("Titel\nDas Haus ist groß.", 2),
        ('Er sagte: "Nein!" Dann ging er.', 2),
        ("Geheimpolizei", 1),
        ("  ... --- ", 0),
        ("", 0),
    ],
)
def test_admission_counts_sentences_as_the_splitter_finds_them_in_plain_text(text: str, sentences: int) -> None:
    assert counted_sentences(text) == len(split(text, "de").pieces) == sentences


def test_admission_holds_the_counted_sentences_unless_that_is_over_the_request_limit() -> None:
    texts = ["Eins. Zwei. Drei.", "Vier", "..."]
    assert sentences_to_hold(texts, max_sentences=512) == 4
    assert sentences_to_hold(texts, max_sentences=3) == 2  # over: one per text with a letter, the split decides
    assert sentences_to_hold(texts, max_sentences=1) == 0  # even that is over: INVALID_ARGUMENT from the split
