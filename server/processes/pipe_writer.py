"""`PipeWriter`: what the server sends an engine process, sent from a thread of its own.

A pipe holds about 64 KiB. A child that stops reading (stopped, or hung with its interpreter lock held) would
block whoever sends next; with the sends on the event loop and under the engine proxy's lock, that froze every
call of the server, health included, and held the very lock the stall watchdog needs to kill the child. Here
the event loop only appends to a queue; this thread sends, in the order messages were put, holding no lock
of the proxy's, so a stuck child blocks only its own writer until the watchdog kills it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from server.processes.engine_messages import ToChild


class PipeWriter:
    """Sends messages to a child over `conn` in order, from its own thread."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn = conn
        self._ready = threading.Condition()  # guards everything below
        self._queue: deque[bytes] = deque()  # pickled messages
        self._closing = False
        self._broken = False  # a send failed: the child is gone
        self._sending_since: float | None = None  # when the send in progress began
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, message: ToChild) -> None:
        """Queue `message`, never waiting for the child; OSError once a send has failed (the child is gone). It is
        pickled here, on the caller's thread: a message that does not pickle fails its caller, not a later send."""
        payload = bytes(ForkingPickler.dumps(message))  # what Connection.send sends
        with self._ready:
            if self._broken or self._closing:
                raise OSError("the engine process's pipe is closed")
            self._queue.append(payload)
            self._ready.notify()

    def stuck_for(self, now: float) -> float:
        """How long the send in progress has waited for the child to read (0 when none is waiting)."""
        with self._ready:
            return 0.0 if self._sending_since is None else now - self._sending_since

    def close(self, timeout_s: float) -> bool:
        """Send what is queued, then end the thread; False if a send still waits on the child after `timeout_s`
        (the pipe must not be written by anyone else until it is killed)."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: bool(self._queue) or self._closing)
                if not self._queue:
                    return
                payload = self._queue.popleft()
                self._sending_since = time.monotonic()
            try:
                self._conn.send_bytes(payload)
            except OSError:  # the child closed its end: the proxy's reader sees it go and answers its requests
                with self._ready:
                    self._broken, self._sending_since = True, None
                    self._queue.clear()
                return
            with self._ready:
                self._sending_since = None
