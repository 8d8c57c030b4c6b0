"""Worker threads that prepare long calls (detection, splitting, tokenizing), each call its share.

Each call's work gets a thread of its own, but only `RUNNING_AT_ONCE` of them run at a time: pysbd and the
tokenizer's Python hold the GIL, so more running threads would only take turns from the event loop. A
running call gives its turn to the call that has waited longest at each `checkpoint` (between texts,
and between the windows pysbd reads), so no call holds the pool from the others however long its texts:
turns go round in arrival order. Work stops at its next checkpoint once its call's deadline passes or
the call is cancelled (`CallEnded`), and a call waiting for its turn gives up then too.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from server.core.checkpoints import CallEnded, checkpoints

T = TypeVar("T")

RUNNING_AT_ONCE = 1  # calls whose work runs at a time; the others wait at their checkpoints
# Threads for calls being prepared at once, running or waiting their turn (a waiting thread only sleeps);
# calls past this many wait for a thread, each at most until its deadline
PREPARATION_THREADS = 128
# How often a call waiting for its turn looks whether it was cancelled (a deadline wakes it on time)
CANCEL_POLL_S = 0.05


@dataclass
class CallToken:
    """One call's preparation: ended once its deadline passes or the call is cancelled."""

    deadline: float | None  # time.monotonic() at which the call's deadline passes; None: no deadline
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    def check(self) -> None:
        """Raise CallEnded if the call has ended."""
        if self._cancelled.is_set():
            raise CallEnded(deadline_passed=False)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise CallEnded(deadline_passed=True)

    def wait_s(self) -> float:
        """How long a waiting thread may sleep before it looks at the call again."""
        if self.deadline is None:
            return CANCEL_POLL_S
        return max(0.0, min(CANCEL_POLL_S, self.deadline - time.monotonic()))


class Turns:
    """Up to `width` calls run at once; the others wait in arrival order."""

    def __init__(self, width: int) -> None:
        self._width = width
        self._running = 0
        self._waiting: deque[CallToken] = deque()
        self._changed = threading.Condition()

    def take(self, token: CallToken) -> None:
        """Block until `token`'s call may run; CallEnded if the call ends first."""
        with self._changed:
            self._waiting.append(token)
            try:
                while self._running >= self._width or self._waiting[0] is not token:
                    token.check()
                    self._changed.wait(token.wait_s())
            except CallEnded:
                self._waiting.remove(token)
                self._changed.notify_all()
                raise
            self._waiting.popleft()
            self._running += 1

    def give(self) -> None:
        with self._changed:
            self._running -= 1
            self._changed.notify_all()

    def waiting(self) -> int:
        """Calls waiting for a turn now."""
        return len(self._waiting)

    def checkpoint(self, token: CallToken) -> None:
        """A running call's checkpoint: stop if it ended; let the longest waiting call run first, if one waits."""
        token.check()
        if self._waiting:
            self.give()
            try:
                self.take(token)
            except CallEnded:
                with self._changed:
                    self._running += 1  # the stopping work's own turn again, for the `give` it ends with
                raise


class PreparationPool:
    """Runs calls' preparation in worker threads, a share each (see the module docstring)."""

    def __init__(self, width: int = RUNNING_AT_ONCE, threads: int = PREPARATION_THREADS) -> None:
        self._turns = Turns(width)
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="prepare")

    async def run(self, work: Callable[[], T], deadline: float | None) -> T:
        """`work()`'s result, computed in a worker thread in its turns; CallEnded once `deadline` (a
        time.monotonic() time) passes first. Cancelling the awaiting task stops the work at its next checkpoint."""
        token = CallToken(deadline)
        future = self._executor.submit(self._in_turns, work, token)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            token.cancel()
            raise

    def _in_turns(self, work: Callable[[], T], token: CallToken) -> T:
        self._turns.take(token)
        try:
            with checkpoints(lambda: self._turns.checkpoint(token)):
                return work()
        finally:
            self._turns.give()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
