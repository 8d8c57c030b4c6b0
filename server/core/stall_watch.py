"""The one stall watch: give up on an engine whose runner call has run past the limit.

A runner call that never returns (a wedged GPU kernel, a deadlock) would otherwise hold every request until
its deadline, and a replica whose health still said SERVING would never be replaced. The server watches
each engine thread it runs, and an engine process watches its own engine, with this same loop.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

log = logging.getLogger(__name__)


class Abandonable(Protocol):
    """What the watch needs of an engine (`server.core.engine.Engine` and the engine-process proxy)."""

    @property
    def failed(self) -> bool: ...

    def abandon_if_stalled(self, limit_s: float, now: float) -> float | None: ...


def watch_for_a_stall(engine: Abandonable, limit_s: float, stop: threading.Event) -> None:
    """Until `stop` is set or the engine has failed, check it every `min(1 s, limit_s / 4)`; abandon it (its
    requests answered UNAVAILABLE, its on_failure called) once an iteration has run over `limit_s`."""
    period = min(1.0, limit_s / 4)
    while not engine.failed and not stop.wait(period):
        stalled_s = engine.abandon_if_stalled(limit_s, time.monotonic())
        if stalled_s is not None:
            log.critical(
                "a runner call has run for %.1f s (--stall-seconds %.1f): the runner is hung; "
                "failed every request UNAVAILABLE", stalled_s, limit_s,
            )  # fmt: skip
            return


def start_stall_watch(engine: Abandonable, limit_s: float, stop: threading.Event) -> threading.Thread:
    """`watch_for_a_stall` in a daemon thread."""
    thread = threading.Thread(target=watch_for_a_stall, args=(engine, limit_s, stop), name="stall-watch", daemon=True)
    thread.start()
    return thread
