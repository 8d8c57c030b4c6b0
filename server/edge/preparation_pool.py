"""Worker threads that prepare long calls (detection, splitting, tokenizing), each call its share.

Each call's work gets a thread of its own, but only `RUNNING_AT_ONCE` of them run at a time: pysbd and the
tokenizer's Python hold the GIL, so more running threads would only take turns from the event loop. A running
call that has run for `MIN_TURN_S` gives its turn to the call that has waited longest at its next `checkpoint`
(between texts, and between the windows pysbd reads), so no call holds the pool from the others however long its
texts: turns go round in arrival order. A call waits for its first turn without a thread: a thread is woken for
it when that turn comes, as a waiting call's is for each later one (a woken thread takes the GIL from the event
loop, and a burst admits calls into a paused pool). Work stops at its next checkpoint once its call's deadline
passes or the call is cancelled (`CallEnded`); a call waiting for a later turn gives up then too, one still
waiting for its first when it is cancelled or once that turn comes. A paused pool (`pause`, while the event
loop's refusals come first), or one past the end of the time `resume` gave it, grants no turn: its running call
stops at its next checkpoint and waits, releasing the GIL, until `resume`. The threads all start at the pool's
first call, from a thread of their own: a thread's start blocks its caller until the new thread runs, and on a
busy machine a burst's first hundred calls would hold the event loop that long each.
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
from functools import partial
from typing import Any, Generic, TypeVar

from server.text.checkpoints import CallEnded, checkpoints

T = TypeVar("T")

RUNNING_AT_ONCE = 1  # calls whose work runs at a time; the others wait at their checkpoints
# A running call keeps its turn at its checkpoints until it has run this long: shorter turns mostly pass the GIL
# from one pool thread to the next, a thread woken for each, and start every waiting call before any is done
MIN_TURN_S = 0.005
# Threads for calls being prepared at once, running or waiting their turn (a waiting thread only sleeps);
# calls past this many wait for a thread to be free before their first turn
PREPARATION_THREADS = 128


@dataclass(eq=False)
class CallToken:
    """One call's preparation: ended once its deadline passes or the call is cancelled."""

    deadline: float | None  # time.monotonic() at which the call's deadline passes; None: no deadline
    _cancelled: threading.Event = field(default_factory=threading.Event)
    # What the call's thread sleeps on while it waits for a turn (over the turns' lock): woken alone, never polled
    wake: threading.Condition | None = None
    start: Callable[[], None] | None = None  # hands the call to a thread, at its first turn (`Turns.enter`)
    started: bool = False  # it has a thread, or one is on its way
    queued: bool = False  # it waits in the turns' queue
    turn_began: float = 0.0  # time.monotonic() when its current turn began

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
    thread woken for nothing takes the GIL from the event loop). A call that `enter`s waits for its first turn
    without a thread; at most `threads` of those get one at a time (None: no limit)."""

    def __init__(self, width: int, threads: int | None = None) -> None:
        self._width = width
        self._threads = threads
        self._running = 0
        self._started = 0  # entered calls handed to a thread and not yet left
        self._waiting: deque[CallToken] = deque()
        self._paused = False  # no turn granted, and a running call gives up its turn at its next checkpoint
        self._until: float | None = None  # time.monotonic() after which the pool counts as paused; None: never
        self._lock = threading.Lock()

    def enter(self, token: CallToken) -> None:
        """Queue a new call for its turn; `token.start` hands it to a thread once that turn comes."""
        assert token.start is not None, "an entered call says how its thread is found"
        with self._lock:
            self._queue(token)
            self._wake_next()

    def withdraw(self, token: CallToken) -> None:
        """Drop a call that ended before its first turn came (one with a thread sees its end at a checkpoint)."""
        with self._lock:
            if token.queued and not token.started:
                self._unqueue(token)
                self._wake_next()

    def leave(self, token: CallToken) -> None:
        """The thread of an entered call is done with it, whether its work ran or not."""
        with self._lock:
            if token.queued:
                self._unqueue(token)
            self._started -= 1
            self._wake_next()

    def take(self, token: CallToken) -> None:
        """Block until `token`'s call may run; CallEnded if the call ends first."""
        with self._lock:
            if token.wake is None:
                token.wake = threading.Condition(self._lock)
            token.started = True  # this thread is its
            if not token.queued:
                self._queue(token)
            try:
                while not self._open() or self._running >= self._width or self._next() is not token:
                    token.check()
                    token.wake.wait(token.wait_s())
            except CallEnded:
                self._unqueue(token)
                self._wake_next()
                raise
            self._unqueue(token)
            self._running += 1
            token.turn_began = time.monotonic()
            self._wake_next()  # a wider pool's next call may run too

    def give(self) -> None:
        with self._lock:
            self._running -= 1
            self._wake_next()

    def _queue(self, token: CallToken) -> None:
        self._waiting.append(token)
        token.queued = True

    def _unqueue(self, token: CallToken) -> None:
        self._waiting.remove(token)
        token.queued = False

    def _open(self) -> bool:
        """Whether turns are granted now (the lock held)."""
        return not self._paused and (self._until is None or time.monotonic() < self._until)

    def _next(self) -> CallToken | None:
        """The call the next turn goes to: the longest waiting that has a thread or can get one (the lock held)."""
        for token in self._waiting:
            if token.started or self._threads is None or self._started < self._threads:
                return token
        return None

    def _wake_next(self) -> None:
        """Wake the next call's thread, or hand it to one, if it may run now (the lock held)."""
        if not self._open() or self._running >= self._width or (token := self._next()) is None:
            return
        if token.wake is not None:
            token.wake.notify()
        elif not token.started:  # its first turn: only now does a thread take the GIL for it
            assert token.start is not None, "a call without a thread was entered"
            token.started = True
            self._started += 1
            token.start()

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def resume(self, for_s: float | None = None) -> None:
        """Grant turns again; for `for_s` seconds only, if given (a running call then stops at its next checkpoint
        after them, however late the next `pause` comes)."""
        with self._lock:
            self._paused = False
            self._until = None if for_s is None else time.monotonic() + for_s
            self._wake_next()

    def waiting(self) -> int:
        """Calls waiting for a turn now."""
        return len(self._waiting)

    def checkpoint(self, token: CallToken) -> None:
        """A running call's checkpoint: stop if it ended; once its turn has lasted MIN_TURN_S, let the longest
        waiting call run first, if one waits; wait for `resume` while paused."""
        token.check()
        if not self._open() or (self._waiting and time.monotonic() - token.turn_began >= MIN_TURN_S):
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
    result: Future[T]  # cancelled by the awaiting task's cancellation: a task whose turn comes after is skipped


class PreparationPool:
    """Runs calls' preparation in worker threads, a share each (see the module docstring)."""

    def __init__(self, width: int = RUNNING_AT_ONCE, threads: int = PREPARATION_THREADS) -> None:
        self._turns = Turns(width, threads)
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
        token.start = partial(self._tasks.put, _Task(work, token, result))
        self._turns.enter(token)
        try:
            return await asyncio.wrap_future(result)
        except asyncio.CancelledError:
            token.cancel()
            self._turns.withdraw(token)
            raise

    def _start_threads(self) -> None:
        for index in range(self._threads):
            threading.Thread(target=self._serve, name=f"prepare_{index}", daemon=True).start()

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                if task.result.set_running_or_notify_cancel():  # else the call ended before its first turn
                    task.result.set_result(self._in_turns(task.work, task.token))
            except BaseException as err:  # the call's own failure, or CallEnded: its awaiting task raises it
                task.result.set_exception(err)
            finally:
                self._turns.leave(task.token)

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

    def resume(self, for_s: float | None = None) -> None:
        """Grant turns again, for `for_s` seconds only if given."""
        self._turns.resume(for_s)

    def shutdown(self) -> None:
        """Stop each thread once it is idle."""
        for _ in range(self._threads):
            self._tasks.put(None)
