"""Admission sizing and the preparation lane (server/edge/admission.py, server/edge/preparation.py), on a bare
event loop: a burst's admissions and refusals all come before any of its calls is split and tokenized."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable

import pytest

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


async def arrivals(lane: PreparationLane, log: Log, turns: int) -> None:
    """A call reaches the servicer in each of `turns` turns of the loop, as in a burst."""
    for index in range(turns):
        lane.arrived()
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


def test_under_an_endless_flood_one_call_is_prepared_per_deferral(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preparation, "MAX_DEFERRAL_S", 0.02)

    async def flood() -> list[float]:
        lane, log, times = PreparationLane(), Log(), []

        def work() -> None:
            times.append(time.monotonic())

        admitted = [asyncio.ensure_future(lane.prepare(work, chars=20)) for _ in range(3)]
        arriving = asyncio.ensure_future(arrivals(lane, log, 10**9))
        await asyncio.gather(*admitted)
        arriving.cancel()
        return times

    times = asyncio.run(flood())
    assert len(times) == 3 and all(b - a >= 0.02 for a, b in itertools.pairwise(times))


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
