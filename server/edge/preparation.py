"""Splitting and tokenizing admitted calls without delaying anyone's admission.

A call is admitted or refused the moment its handler runs (`Engine.admission`), but the handler only
runs once the event loop gets to it: preparing a call on the loop (pysbd splitting and tokenizing, the
slowest Python a call runs) delays every call gRPC has not handed over yet, and in a burst each refusal
would wait behind the preparation of every call admitted before it. So preparation takes the loop only
when new calls have stopped arriving: `PreparationLane` prepares admitted calls in the order they were
admitted, once `QUIET_ITERATIONS` turns of the loop pass without a new call, as many as
`PREPARE_SLICE_S` allows (one at least). Once a call comes during those turns the lane waits for the
lull on a timer instead (`QUIET_INTERVAL_S` without a new call), not by turning the loop: a loop that
never sleeps through a burst takes a core from gRPC's own threads, which read the calls still coming.
Under an endless flood one slice runs anyway every `MAX_DEFERRAL_S`, so admitted calls still move.

While the queue refuses calls (a burst it cannot take) the refusals come first: a lull is
`REFUSING_QUIET_INTERVAL_S` without a call and the lane waits for one up to `REFUSING_MAX_DEFERRAL_S`,
long enough for a burst to be read and refused whole (slices started mid-burst put every later refusal
behind them, and behind the decoding they hand the engines). A slice lasts `PREPARATION_SHARE` of the
time the lane waited for its lull, so under an endless flood of refusals preparation still keeps that
share of the loop, and no refusal waits behind more than one slice. A long request (over
`INLINE_PREPARE_CHARS`) is prepared in the worker threads of `PreparationPool`, in turns with the other
long calls and only until its deadline passes or it is cancelled: it would hold the loop for a long while.
The pool too runs only in the lane's slices, and for their length only: paused between them, and told when
each ends, so its running call stops at its next checkpoint after that even while the loop, busy with a burst,
comes late to pause it. A thread that holds the GIL takes the loop as surely: each time the loop waits for I/O
it waits up to the interpreter's switch interval to get the GIL back, and in a burst every call after an
admitted long one would wait behind its preparation. For the same reason a call admitted into the paused pool
gets no thread until its first turn, in a slice: one woken at admission takes the GIL mid-burst only to wait.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from server.core.events import QueueFullError
from server.edge.preparation_pool import PreparationPool

T = TypeVar("T")

# Requests of at most this many characters are prepared on the event loop, short enough not to hold it
# (docs/decisions.md); longer ones in a worker thread
INLINE_PREPARE_CHARS = 512
# Turns of the event loop without a new call before a preparation runs: gRPC hands a call over in a few
# turns (its completion queue, then the call's task, then its message), and as a burst begins its calls come
# tens of turns apart, where a shorter wait prepared them one by one and handed the engines work that decoded
# beside the burst's refusals; an idle turn takes a few microseconds
QUIET_ITERATIONS = 64
# Once a call came during those turns: how long the lane sleeps between looks, and the quiet it waits for
# (the calls of a burst reach the servicer a fraction of a millisecond apart)
QUIET_INTERVAL_S = 0.002
# How long the lane prepares calls in one lull: one call at least, more while this has not passed (short
# calls under steady load would otherwise take a lull each)
PREPARE_SLICE_S = 0.005
# The longest the lane waits for a lull while calls keep arriving before it prepares a slice anyway
MAX_DEFERRAL_S = 0.05
# How long after a refusal the queue counts as refusing calls
REFUSING_FOR_S = 0.05
# While the queue refuses calls: the quiet a lull needs (a client's sending pauses for a few milliseconds
# within a burst), and the longest the lane waits for one, counted from the oldest waiting call or the last
# slice (`bench.burst`'s 400 calls reach a 2-core server within about 0.25 s of the first)
REFUSING_QUIET_INTERVAL_S = 0.01
REFUSING_MAX_DEFERRAL_S = 0.35
# A slice lasts at least this share of the time the lane waited for its lull: the backlog a long wait built
# up gets a longer slice, and preparation keeps about this share of the loop under any flood
PREPARATION_SHARE = 0.1


@dataclass
class _Job(Generic[T]):
    work: Callable[[], T]
    result: asyncio.Future[T]
    queued_at: float  # time.monotonic() when admitted


class PreparationLane:
    """One event loop's preparation of admitted calls: FIFO, a slice of them per lull between arrivals."""

    def __init__(self, pool: PreparationPool | None = None) -> None:
        self.pool = PreparationPool() if pool is None else pool  # long calls' preparation, a turn each
        self._arrivals = 0  # calls that reached the servicer; only its changes matter
        self._refused_at = float("-inf")  # time.monotonic() when the queue last refused a call
        self._jobs: deque[_Job[Any]] = deque()
        self._worker: asyncio.Task[None] | None = None
        self._last_run = 0.0  # time.monotonic() when the lane last prepared a call
        self._in_pool = 0  # long calls this lane has in the pool now
        self._pool_since = 0.0  # time.monotonic() when the oldest of them came
        self._in_slice = False  # the lane prepares calls now, the pool's too; outside a slice the pool is paused
        self.prepared = 0  # preparations run, on the loop or in a thread

    @contextmanager
    def arrival(self) -> Iterator[None]:
        """Around a call that has reached the servicer (admitted or not): the loop is not quiet, and a
        QueueFullError out of it means the queue is refusing calls."""
        self._arrivals += 1
        try:
            yield
        except QueueFullError:
            self._refused_at = time.monotonic()
            raise

    async def prepare(self, work: Callable[[], T], chars: int, deadline: float | None = None) -> T:
        """`work()`'s result, run in a lull of the loop, or in the pool when `chars` is over the inline limit (there
        CallEnded once `deadline`, a time.monotonic() time, passes)."""
        if chars > INLINE_PREPARE_CHARS:
            self.prepared += 1
            if not self._in_pool:
                self._pool_since = time.monotonic()
            self._in_pool += 1
            if not self._in_slice:
                self.pool.pause()  # until the lane's next slice, before the call's first turn
            self._start()
            try:
                return await self.pool.run(work, deadline)
            finally:
                self._in_pool -= 1
        job = _Job(work, asyncio.get_running_loop().create_future(), time.monotonic())
        self._jobs.append(job)
        self._start()
        return await job.result  # cancelled with the call: the worker skips the job

    def _start(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while self._jobs or self._in_pool:
                oldest = [self._jobs[0].queued_at] if self._jobs else []
                since = max(min([*oldest, self._pool_since] if self._in_pool else oldest), self._last_run)
                await self._lull(since)
                lull = time.monotonic()
                slice_ends = lull + max(PREPARE_SLICE_S, (lull - since) * PREPARATION_SHARE)
                self._in_slice = True
                self.pool.resume(slice_ends - lull)  # the pool stops at the slice's end, not when the loop gets to it
                self._prepare_until(slice_ends)
                if self._in_pool and (rest := slice_ends - time.monotonic()) > 0:
                    await asyncio.sleep(rest)  # the loop idle: the pool's threads have the GIL
                self._in_slice = False
                self.pool.pause()
                self._last_run = time.monotonic()
        finally:
            self._in_slice = False
            self.pool.resume()  # no call of the lane's left (or the loop closing): detection runs at once

    def _prepare_until(self, slice_ends: float) -> None:
        """Prepare waiting calls in admission order: one at least, more until `slice_ends`."""
        while self._jobs:
            job = self._jobs.popleft()
            if job.result.done():  # the call ended while it waited
                continue
            self.prepared += 1
            try:
                job.result.set_result(job.work())
            except Exception as err:  # the call's own failure (a text over a limit): it raises it
                job.result.set_exception(err)
            if time.monotonic() >= slice_ends:
                break

    async def _lull(self, since: float) -> None:
        """Return once QUIET_ITERATIONS turns of the loop pass with no new call or, once a call came during
        them, once a sleep of QUIET_INTERVAL_S does; at MAX_DEFERRAL_S after `since` in any case. While the
        queue refuses calls: once a sleep of REFUSING_QUIET_INTERVAL_S passes with no new call, at
        REFUSING_MAX_DEFERRAL_S after `since` at the latest."""
        turns: int | None = 0  # quiet turns so far; None once the lane waits on the timer
        while True:
            now = time.monotonic()
            refusing = now - self._refused_at < REFUSING_FOR_S
            if now - since >= (REFUSING_MAX_DEFERRAL_S if refusing else MAX_DEFERRAL_S):
                return
            seen = self._arrivals
            if refusing or turns is None:
                await asyncio.sleep(REFUSING_QUIET_INTERVAL_S if refusing else QUIET_INTERVAL_S)
                if self._arrivals == seen:
                    return
                continue
            await asyncio.sleep(0)
            turns = turns + 1 if self._arrivals == seen else None
            if turns == QUIET_ITERATIONS:
                return
