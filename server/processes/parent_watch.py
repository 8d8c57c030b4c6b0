"""The one way a child process follows its parent out: a daemon thread that sees the parent gone and acts.

Not PR_SET_PDEATHSIG: that signal fires when the spawning *thread* ends, and servers spawn engine processes
from worker threads. A poll notices within `PARENT_POLL_S`, even while the child's main thread is stuck in
a hung call.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

PARENT_POLL_S = 1.0  # how often a child checks that its parent is still there


def follow_parent(parent_pid: int, on_gone: Callable[[], None]) -> None:
    """Call `on_gone` (once, from a daemon thread) when this process's parent is no longer `parent_pid`."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        on_gone()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
