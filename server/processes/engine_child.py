"""The child's side of an engine process: open the runner, run an `Engine` over it, answer the server.

`serve_model` is the process's entry point. Messages are `server.processes.engine_messages`; the engine's
events and measurements leave in one pipe message per engine iteration that has something to tell
(`_Outbox`). The child watches its own engine for stalls and exits within a second of its server (for a shared
engine, its parent). A shared engine answers each server process connected to its socket over that connection
(`_Front`), its measurements going to the first of them only.
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
from multiprocessing import AuthenticationError, current_process
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.core.engine import Engine
from server.core.events import (
    ENGINE_FAILED_MESSAGE,
    SHUTDOWN_MESSAGE,
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
from server.processes.engine_messages import (
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
from server.processes.parent_watch import follow_parent
from server.processes.priority import lower_process_priority

if TYPE_CHECKING:
    from server.backend.runtime import OnnxRunner

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0
HEARTBEAT_S = 1.0  # the longest an iterating engine process stays silent


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


def serve_model(conn: Connection, settings: RunnerSettings, parent_pid: int, listen_at: str | None = None) -> None:
    """The child: open the runner, report its facts, run an engine over it and answer the server; with
    `listen_at` (a Unix socket path), answer every front process of `--processes` that connects there instead,
    `conn` then carrying only the parent's start, warmup and stop."""
    follow_parent(parent_pid, lambda: os._exit(1))  # an engine without its server holds memory for nothing
    # Ctrl-C, and SIGTERM sent to the process group (systemd's default KillMode, `timeout`, supervisord's
    # stopasgroup), reach the engines too: the server drains first, then stops them over the pipe
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        runner = settings.open()
    except Exception as err:
        conn.send(StartFailed(f"{type(err).__name__}: {err}"))
        return
    facts = RunnerFacts(runner.spec, runner.metadata, runner.provider, runner.kv_cache, runner.max_slots, os.getpid())
    conn.send(facts)
    try:
        start = conn.recv()
    except EOFError:
        return
    if not isinstance(start, StartEngine):
        return
    lower_process_priority(start.nice)
    PAUSES.install()  # its collector's pauses go with its GC counts
    if listen_at is None:
        child = _ChildEngine(runner, start.limits, start.stall_seconds, shared=False)
        child.serve(child.add_front(conn), owner=True)
    else:
        child = _ChildEngine(runner, start.limits, start.stall_seconds, shared=True)
        child.serve_shared(conn, listen_at, facts)


class _Outbox:
    """Messages for one server process. The engine thread appends its events and measurements and sends them
    all at the end of an iteration, with its load report (`put`): one pipe message per iteration, written by
    the thread that has them. An iteration that changed nothing the server acts on (no event, the same load)
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
            with suppress(OSError):  # the server is gone: its reader sees the pipe close and it leaves
                self._conn.send(batch)


class _Front:
    """One server process the engine answers: its pipe, the requests it holds here and what it has sent."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.outbox = _Outbox(conn)
        self.handles: dict[int, Any] = {}  # its request ids -> their engine handles, until their final event
        self.lock = threading.Lock()  # orders a handle's keeping (front thread) and removal (engine thread)
        self.received = 0  # sentences received from it, ever (reported with each load)
        self.last_load: LoadReport | None = None
        self.last_sent = 0.0  # monotonic time of its last load report


class _ForwardingObserver:
    """The engine's observer in the child. Every front gets the load (its admission counts on it); one, the
    first still connected, reports the measurements, the load it shows and the GC counts, so that metrics
    summed over server processes count each engine once."""

    def __init__(self, fronts: Callable[[], tuple[_Front, ...]]) -> None:
        self._fronts = fronts
        self._reporter: _Front | None = None
        self._capacity: CapacitySet | None = None
        self._last_gc: GcCounts | None = None
        self._load = (0, 0)  # the queue depth and active slots of the engine's last iteration

    def _reporting(self, fronts: tuple[_Front, ...] | None = None) -> _Front | None:
        """The front that reports (of `fronts`, else the connected ones); a new one first gets the capacity
        the engine set."""
        fronts = self._fronts() if fronts is None else fronts
        reporter = fronts[0] if fronts else None
        if reporter is not self._reporter:
            self._reporter, self._last_gc = reporter, None
            if reporter is not None and self._capacity is not None:
                reporter.outbox.add(self._capacity)
        return reporter

    def _add(self, item: ToServer) -> None:
        if (reporter := self._reporting()) is not None:
            reporter.outbox.add(item)

    def set_capacity(self, max_slots: int) -> None:
        self._capacity = CapacitySet(max_slots)
        self._add(self._capacity)

    def set_load(self, queue_depth: int, active_slots: int) -> None:
        """The end of every iteration: send each front what it must see now (see `_Outbox`), and at least one
        report a `HEARTBEAT_S` while iterating, so that it can tell a busy engine from a hung one."""
        self._load = (queue_depth, active_slots)
        fronts = self._fronts()
        reporter = self._reporting(fronts)
        gc_counts = GcCounts.now()  # goes with the next message: an idle child collects next to nothing
        if reporter is not None and gc_counts != self._last_gc:
            self._last_gc = gc_counts
            reporter.outbox.add(gc_counts)
        now = time.monotonic()
        for front in fronts:
            load = LoadReport(queue_depth, active_slots, front.received, observed=front is reporter)
            if load != front.last_load or front.outbox.has_events or now - front.last_sent >= HEARTBEAT_S:
                front.last_load, front.last_sent = load, now
                front.outbox.put(load)

    def front_added(self) -> None:
        """A server process connected: it gets the load now (and, reporting, the capacity), not at the next
        iteration, which an idle engine does not run."""
        self.set_load(*self._load)

    def observe_queue_waits(self, waits: Iterable[float]) -> None:
        self._add(QueueWaits(tuple(waits)))

    def observe_step(self, stats: StepStats) -> None:
        self._add(StepObserved(stats))

    def observe_sentence(self, lang_pair: str, input_tokens: int, output_tokens: int) -> None:
        self._add(SentenceObserved(lang_pair, input_tokens, output_tokens))

    def observe_abandoned(self, lang_pair: str, reason: str, queued: int, decoding: int) -> None:
        self._add(AbandonedObserved(lang_pair, reason, queued, decoding))


class _ChildEngine:
    """The child's engine and the loops that answer its server processes: one that owns it, or, shared, every
    one that connects to its socket (the parent's pipe then starts, warms and stops it)."""

    def __init__(self, runner: OnnxRunner, limits: EngineLimits, stall_seconds: float, shared: bool) -> None:
        self._shared = shared
        # Replaced whole under the lock, never changed in place: the engine thread reads it every iteration
        # without taking the lock
        self._fronts: tuple[_Front, ...] = ()
        self._fronts_lock = threading.Lock()
        self._observer = _ForwardingObserver(self.fronts)
        self._engine = Engine(runner, limits, self._observer, on_failure=self._failed)
        self._stall_seconds = stall_seconds
        self._warm = False
        self._engine.start()

    def fronts(self) -> tuple[_Front, ...]:
        return self._fronts

    def add_front(self, conn: Connection) -> _Front:
        front = _Front(conn)
        with self._fronts_lock:
            self._fronts = (*self._fronts, front)
        self._observer.front_added()
        return front

    def serve(self, front: _Front, owner: bool) -> None:
        """Answer one server process until it leaves; the owner's Stop or leaving also stops the engine."""
        while True:
            try:
                message: ToChild = front.conn.recv()
            except (EOFError, OSError):
                message = Close()  # the server is gone: stop (or leave) as it would have asked
            match message:
                case Stop(join_timeout_s) if owner:
                    self._engine.stop(join_timeout_s)  # its last iteration sends what is left
                    return
                case Close() if owner:
                    self._engine.stop(None)
                    return
                case Stop() | Close():
                    self._leave(front)
                    return
                case Submit():
                    self._submit(front, message)
                case Warmup():
                    self._warmup(front.outbox)
                case Cancel(request_id, deadline_passed):
                    if (handle := front.handles.get(request_id)) is not None:
                        handle.cancel(deadline_passed=deadline_passed)

    def serve_shared(self, control: Connection, address: str, facts: RunnerFacts) -> None:
        """Warm up on the parent's word, then take server processes on `address` until the parent stops it."""
        listener: Listener | None = None
        while True:
            try:
                message: ToChild = control.recv()
            except (EOFError, OSError):
                message = Close()
            match message:
                case Warmup():
                    error = self._warm_up()
                    if error is None and listener is None:
                        listener = Listener(address, family="AF_UNIX", authkey=current_process().authkey)
                        threading.Thread(target=self._accept, args=(listener, facts), daemon=True).start()
                    control.send([Warm(error)])
                case Stop(join_timeout_s):
                    self._engine.stop(join_timeout_s)
                    break
                case Close():
                    self._engine.stop(None)
                    break
        if listener is not None:
            listener.close()

    def _accept(self, listener: Listener, facts: RunnerFacts) -> None:
        """Each server process that connects (with the parent's key) gets the facts, then a loop of its own."""
        while True:
            try:
                conn = listener.accept()
                conn.send(facts)
            except AuthenticationError:
                log.warning("refused a connection to the shared engine without the server's key")
                continue
            except OSError:  # the listener closed: the engine is stopping
                return
            front = self.add_front(conn)
            threading.Thread(target=self.serve, args=(front, False), name="front", daemon=True).start()

    def _leave(self, front: _Front) -> None:
        """A server process left: its requests free their slots (nobody is left to answer)."""
        with self._fronts_lock:
            self._fronts = tuple(f for f in self._fronts if f is not front)
        with front.lock:
            handles = list(front.handles.values())
        for handle in handles:
            handle.cancel()
        with suppress(OSError):
            front.conn.close()

    def _failed(self) -> None:
        """The engine's loop died or stalled: it has answered its requests; every server must know. A shared
        engine then exits: its parent sees it go and stops the server for the orchestrator to restart."""
        for front in self.fronts():
            front.outbox.put(Failed())
        if self._shared:
            os._exit(1)

    def _submit(self, front: _Front, message: Submit) -> None:
        front.received += len(message.sentences)
        request_id = message.request_id
        ended = False  # its final event came (possibly before `submit` returned its handle)

        def on_event(event: Event) -> None:
            nonlocal ended
            if isinstance(event, RequestDone | RequestFailed):
                with front.lock:
                    ended = True
                    front.handles.pop(request_id, None)
            front.outbox.add_event(RequestEvent(request_id, event))

        try:  # admitted by the server already: only a race with a stopping or dying engine refuses it here
            handle = self._engine.submit(
                message.sentences, message.options, on_event, message.deadline, message.lang_pair
            )
            with front.lock:
                if not ended:  # else kept forever: nothing would remove it
                    front.handles[request_id] = handle
        except DrainingError:
            front.outbox.put(RequestEvent(request_id, RequestFailed(FailureReason.UNAVAILABLE, SHUTDOWN_MESSAGE)))
        except Exception:  # the client gets the fixed message; the cause goes to the log
            log.exception("the engine refused request %d", request_id)
            failed = RequestFailed(FailureReason.UNAVAILABLE, ENGINE_FAILED_MESSAGE)
            front.outbox.put(RequestEvent(request_id, failed))

    def _warmup(self, outbox: _Outbox) -> None:
        """A server's warmup: the engine's own, once (a shared engine warmed up before it listened)."""
        outbox.put(Warm(self._warm_up()))

    def _warm_up(self) -> str | None:
        if self._warm:
            return None
        try:
            self._engine.warmup()
        except RuntimeError as err:
            return str(err)
        if self._stall_seconds > 0:  # after warmup: a first call that builds kernels is not a hang
            start_stall_watch(self._engine, self._stall_seconds, threading.Event())
        freeze_startup_objects()  # a full collection then stalls decoding for what calls allocated alone
        self._warm = True
        return None
