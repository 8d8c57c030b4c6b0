"""Callbacks posted to an event loop from other threads (server/edge/loop_mailbox.py): every one runs, in
each thread's order, on the loop, with one wake-up per batch instead of one per callback."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server.edge.loop_mailbox import LoopMailbox, mailbox_of


def test_every_posted_callback_runs_on_the_loop_in_each_threads_order_with_few_wakeups() -> None:
    async def scenario() -> tuple[dict[int, list[int]], set[int], int]:
        loop = asyncio.get_running_loop()
        mailbox, threads_seen = mailbox_of(loop), set()
        seen: dict[int, list[int]] = {t: [] for t in range(4)}
        wakeups = 0
        schedule = loop.call_soon_threadsafe

        def counting(*args: object, **kwargs: object) -> object:
            nonlocal wakeups
            wakeups += 1
            return schedule(*args, **kwargs)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]

        def record(item: tuple[int, int]) -> None:
            threads_seen.add(threading.get_ident())
            seen[item[0]].append(item[1])

        def sender(thread: int) -> None:
            for n in range(2_000):
                mailbox.post(record, (thread, n))

        await asyncio.gather(*(asyncio.to_thread(sender, t) for t in range(4)))
        while sum(len(v) for v in seen.values()) < 8_000:
            await asyncio.sleep(0.001)
        return seen, threads_seen, wakeups

    seen, threads, wakeups = asyncio.run(scenario())
    assert all(items == list(range(2_000)) for items in seen.values())
    assert len(threads) == 1, "run on the loop's thread only"
    assert wakeups < 8_000 / 4, f"{wakeups} wake-ups for 8,000 callbacks"


def test_a_callback_that_raises_leaves_the_rest_for_the_next_turn() -> None:
    async def scenario() -> list[int]:
        loop, ran = asyncio.get_running_loop(), []
        loop.set_exception_handler(lambda loop, context: None)  # the raise is reported, not fatal
        mailbox = LoopMailbox(loop)

        def run(n: int) -> None:
            if n == 1:
                raise ValueError("one bad callback")
            ran.append(n)

        for n in range(4):
            mailbox.post(run, n)
        for _ in range(5):
            await asyncio.sleep(0)
        return ran

    assert asyncio.run(scenario()) == [0, 2, 3]


def test_posting_to_a_closed_loop_raises_each_time() -> None:
    loop = asyncio.new_event_loop()
    mailbox = LoopMailbox(loop)
    loop.close()
    for _ in range(2):
        with pytest.raises(RuntimeError):
            mailbox.post(print, "never")
