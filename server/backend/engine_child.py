"""The child's side of an engine process: open the runner, run an `Engine` over it, answer the server.

`serve_model` is the process's entry point. Messages are `server.backend.engine_messages`; the engine's
events and measurements leave in one pipe message per engine iteration that has something to tell
(`_Outbox`). The child watches its own engine for stalls and exits within a second of its server.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.backend.engine_messages import (
    AbandonedObserved,
    Cancel,
    CapacitySet,
    Close,
    Failed,
    GcCounts,
    LoadReport,
    QueueWaits,
    RequestEvent,
    RunnerFacts,
    SentenceObserved,
    StartEngine,
    StartFailed,
    StepObserved,
    Stop,
    Submit,
    ToChild,
    ToServer,
    Warm,
    Warmup,
)
from server.backend.parent_watch import follow_parent
from server.backend.priority import lower_process_priority
from server.core.engine import Engine
from server.core.events import (
    ENGINE_FAILED_MESSAGE,
    DrainingError,
    EngineLimits,
    Event,
    FailureReason,
    RequestDone,
    RequestFailed,
)
from server.core.gc_pauses import PAUSES, freeze_startup_objects
from server.core.observer import StepStats
from server.core.stall_watch import start_stall_watch

if TYPE_CHECKING:
    from server.backend.runtime import OnnxRunner

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0
HEARTBEAT_S = 1.0  # the longest an iterating engine process stays silent
SHUTDOWN_MESSAGE = "the server is shutting down"


@dataclass(frozen=True)
class RunnerSettings:
    """What a child needs to open its runner (`server.backend.runners.open_runner`'s arguments)."""

    variant_dir: Path
    max_slots: int
    provider: str
    intra_op_threads: int
    kv_cache: str
    spin_threads: bool

    def open(self) -> OnnxRunner:
        from server.backend.runners import open_runner  # onnxruntime loads where the runner runs

        return open_runner(
            self.variant_dir, self.max_slots, self.provider, self.intra_op_threads, self.kv_cache,
            spin_threads=self.spin_threads,
        )  # fmt: skip


def serve_model(conn: Connection, settings: RunnerSettings, parent_pid: int) -> None:
    """The child: open the runner, report its facts, run an engine over it and answer the server."""
    follow_parent(parent_pid, lambda: os._exit(1))  # an engine without its server holds memory for nothing
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server drains first
    try:
        runner = settings.open()
    except Exception as err:
        conn.send(StartFailed(f"{type(err).__name__}: {err}"))
        return
    conn.send(RunnerFacts(runner.spec, runner.metadata, runner.provider, runner.kv_cache, runner.max_slots))
    try:
        start = conn.recv()
    except EOFError:
        return
    if isinstance(start, StartEngine):
        lower_process_priority(start.nice)
        PAUSES.install()  # its collector's pauses go with its GC counts
        _ChildEngine(conn, runner, start.limits, start.stall_seconds).serve()


class _Outbox:
    """Messages for the server. The engine thread appends its events and measurements and sends them all at
    the end of an iteration, with its load report (`put`): one pipe message per iteration, written by the
    thread that has them. An iteration that changed nothing the server acts on (no event, the same load)
    sends nothing: its measurements wait for the next message."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._items: list[ToServer] = []
        self._has_events = False  # an event is queued: the end of this iteration must send
        self._lock = threading.Lock()  # also orders the sends of the engine thread and the main thread

    @property
    def has_events(self) -> bool:
        return self._has_events

    def add(self, item: ToServer) -> None:
        """Queue a measurement for the next send."""
        with self._lock:
            self._items.append(item)

    def add_event(self, item: RequestEvent) -> None:
        """Queue an event: it goes with this iteration's load report."""
        with self._lock:
            self._items.append(item)
            self._has_events = True

    def put(self, item: ToServer) -> None:
        """Queue a message and send everything queued."""
        with self._lock:
            self._items.append(item)
            batch, self._items, self._has_events = self._items, [], False
            with suppress(OSError):  # the server is gone: the main loop sees its pipe close and stops
                self._conn.send(batch)


class _ForwardingObserver:
    """The engine's observer in the child: every measurement goes to the server's metrics."""

    def __init__(self, outbox: _Outbox, received: Callable[[], int]) -> None:
        self._outbox, self._received = outbox, received
        self._last_load: LoadReport | None = None
        self._last_gc: GcCounts | None = None
        self._last_sent = 0.0  # monotonic time of the last load report

    def set_capacity(self, max_slots: int) -> None:
        self._outbox.put(CapacitySet(max_slots))

    def set_load(self, queue_depth: int, active_slots: int) -> None:
        """The end of every iteration: send what the server must see now (see `_Outbox`), and at least one
        report a `HEARTBEAT_S` while iterating, so that the server can tell a busy engine from a hung one."""
        gc_counts = GcCounts.now()  # goes with the next message: an idle child collects next to nothing
        if gc_counts != self._last_gc:
            self._last_gc = gc_counts
            self._outbox.add(gc_counts)
        load = LoadReport(queue_depth, active_slots, self._received())
        now = time.monotonic()
        if load != self._last_load or self._outbox.has_events or now - self._last_sent >= HEARTBEAT_S:
            self._last_load, self._last_sent = load, now
            self._outbox.put(load)

    def observe_queue_waits(self, waits: Iterable[float]) -> None:
        self._outbox.add(QueueWaits(tuple(waits)))

    def observe_step(self, stats: StepStats) -> None:
        self._outbox.add(StepObserved(stats))

    def observe_sentence(self, lang_pair: str, input_tokens: int, output_tokens: int) -> None:
        self._outbox.add(SentenceObserved(lang_pair, input_tokens, output_tokens))

    def observe_abandoned(self, lang_pair: str, reason: str, queued: int, decoding: int) -> None:
        self._outbox.add(AbandonedObserved(lang_pair, reason, queued, decoding))


class _ChildEngine:
    """The child's engine and the loop that answers the server's messages."""

    def __init__(self, conn: Connection, runner: OnnxRunner, limits: EngineLimits, stall_seconds: float) -> None:
        self._conn = conn
        self._received = 0  # sentences received from the server, ever (reported with each load)
        self._outbox = _Outbox(conn)
        observer = _ForwardingObserver(self._outbox, lambda: self._received)
        self._engine = Engine(runner, limits, observer, on_failure=lambda: self._outbox.put(Failed()))
        self._handles: dict[int, Any] = {}
        self._stall_seconds = stall_seconds
        self._engine.start()

    def serve(self) -> None:
        while True:
            try:
                message: ToChild = self._conn.recv()
            except EOFError:
                message = Close()  # the server is gone: stop as it would have asked
            match message:
                case Stop(join_timeout_s):
                    self._engine.stop(join_timeout_s)  # its last iteration sends what is left
                    return
                case Close():
                    self._engine.stop(None)
                    return
                case Submit():
                    self._submit(message)
                case Warmup():
                    self._warmup()
                case Cancel(request_id, deadline_passed):
                    if (handle := self._handles.get(request_id)) is not None:
                        handle.cancel(deadline_passed=deadline_passed)

    def _submit(self, message: Submit) -> None:
        self._received += len(message.sentences)
        request_id = message.request_id

        def on_event(event: Event) -> None:
            if isinstance(event, RequestDone | RequestFailed):
                self._handles.pop(request_id, None)
            self._outbox.add_event(RequestEvent(request_id, event))

        try:  # admitted by the server already: only a race with a stopping or dying engine refuses it here
            self._handles[request_id] = self._engine.submit(
                message.sentences, message.options, on_event, message.deadline, message.lang_pair
            )
        except DrainingError:
            self._outbox.put(RequestEvent(request_id, RequestFailed(FailureReason.UNAVAILABLE, SHUTDOWN_MESSAGE)))
        except Exception:  # the client gets the fixed message; the cause goes to the log
            log.exception("the engine refused request %d", request_id)
            failed = RequestFailed(FailureReason.UNAVAILABLE, ENGINE_FAILED_MESSAGE)
            self._outbox.put(RequestEvent(request_id, failed))

    def _warmup(self) -> None:
        try:
            self._engine.warmup()
        except RuntimeError as err:
            self._outbox.put(Warm(str(err)))
            return
        if self._stall_seconds > 0:  # after warmup: a first call that builds kernels is not a hang
            start_stall_watch(self._engine, self._stall_seconds, threading.Event())
        freeze_startup_objects()  # a full collection then stalls decoding for what calls allocated alone
        self._outbox.put(Warm(None))
