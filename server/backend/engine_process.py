"""An engine in a process of its own: `translate-server --engine-processes`.

The server process keeps gRPC, splitting, tokenizing and the metrics; each engine (its scheduler, its
onnxruntime sessions and its key/value caches) runs in a child process with an interpreter of its own,
so its Python between graph calls never waits for the server's interpreter lock, nor for the other
engines'. A request crosses the pipe once (token ids out); its events come back in the one message an
engine iteration sends when it has something to tell (`_Outbox`), with the child's measurements for the
server's metrics.

`ModelProcess` spawns the child, which opens the runner and reports what the server shows and routes by
(`RunnerFacts`); `ModelProcess.start_engine` then starts the child's `Engine` and returns an
`EngineProcess`, which the servicer uses as it uses an `Engine`: admission and the queue bound are decided
here, before anything crosses; drain waits here for every answer; a child that dies answers every request
it held UNAVAILABLE and tells the server (`on_failure`), as a dead engine thread does. A stall is caught
by the child's own watchdog, which abandons its engine as the server's would. The child exits within a
second of its server.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model.directory import ExportMetadata, ModelSpec
from server.core.engine import (
    ENGINE_FAILED_MESSAGE,
    Admission,
    AdmissionLedger,
    DecodeOptions,
    DrainingError,
    Engine,
    EngineFailedError,
    EngineLimits,
    Event,
    FailureReason,
    RequestDone,
    RequestFailed,
)
from server.core.observer import EngineObserver, StepStats
from server.core.scheduler import Scheduler

if TYPE_CHECKING:
    from server.backend.runtime import OnnxRunner

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # opening the graphs; a large model on a slow disk takes a while
WARMUP_TIMEOUT_S = 180.0
CLOSE_TIMEOUT_S = 5.0
PARENT_POLL_S = 1.0  # how often a child checks that its server is still there
HEARTBEAT_S = 1.0  # the longest an iterating engine process stays silent
SHUTDOWN_MESSAGE = "the server is shutting down"


@dataclass(frozen=True)
class RunnerSettings:
    """What a child needs to open its runner (`server.backend.runtime.open_runner`'s arguments)."""

    variant_dir: Path
    max_slots: int
    provider: str
    intra_op_threads: int
    kv_cache: str
    spin_threads: bool

    def open(self) -> OnnxRunner:
        from server.backend.runtime import open_runner  # onnxruntime loads where the runner runs

        return open_runner(
            self.variant_dir, self.max_slots, self.provider, self.intra_op_threads, self.kv_cache,
            spin_threads=self.spin_threads,
        )  # fmt: skip


@dataclass(frozen=True)
class RunnerFacts:
    """What the child's runner reports once open."""

    spec: ModelSpec
    metadata: ExportMetadata
    provider: str
    kv_cache: str
    max_slots: int


class ModelProcess:
    """A child process holding one opened runner, until `start_engine` puts an engine over it."""

    def __init__(self, settings: RunnerSettings, start_timeout_s: float = START_TIMEOUT_S) -> None:
        context = multiprocessing.get_context("spawn")  # never fork a process that runs gRPC's threads
        self._conn, child_end = context.Pipe()
        self._process = context.Process(
            target=serve_model, args=(child_end, settings, os.getpid()), name="translation-engine", daemon=True
        )
        self._process.start()
        child_end.close()  # the child holds its end: EOF here once it exits
        facts = self._await_start(settings, start_timeout_s)
        self.spec, self.metadata, self.max_slots = facts.spec, facts.metadata, facts.max_slots
        self.provider, self.kv_cache = facts.provider, facts.kv_cache
        log.info("engine process %d holds %s", self._process.pid, settings.variant_dir)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def start_engine(
        self, limits: EngineLimits, metrics: EngineObserver | None, on_failure: Callable[[], None] | None,
        stall_seconds: float,
    ) -> EngineProcess:  # fmt: skip
        """Start the child's engine; the returned proxy owns the pipe from now on."""
        self._conn.send((limits, stall_seconds))
        return EngineProcess(self._conn, self._process, self.spec, limits, metrics, on_failure)

    def close(self) -> None:
        """Stop the child; kill it if it does not exit in time."""
        close_child(self._conn, self._process)

    def _await_start(self, settings: RunnerSettings, timeout_s: float) -> RunnerFacts:
        try:
            reply = self._conn.recv() if self._conn.poll(timeout_s) else None
        except (EOFError, OSError):
            reply = None
        if isinstance(reply, RunnerFacts):
            return reply
        self.close()
        if reply is None:
            why = "timed out" if self._process.exitcode is None else exit_description(self._process)
            raise RuntimeError(f"the engine process for {settings.variant_dir} did not start ({why})")
        raise RuntimeError(str(reply))  # the child's own account of why it could not open the runner


class EngineProcessHandle:
    """The submitter's grip on a request in an engine process (`server.core.engine.RequestHandle`)."""

    def __init__(self, engine: EngineProcess, request_id: int) -> None:
        self._engine = engine
        self.request_id = request_id

    def cancel(self, deadline_passed: bool = False) -> None:
        with suppress(OSError):  # the child is gone: its requests are answered already
            self._engine._send(("cancel", self.request_id, deadline_passed))


class EngineProcess:
    """The server's side of an engine in a child process; used as a `server.core.engine.Engine`."""

    def __init__(
        self, conn: Connection, process: multiprocessing.process.BaseProcess, spec: ModelSpec, limits: EngineLimits,
        metrics: EngineObserver | None, on_failure: Callable[[], None] | None,
    ) -> None:  # fmt: skip
        self._conn, self._process, self._metrics, self._on_failure = conn, process, metrics, on_failure
        self._validator = Scheduler(spec, limits)  # validate() only: pure, reads the spec and the limits
        self._send_lock = threading.Lock()  # submits (event loop) and lifecycle calls share the pipe
        self._cond = threading.Condition()  # guards everything below
        self._owners: dict[int, Callable[[Event], None]] = {}  # each request's on_event
        self._next_id = 1
        self._sent_sentences = 0  # sentences submitted to the child, ever
        self._child_received = 0  # of those, what its last load report had seen
        self._child_queue = self._child_active = 0  # its scheduler's queue and active slots at that report
        self._ledger = AdmissionLedger(limits.max_queue_sentences)
        self._draining = self._stopping = self._failed = False
        self._last_heard = time.monotonic()  # when the child's last message came
        self._warm: threading.Event = threading.Event()
        self._warm_error: str | None = None
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()

    # -- what the servicer and the server read, as of an Engine ------------------------------------

    @property
    def load(self) -> int:
        with self._cond:
            return self._queued() + self._ledger.reserved_sentences + self._child_active

    @property
    def draining(self) -> bool:
        with self._cond:
            return self._draining or self._stopping

    @property
    def failed(self) -> bool:
        with self._cond:
            return self._failed

    def _queued(self) -> int:
        """Sentences waiting for slots: the child's last report plus what was sent since (under _cond)."""
        return self._child_queue + self._sent_sentences - self._child_received

    # -- the Engine interface ----------------------------------------------------------------------

    def admission(self, sentences: int = 0) -> AbstractContextManager[Admission]:
        """As `Engine.admission`: queue places held from before the request is split until it submits."""

        def reserve() -> Admission:  # under the lock
            return self._ledger.reserve(sentences, self._queued(), self._failed, self._draining or self._stopping)

        return self._ledger.held(self._cond, reserve)

    def submit(
        self,
        sentences: list[list[int]],
        options: DecodeOptions,
        on_event: Callable[[Event], None],
        deadline: float | None = None,
        lang_pair: str = "",
        *,
        admitted: Admission | None = None,
    ) -> EngineProcessHandle:
        """As `Engine.submit`; events arrive on `on_event` from this proxy's reader thread."""
        self._validator.validate(sentences, options)
        with self._cond:
            self._ledger.accept(len(sentences), self._queued(), self._failed, self._stopping, self._draining, admitted)
            request_id, self._next_id = self._next_id, self._next_id + 1
            if not self._owners:  # an idle child says nothing: its silence counts from its first work
                self._last_heard = time.monotonic()
            self._owners[request_id] = on_event
            self._sent_sentences += len(sentences)
            # Sent under _cond: the child receives submissions in the order they were counted.
            try:
                self._send(("submit", request_id, sentences, options, deadline, lang_pair))
            except OSError:  # the child is gone; the reader is about to answer what it held
                del self._owners[request_id]
                raise EngineFailedError(ENGINE_FAILED_MESSAGE) from None
        return EngineProcessHandle(self, request_id)

    def warmup(self) -> None:
        """The child's `Engine.warmup`, waited for here."""
        self._send(("warmup",))
        if not self._warm.wait(WARMUP_TIMEOUT_S):
            raise RuntimeError("warmup did not finish: timed out")
        if self._warm_error is not None:
            raise RuntimeError(self._warm_error)

    def drain(self, timeout: float) -> bool:
        """Admit nothing new; wait up to `timeout` s for every answer; True if all came."""
        with self._cond:
            self._draining = True
            return self._cond.wait_for(lambda: not self._owners and not self._ledger.admitted_calls, timeout)

    def stop(self, join_timeout_s: float | None = None) -> None:
        """Stop the child's engine (it answers what it holds UNAVAILABLE) and the child; answer anything
        still owed here, should the child not have."""
        with self._cond:
            self._draining = self._stopping = True
        with suppress(OSError):  # the child is gone already; the reader answers its requests
            self._send(("stop", join_timeout_s))
        self._reader.join(None if join_timeout_s is None else join_timeout_s + CLOSE_TIMEOUT_S)
        close_child(self._conn, self._process)
        self._reader.join()
        self._fail_owners(RequestFailed(FailureReason.UNAVAILABLE, SHUTDOWN_MESSAGE))

    def abandon_if_stalled(self, limit_s: float, now: float) -> float | None:
        """If the child, holding requests, has been silent over `limit_s` past its heartbeat (it reports at
        least every `HEARTBEAT_S` while it iterates), kill it: the reader then answers its requests UNAVAILABLE and
        tells the server, as for a child that died. Returns how long it was silent, else None.

        This catches what the child's own watchdog cannot: a child stopped, or hung with its interpreter
        lock held."""
        with self._cond:
            silent = now - self._last_heard
            if self._failed or self._stopping or not self._owners or silent <= limit_s + HEARTBEAT_S:
                return None
        log.critical("engine process %s has been silent for %.1f s while holding requests", self._process.pid, silent)
        self._process.kill()
        return silent

    # -- the pipe ------------------------------------------------------------------------------------

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        """Hand the child's messages on until its pipe closes; a close not asked for is a dead engine."""
        try:
            while True:
                messages = self._conn.recv()
                with self._cond:
                    self._last_heard = time.monotonic()
                for message in messages:
                    try:
                        self._handle(message)
                    except Exception:  # one bad callback must not silence every later answer
                        log.exception("handling %r from engine process %s failed", message[0], self._process.pid)
        except (EOFError, OSError):
            pass
        with self._cond:
            expected = self._stopping
            if not expected:
                self._failed = self._draining = True
        if not expected:
            log.critical("engine process %s ended (%s)", self._process.pid, exit_description(self._process))
            self._die()

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "event":
            self._deliver(message[1], message[2])
        elif kind == "load":
            _, queue, active, received = message
            with self._cond:
                self._child_queue, self._child_active, self._child_received = queue, active, received
            if self._metrics is not None:
                self._metrics.set_load(queue, active)
        elif kind == "metric":
            if self._metrics is not None:
                getattr(self._metrics, message[1])(*message[2])
        elif kind == "warm":
            self._warm_error = message[1]
            self._warm.set()
        elif kind == "failed":  # its loop died or stalled: it has answered its requests; the server must go
            with self._cond:
                self._failed = self._draining = True
            self._die()

    def _deliver(self, request_id: int, event: Event) -> None:
        final = isinstance(event, RequestDone | RequestFailed)
        with self._cond:
            on_event = self._owners.pop(request_id, None) if final else self._owners.get(request_id)
            if final:
                self._cond.notify_all()
        if on_event is not None:
            on_event(event)

    def _die(self) -> None:
        self._fail_owners(RequestFailed(FailureReason.UNAVAILABLE, ENGINE_FAILED_MESSAGE))
        if self._on_failure is not None:
            try:
                self._on_failure()
            except Exception:
                log.exception("the engine failure callback raised")

    def _fail_owners(self, event: RequestFailed) -> None:
        with self._cond:
            owners, self._owners = list(self._owners.values()), {}
            self._cond.notify_all()
        for on_event in owners:
            on_event(event)


def close_child(conn: Connection, process: multiprocessing.process.BaseProcess) -> None:
    """Tell the child to stop, wait for it, kill it if it does not exit; close the pipe."""
    with suppress(OSError):  # already gone
        conn.send(None)
    process.join(CLOSE_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()


def exit_description(process: multiprocessing.process.BaseProcess) -> str:
    process.join(0.5)
    code = process.exitcode
    if code is None:
        return "still running, its pipe closed"
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


# -- the child -----------------------------------------------------------------------------------------


class _Outbox:
    """Messages for the server. The engine thread appends its events and measurements and sends them all at
    the end of an iteration, with its load report (`put`): one pipe message per iteration, written by the
    thread that has them. An iteration that changed nothing the server acts on (no event, the same load)
    sends nothing: its measurements wait for the next message."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._items: list[tuple[Any, ...]] = []
        self._has_events = False  # an event is queued: the end of this iteration must send
        self._lock = threading.Lock()  # also orders the sends of the engine thread and the main thread

    @property
    def has_events(self) -> bool:
        return self._has_events

    def add(self, *item: Any) -> None:
        """Queue a measurement for the next send."""
        with self._lock:
            self._items.append(item)

    def add_event(self, *item: Any) -> None:
        """Queue an event: it goes with this iteration's load report."""
        with self._lock:
            self._items.append(item)
            self._has_events = True

    def put(self, *item: Any) -> None:
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
        self._last_load: tuple[int, int, int] | None = None
        self._last_sent = 0.0  # monotonic time of the last load report

    def set_capacity(self, max_slots: int) -> None:
        self._outbox.put("metric", "set_capacity", (max_slots,))

    def set_load(self, queue_depth: int, active_slots: int) -> None:
        """The end of every iteration: send what the server must see now (see `_Outbox`), and at least one
        report a `HEARTBEAT_S` while iterating, so that the server can tell a busy engine from a hung one."""
        load = (queue_depth, active_slots, self._received())
        now = time.monotonic()
        if load != self._last_load or self._outbox.has_events or now - self._last_sent >= HEARTBEAT_S:
            self._last_load, self._last_sent = load, now
            self._outbox.put("load", *load)

    def observe_queue_waits(self, waits: Iterable[float]) -> None:
        self._outbox.add("metric", "observe_queue_waits", (tuple(waits),))

    def observe_step(self, stats: StepStats) -> None:
        self._outbox.add("metric", "observe_step", (stats,))

    def observe_sentence(self, lang_pair: str, input_tokens: int, output_tokens: int) -> None:
        self._outbox.add("metric", "observe_sentence", (lang_pair, input_tokens, output_tokens))

    def observe_abandoned(self, lang_pair: str, reason: str, queued: int, decoding: int) -> None:
        self._outbox.add("metric", "observe_abandoned", (lang_pair, reason, queued, decoding))


def serve_model(conn: Connection, settings: RunnerSettings, parent_pid: int) -> None:
    """The child: open the runner, report its facts, run an engine over it and answer the server."""
    _exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server drains first
    try:
        runner = settings.open()
    except Exception as err:
        conn.send(f"{type(err).__name__}: {err}")
        return
    conn.send(RunnerFacts(runner.spec, runner.metadata, runner.provider, runner.kv_cache, runner.max_slots))
    try:
        start = conn.recv()
    except EOFError:
        return
    if start is None:
        return
    limits, stall_seconds = start
    _ChildEngine(conn, runner, limits, stall_seconds).serve()


class _ChildEngine:
    """The child's engine and the loop that answers the server's messages."""

    def __init__(self, conn: Connection, runner: OnnxRunner, limits: EngineLimits, stall_seconds: float) -> None:
        self._conn = conn
        self._received = 0  # sentences received from the server, ever (reported with each load)
        self._outbox = _Outbox(conn)
        observer = _ForwardingObserver(self._outbox, lambda: self._received)
        self._engine = Engine(runner, limits, observer, on_failure=partial(self._outbox.put, "failed"))
        self._handles: dict[int, Any] = {}
        self._stall_seconds = stall_seconds
        self._engine.start()

    def serve(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except EOFError:
                message = None  # the server is gone: stop as it would have asked
            if message is None or message[0] == "stop":
                self._engine.stop(None if message is None else message[1])  # its last iteration sends what is left
                return
            self._dispatch(message)

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "submit":
            _, request_id, sentences, options, deadline, lang_pair = message
            self._received += len(sentences)
            on_event = partial(self._event, request_id)
            try:  # admitted by the server already: only a race with a stopping or dying engine refuses it here
                self._handles[request_id] = self._engine.submit(sentences, options, on_event, deadline, lang_pair)
            except DrainingError:
                self._outbox.put("event", request_id, RequestFailed(FailureReason.UNAVAILABLE, SHUTDOWN_MESSAGE))
            except Exception:  # the client gets the fixed message; the cause goes to the log
                log.exception("the engine refused request %d", request_id)
                self._outbox.put("event", request_id, RequestFailed(FailureReason.UNAVAILABLE, ENGINE_FAILED_MESSAGE))
        elif kind == "cancel":
            if (handle := self._handles.get(message[1])) is not None:
                handle.cancel(deadline_passed=message[2])
        elif kind == "warmup":
            try:
                self._engine.warmup()
            except RuntimeError as err:
                self._outbox.put("warm", str(err))
                return
            if self._stall_seconds > 0:  # after warmup: a first call that builds kernels is not a hang
                threading.Thread(target=self._watch, name="stall-watch", daemon=True).start()
            self._outbox.put("warm", None)

    def _event(self, request_id: int, event: Event) -> None:
        if isinstance(event, RequestDone | RequestFailed):
            self._handles.pop(request_id, None)
        self._outbox.add_event("event", request_id, event)

    def _watch(self) -> None:
        limit_s = self._stall_seconds
        period = min(1.0, limit_s / 4)
        while not self._engine.failed:
            time.sleep(period)
            if (stalled_s := self._engine.abandon_if_stalled(limit_s, time.monotonic())) is not None:
                log.critical("a runner call has run for %.1f s (--stall-seconds %.1f): the runner is hung",
                             stalled_s, limit_s)  # fmt: skip
                return


def _exit_with_parent(parent_pid: int) -> None:
    """Exit once the server is gone, even from inside a hung call: an engine without its server holds memory
    for nothing. (Not PR_SET_PDEATHSIG: it fires when the spawning *thread* ends, and servers spawn engines
    from worker threads.)"""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
