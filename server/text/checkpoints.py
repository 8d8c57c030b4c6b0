"""Where a call's long work (splitting, detection) may stop or give way to other calls' work.

Work runs in a worker thread for a call; between bounded steps it calls `checkpoint()`. The edge that
runs the work installs the hook (`checkpoints`): it raises `CallEnded` once the call's deadline has
passed or the call was cancelled, and lets other calls' waiting work run first. Outside such a hook
(the event loop, offline translation, tests) a checkpoint does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_HOOK: ContextVar[Callable[[], None] | None] = ContextVar("checkpoint_hook", default=None)


class CallEnded(Exception):
    """The call this work was for has ended (deadline passed or cancelled): nobody waits for its result."""

    def __init__(self, deadline_passed: bool) -> None:
        super().__init__("the call's deadline passed" if deadline_passed else "the call was cancelled")
        self.deadline_passed = deadline_passed


def checkpoint() -> None:
    """Between two bounded steps of a call's work: raises CallEnded if the call has ended, may wait for a turn."""
    hook = _HOOK.get()
    if hook is not None:
        hook()


@contextmanager
def checkpoints(hook: Callable[[], None]) -> Iterator[None]:
    """Within this block (in this thread or task), `checkpoint()` calls `hook`."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)
