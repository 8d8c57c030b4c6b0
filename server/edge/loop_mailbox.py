"""Callbacks from other threads onto one event loop, in batches.

The engines' events arrive on other threads (an engine's own, or the reader of an engine process's
pipe), one per finished sentence or partial output. `loop.call_soon_threadsafe` per event wakes the loop
through its self-pipe each time: a system call on the sending thread for every event, and a wake-up of
the loop for every one. `LoopMailbox.post` queues the callback and wakes the loop only when no wake-up is
pending, so a step's events reach the loop in one turn, in the order they were posted.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = weakref.WeakKeyDictionary()


class LoopMailbox:
    """One event loop's queue of callbacks posted from other threads (any number of them)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._posted: deque[tuple[Callable[[Any], None], Any]] = deque()
        self._wake_pending = False

    def post(self, callback: Callable[[Any], None], argument: Any) -> None:
        """Run `callback(argument)` on the loop, after everything posted before it; from any thread."""
        self._posted.append((callback, argument))
        if not self._wake_pending:  # after the append: a drain that has begun takes this one or wakes again
            self._wake_pending = True
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nothing will run, and a later post says so again
                self._wake_pending = False
                raise

    def _drain(self) -> None:
        self._wake_pending = False  # before taking: a post from now on wakes the loop again
        try:
            while self._posted:
                callback, argument = self._posted.popleft()
                callback(argument)
        finally:  # a callback that raised leaves the rest for the next turn, not for the next post
            if self._posted and not self._wake_pending:
                self._wake_pending = True
                self._loop.call_soon(self._drain)


def mailbox_of(loop: asyncio.AbstractEventLoop) -> LoopMailbox:
    """The loop's one mailbox (made on first use, from the loop's own thread)."""
    mailbox = _MAILBOXES.get(loop)
    if mailbox is None:
        mailbox = _MAILBOXES[loop] = LoopMailbox(loop)
    return mailbox
