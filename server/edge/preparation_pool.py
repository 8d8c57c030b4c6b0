"""Worker threads that prepare long calls (detection, splitting, tokenizing), each call its share.

Each call's work gets a thread of its own, but only `RUNNING_AT_ONCE` of them run at a time: pysbd and the
tokenizer's Python hold the GIL, so more running threads would only take turns from the event loop. A
running call gives its turn to the call that has waited longest at each `checkpoint` (between texts,
and between the windows pysbd reads), so no call holds the pool from the others however long its texts:
turns go round in arrival order. Work stops at its next checkpoint once its call's deadline passes or
the call is cancelled (`CallEnded`), and a call waiting for its turn gives up then too. A paused pool
(`pause`, while the event loop's refusals come first) grants no turn: its running call stops at its next
checkpoint and waits, releasing the GIL, until `resume`. The threads all start at the pool's first call, from
a thread of their own: a thread's start blocks its caller until the new thread runs, and on a busy machine
a burst's first hundred calls would hold the event loop that long each.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from server.text.checkpoints import CallEnded, checkpoints

T = TypeVar("T")

RUNNING_AT_ONCE = 1  # calls whose work runs at a time; the others wait at their checkpoints
# Threads for calls being prepared at once, running or waiting their turn (a waiting thread only sleeps);
# calls past this many wait for a thread, each at most until its deadline
PREPARATION_THREADS = 128


@dataclass(eq=False)
class CallToken:
    """One call's preparation: ended once its deadline passes or the call is cancelled."""

    deadline: float | None  # time.monotonic() at which the call's deadline passes; None: no deadline
    _cancelled: threading.Event = field(default_factory=threading.Event)
    # What the call's thread sleeps on while it waits for a turn (over the turns' lock): woken alone, never polled
    wake: threading.Condition | None = None

    def cancel(self) -> None:
        self._cancelled.set()
        if (wake := self.wake) is not None:  # set before the thread last looked at the call, or it saw the cancel
            with wake:
                wake.notify()

    def check(self) -> None:
        """Raise CallEnded if the call has ended."""
        if self._cancelled.is_set():
            raise CallEnded(deadline_passed=False)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise CallEnded(deadline_passed=True)

    def wait_s(self) -> float | None:
        """How long a waiting thread may sleep before its deadline passes; None: until woken."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class Turns:
    """Up to `width` calls run at once; the others wait in arrival order, each woken only when it may run (a
    thread woken for nothing takes the GIL from the event loop)."""

    def __init__(self, width: int) -> None:
        self._width = width
        self._running = 0
        self._waiting: deque[CallToken] = deque()
        self._paused = False  # no turn granted, and a running call gives up its turn at its next checkpoint
        self._lock = threading.Lock()

    def take(self, token: CallToken) -> None:
        """Block until `token`'s call may run; CallEnded if the call ends first."""
        with self._lock:
            if token.wake is None:
                token.wake = threading.Condition(self._lock)
            self._waiting.append(token)
            try:
                while self._paused or self._running >= self._width or self._waiting[0] is not token:
                    token.check()
                    token.wake.wait(token.wait_s())
            except CallEnded:
                self._waiting.remove(token)
                self._wake_next()
                raise
            self._waiting.popleft()
            self._running += 1
            self._wake_next()  # a wider pool's next call may run too

    def give(self) -> None:
        with self._lock:
            self._running -= 1
            self._wake_next()

    def _wake_next(self) -> None:
        """Wake the longest waiting call if it may run now (the lock held)."""
        if self._waiting and not self._paused and self._running < self._width:
            wake = self._waiting[0].wake
            assert wake is not None, "a waiting call has its condition"
            wake.notify()

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._wake_next()

    def waiting(self) -> int:
        """Calls waiting for a turn now."""
        return len(self._waiting)

    def checkpoint(self, token: CallToken) -> None:
        """A running call's checkpoint: stop if it ended; let the longest waiting call run first, if one waits;
        wait for `resume` while paused."""
        token.check()
        if self._waiting or self._paused:
            self.give()
            try:
                self.take(token)
            except CallEnded:
                with self._lock:
                    self._running += 1  # the stopping work's own turn again, for the `give` it ends with
                raise


@dataclass
class _Task(Generic[T]):
    work: Callable[[], T]
    token: CallToken
    result: Future[T]  # cancelled by the awaiting task's cancellation: a task not yet taken is skipped


class PreparationPool:
    """Runs calls' preparation in worker threads, a share each (see the module docstring)."""

    def __init__(self, width: int = RUNNING_AT_ONCE, threads: int = PREPARATION_THREADS) -> None:
        self._turns = Turns(width)
        self._threads = threads
        self._tasks: queue.SimpleQueue[_Task[Any] | None] = queue.SimpleQueue()  # None: a thread's stop
        self._started = False

    async def run(self, work: Callable[[], T], deadline: float | None) -> T:
        """`work()`'s result, computed in a worker thread in its turns; CallEnded once `deadline` (a
        time.monotonic() time) passes first. Cancelling the awaiting task stops the work at its next checkpoint."""
        if not self._started:
            self._started = True
            threading.Thread(target=self._start_threads, name="prepare-start", daemon=True).start()
        token = CallToken(deadline)
        result: Future[T] = Future()
        self._tasks.put(_Task(work, token, result))
        try:
            return await asyncio.wrap_future(result)
        except asyncio.CancelledError:
            token.cancel()
            raise

    def _start_threads(self) -> None:
        for index in range(self._threads):
            threading.Thread(target=self._serve, name=f"prepare_{index}", daemon=True).start()

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            if not task.result.set_running_or_notify_cancel():  # the call ended before a thread took it
                continue
            try:
                task.result.set_result(self._in_turns(task.work, task.token))
            except BaseException as err:  # the call's own failure, or CallEnded: its awaiting task raises it
                task.result.set_exception(err)

    def _in_turns(self, work: Callable[[], T], token: CallToken) -> T:
        self._turns.take(token)
        try:
            with checkpoints(lambda: self._turns.checkpoint(token)):
                return work()
        finally:
            self._turns.give()

    def pause(self) -> None:
        """Grant no turn until `resume`; a running call stops at its next checkpoint."""
        self._turns.pause()

    def resume(self) -> None:
        self._turns.resume()

    def shutdown(self) -> None:
        """Stop each thread once it is idle."""
        for _ in range(self._threads):
            self._tasks.put(None)
