"""Admission sizing and the preparation lane (server/edge/admission.py, server/edge/preparation.py), on a bare
event loop: a burst's admissions and refusals all come before any of its calls is split and tokenized.

The lane's tests run on virtual time (`VirtualClock`): the lane's clock and its loop's timers read one clock, a
timer's wait passes at once and every other turn of the loop takes TURN_S, so what they check is decided by
turns, timers and the work's stated cost, never by how busy the machine is."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import re
import selectors
import threading
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, TypeVar

import pytest

from server.core.events import QueueFullError
from server.edge import preparation
from server.edge.admission import _SENTENCE_END, counted_sentences, sentences_to_hold
from server.edge.preparation import PreparationLane
from server.text.splitter import split

Log = list[tuple[str, int]]  # ("arrive" or "prepare", index) in the order they happened
T = TypeVar("T")
TURN_S = 1e-5  # virtual seconds a turn of the loop takes when it waits for no timer (an idle turn: microseconds)


class VirtualClock:
    """The lane's `time` and its loop's clock: a loop waiting for a timer jumps to it; any other turn takes TURN_S."""

    def __init__(self) -> None:
        self.now = 0.0
        self.turns = 0  # turns of the loop that waited for no timer: a loop that spins counts thousands

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Work on the loop that takes `seconds`."""
        self.now += seconds

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        """`asyncio.run(main)` on this clock."""
        with asyncio.Runner(loop_factory=lambda: _VirtualLoop(self)) as runner:
            return runner.run(main)


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # no timer and nothing ready: only a thread's result can wake the loop
            return super().select(None)
        if timeout > 0:
            self.clock.now += timeout
        else:
            self.clock.now += TURN_S
            self.clock.turns += 1
        return super().select(0)


class _VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(_VirtualSelector(clock))
        self.clock = clock

    def time(self) -> float:
        return self.clock.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    """Virtual time for the lane: run its scenario with `clock.run`."""
    virtual = VirtualClock()
    monkeypatch.setattr(preparation, "time", virtual)
    return virtual


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
    monkeypatch: pytest.MonkeyPatch, clock: VirtualClock
) -> None:
    monkeypatch.setattr(preparation, "MAX_DEFERRAL_S", 60.0)  # no flood guard: the lull alone decides

    async def burst() -> tuple[list[tuple[str, int]], list[int]]:
        lane, log = PreparationLane(), Log()
        admitted = [asyncio.ensure_future(lane.prepare(recording(log, i), chars=20)) for i in range(3)]
        await arrivals(lane, log, 200)
        return log, list(await asyncio.gather(*admitted))

    log, results = clock.run(burst())
    assert results == [0, 1, 2]
    assert log[200:] == [("prepare", 0), ("prepare", 1), ("prepare", 2)], "after the last arrival, in order"


def test_calls_tens_of_turns_apart_as_a_burst_begins_are_no_lull(
    monkeypatch: pytest.MonkeyPatch, clock: VirtualClock
) -> None:
    """At a burst's start its calls reach the servicer tens of turns of the loop apart: preparing between
    them would hand the engines work that decodes beside the burst's refusals."""
    monkeypatch.setattr(preparation, "MAX_DEFERRAL_S", 60.0)
    monkeypatch.setattr(preparation, "QUIET_INTERVAL_S", 0.2)  # turns decide here, not the timer

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

    log = clock.run(ramp())
    assert log.index(("prepare", 0)) == 10, "prepared after the calls, not between them"


def test_under_an_endless_flood_one_call_is_prepared_per_deferral(
    monkeypatch: pytest.MonkeyPatch, clock: VirtualClock
) -> None:
    monkeypatch.setattr(preparation, "MAX_DEFERRAL_S", 0.02)

    async def flood() -> list[float]:
        lane, log, times = PreparationLane(), Log(), []

        def work() -> None:  # longer than a slice: one call per deferral
            times.append(clock.now)
            clock.advance(2 * preparation.PREPARE_SLICE_S)

        admitted = [asyncio.ensure_future(lane.prepare(work, chars=20)) for _ in range(3)]
        arriving = asyncio.ensure_future(arrivals(lane, log, 10**9))
        await asyncio.wait(admitted, timeout=1.0)  # virtual seconds
        arriving.cancel()
        return times

    times = clock.run(flood())
    assert len(times) == 3, "admitted calls still move under the flood"
    assert times[0] >= 0.02 and all(b - a >= 0.02 for a, b in itertools.pairwise(times)), "one per deferral"


def test_while_the_queue_refuses_the_lane_waits_on_a_timer_instead_of_turning_the_loop(
    monkeypatch: pytest.MonkeyPatch, clock: VirtualClock
) -> None:
    """A loop turned without pause through a burst takes a core from gRPC's threads reading the calls
    (refusals waited 60-100 ms longer in `bench.burst`): the loop idles between arrivals, turning a few times
    per call where a spinning one turns for every TURN_S of the burst's 0.3 s."""
    monkeypatch.setattr(preparation, "REFUSING_MAX_DEFERRAL_S", 60.0)
    monkeypatch.setattr(preparation, "REFUSING_QUIET_INTERVAL_S", 0.05)

    async def spaced_burst() -> tuple[Log, int]:
        lane, log = PreparationLane(), Log()
        admitted = asyncio.ensure_future(lane.prepare(recording(log, 0), chars=20))
        turns = clock.turns
        for index in range(60):  # refused calls in the next turns of the loop, then one every 5 ms
            arrive(lane, refused=True)
            log.append(("arrive", index))
            await asyncio.sleep(0 if index < 3 else preparation.REFUSING_QUIET_INTERVAL_S / 10)
        turns = clock.turns - turns
        await admitted
        return log, turns

    log, turns = clock.run(spaced_burst())
    assert log[-1] == ("prepare", 0) and len(log) == 61, "prepared once the calls stopped"
    assert turns <= 4 * 60, f"the loop turned {turns} times for 60 calls: it spun"


@pytest.mark.parametrize("refusing", [False, True])
def test_a_lone_call_is_prepared_at_once_and_one_followed_by_others_waits_for_a_timed_lull(
    monkeypatch: pytest.MonkeyPatch, clock: VirtualClock, refusing: bool
) -> None:
    monkeypatch.setattr(preparation, "MAX_DEFERRAL_S", 60.0)
    monkeypatch.setattr(preparation, "REFUSING_MAX_DEFERRAL_S", 60.0)
    monkeypatch.setattr(preparation, "QUIET_INTERVAL_S", 0.3)
    monkeypatch.setattr(preparation, "REFUSING_QUIET_INTERVAL_S", 0.3)

    async def scenario() -> tuple[float, float]:
        lane = PreparationLane()
        started = clock.now
        arrive(lane)
        await asyncio.wait_for(lane.prepare(lambda: None, chars=20), timeout=5)
        lone = clock.now - started
        arrive(lane)
        followed = asyncio.ensure_future(lane.prepare(lambda: None, chars=20))
        await arrivals(lane, Log(), 3, refused=refusing)  # more calls, in the next turns of the loop
        started = clock.now  # the last of them
        await asyncio.wait_for(followed, timeout=5)
        return lone, clock.now - started

    lone, followed = clock.run(scenario())
    assert lone < 0.3, "prepared after its quiet turns, with no quiet interval waited"
    assert followed >= 0.3, "prepared a whole quiet interval after the last call"


def test_while_the_queue_refuses_a_pause_shorter_than_its_quiet_interval_is_no_lull(
    monkeypatch: pytest.MonkeyPatch, clock: VirtualClock
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

    log = clock.run(paused_burst())
    assert log[-1] == ("prepare", 0) and len(log) == 9, "prepared once the refused calls stopped"


def test_under_an_endless_flood_of_refusals_a_slice_keeps_its_share_of_the_wait(
    monkeypatch: pytest.MonkeyPatch, clock: VirtualClock
) -> None:
    """The lane waits up to REFUSING_MAX_DEFERRAL_S for a lull, then prepares for PREPARATION_SHARE of that
    wait: admitted calls still move, and each refusal waits behind one slice at most."""
    monkeypatch.setattr(preparation, "REFUSING_MAX_DEFERRAL_S", 0.2)
    monkeypatch.setattr(preparation, "PREPARE_SLICE_S", 0.0)  # the share alone sets the slice

    async def flood() -> tuple[float, list[float]]:
        lane, log, times = PreparationLane(), Log(), []

        def work() -> None:  # 2 ms a call: a slice of a tenth of 0.2 s prepares several
            times.append(clock.now)
            clock.advance(0.002)

        arrive(lane, refused=True)
        started = clock.now
        admitted = [asyncio.ensure_future(lane.prepare(work, chars=20)) for _ in range(40)]
        arriving = asyncio.ensure_future(arrivals(lane, log, 10**9, refused=True))
        await asyncio.wait(admitted, timeout=2.0)  # virtual seconds: 1 is enough for 10 calls a slice
        arriving.cancel()
        return started, times

    started, times = clock.run(flood())
    assert times[0] - started >= 0.2, "nothing prepared before the deferral while calls are refused"
    first_slice = [t for t in times if t - times[0] < 0.02]
    assert len(first_slice) >= 3, f"a slice of a tenth of the wait, not one call: {len(first_slice)} prepared"
    assert all(b - a < 0.2 + 0.1 for a, b in itertools.pairwise(times)), "the lane prepares every deferral"
    assert len(times) == 40, "every admitted call is prepared"


def test_a_lull_prepares_calls_for_a_slice_of_time_one_at_least(
    monkeypatch: pytest.MonkeyPatch, clock: VirtualClock
) -> None:
    """Short calls under steady load take one lull between them, not one each; a long one takes its own."""
    monkeypatch.setattr(preparation, "PREPARE_SLICE_S", 0.05)

    async def scenario() -> list[int]:
        lane, prepared_per_lull = PreparationLane(), []
        runs = lane.prepared

        calls = [0.001] * 5 + [0.2, 0.001]
        admitted = [asyncio.ensure_future(lane.prepare(partial(clock.advance, seconds), chars=20)) for seconds in calls]
        while not all(call.done() for call in admitted):
            await asyncio.sleep(0)
            if lane.prepared != runs:
                prepared_per_lull.append(lane.prepared - runs)
                runs = lane.prepared
        return prepared_per_lull

    assert clock.run(scenario()) == [6, 1]  # five short ones and the long one, then the last


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


def test_admission_finds_the_sentence_ends_of_their_plain_definition() -> None:
    """Sentence ends as two alternatives (punctuation, closers, whitespace; line breaks) cost the event loop every
    character of every call in a burst; the pattern that counts them begins with one character class instead,
    and must cut exactly where the plain definition does."""
    plain = re.compile(
        r"[.!?\u2026\u3002\uff01\uff1f]+[\"'\u00bb\u201d\u2019)\]]*\s+|[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]+"
    )
    alphabet = "ab1 \t\u00a0.!?\u2026\u3002\uff01\uff1f\"'\u00bb\u201d\u2019)]\n\r\v\f\x1c\x1e\x85\u2028\u2029,-"
    draw = random.Random(7)
    for _ in range(20_000):
        text = "".join(draw.choice(alphabet) for _ in range(draw.randint(0, 24)))
        assert _SENTENCE_END.split(text) == plain.split(text), repr(text)
