"""An engine in a process of its own: how `translate-server` runs every engine.

The server process keeps gRPC, splitting, tokenizing and the metrics; each engine (its scheduler, its
onnxruntime sessions and its key/value caches) runs in a child process with an interpreter of its own,
so its Python between graph calls never waits for the server's interpreter lock, nor for the other
engines'. A request crosses the pipe once (token ids out, sent by a writer thread: `PipeWriter`); its
events come back in the one message an engine iteration sends when it has something to tell (`_Outbox`),
with the child's measurements for the server's metrics.

`ModelProcess` spawns the child (`server.processes.engine_child`), which opens the runner and reports what
the server shows and routes by (`RunnerFacts`); `ModelProcess.start_engine` then starts the child's
`Engine` and returns an `EngineProcess`, which the servicer uses as it uses an `Engine`: admission and
the queue bound are decided here, before anything crosses; drain waits here for every answer; a child
that dies answers every request it held UNAVAILABLE and tells the server (`on_failure`), as a dead engine
thread does. A stall is caught by the child's own watchdog, which abandons its engine as the server's
would. The child exits within a second of its server. What crosses the pipe is typed:
`server.processes.engine_messages`.

A shared engine is a `ModelProcess` the `--processes` parent spawns with a socket to listen on; each front
process reaches it with `SharedModel`, whose `EngineProcess` differs only in what
stands behind the pipe (`server.processes.child_links`: leaving closes the connection, not the engine).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.process
import multiprocessing.util
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress
from multiprocessing import current_process
from multiprocessing.connection import Client, Connection

from model.directory import ModelSpec
from server.core.admission_ledger import Admission, AdmissionLedger
from server.core.events import (
    ENGINE_FAILED_MESSAGE,
    SHUTDOWN_MESSAGE,
    EngineFailedError,
    EngineLimits,
    Event,
    FailureReason,
    RequestDone,
    RequestFailed,
)
from server.core.observer import EngineObserver
from server.core.work import DecodeOptions
from server.processes.child_links import ChildLink, OwnedChild, SharedChild, close_child, exit_description
from server.processes.engine_child import CLOSE_TIMEOUT_S, HEARTBEAT_S, RunnerSettings, serve_model
from server.processes.engine_messages import (
    Cancel,
    Failed,
    GcCounts,
    LoadReport,
    RequestEvent,
    RunnerFacts,
    StartEngine,
    StartFailed,
    Stop,
    Submit,
    ToChild,
    ToServer,
    Warm,
    Warmup,
)
from server.processes.pipe_writer import PipeWriter

__all__ = ["EngineProcess", "ModelProcess", "RunnerSettings", "SharedModel"]

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # opening the graphs; a large model on a slow disk takes a while
WARMUP_TIMEOUT_S = 180.0


def _kill_if_alive(process: multiprocessing.process.BaseProcess) -> None:
    if process.is_alive():
        process.kill()


class ModelProcess:
    """A child process holding one opened runner, until `start_engine` puts an engine over it."""

    def __init__(
        self, settings: RunnerSettings, start_timeout_s: float = START_TIMEOUT_S, listen_at: str | None = None
    ) -> None:
        """`listen_at`: a Unix socket path where the warm engine takes the fronts of `--processes`."""
        context = multiprocessing.get_context("spawn")  # never fork a process that runs gRPC's threads
        self._conn, child_end = context.Pipe()
        self._process = context.Process(
            target=serve_model, args=(child_end, settings, os.getpid(), listen_at), name="translation-engine",
            daemon=True,
        )  # fmt: skip
        self._process.start()
        # At the interpreter's exit multiprocessing terminates its daemonic children with SIGTERM and joins them
        # without a timeout; an engine ignores SIGTERM (it waits for its server's drain), so one the server never
        # stopped (a signal while the models were loading) would hold the exit forever: killed first instead.
        multiprocessing.util.Finalize(None, _kill_if_alive, args=(self._process,), exitpriority=10)
        child_end.close()  # the child holds its end: EOF here once it exits
        facts = self._await_start(settings, start_timeout_s)
        self.spec, self.metadata, self.max_slots = facts.spec, facts.metadata, facts.max_slots
        self.provider, self.kv_cache = facts.provider, facts.kv_cache
        log.info("engine process %d holds %s", self._process.pid, settings.variant_dir)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def sentinel(self) -> int:
        """Ready (`multiprocessing.connection.wait`) once the child has exited."""
        return self._process.sentinel

    @property
    def exitcode(self) -> int | None:
        """None while the child runs."""
        return self._process.exitcode

    def join(self, timeout_s: float) -> None:
        """Wait for the child to exit: its sentinel is ready once its files close, its exit status a moment
        later."""
        self._process.join(timeout_s)

    def describe_exit(self) -> str:
        return exit_description(self._process)

    def start_engine(
        self, limits: EngineLimits, metrics: EngineObserver | None, on_failure: Callable[[], None] | None,
        stall_seconds: float, nice: int,
    ) -> EngineProcess:  # fmt: skip
        """Start the child's engine, the whole child `nice` steps lower; the returned proxy owns the pipe
        from now on."""
        self._conn.send(StartEngine(limits, stall_seconds, nice))
        return EngineProcess(self._conn, OwnedChild(self._process), self.spec, limits, metrics, on_failure)

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
        if isinstance(reply, StartFailed):
            raise RuntimeError(reply.reason)  # the child's own account of why it could not open the runner
        why = "timed out" if self._process.exitcode is None else exit_description(self._process)
        raise RuntimeError(f"the engine process for {settings.variant_dir} did not start ({why})")


class EngineProcessHandle:
    """The submitter's grip on a request in an engine process (`server.core.engine.RequestHandle`)."""

    def __init__(self, engine: EngineProcess, request_id: int) -> None:
        self._engine = engine
        self.request_id = request_id

    def cancel(self, deadline_passed: bool = False) -> None:
        with suppress(OSError):  # the child is gone: its requests are answered already
            self._engine._send(Cancel(self.request_id, deadline_passed))


class EngineProcess:
    """The server's side of an engine in a child process; used as a `server.core.engine.Engine`."""

    def __init__(
        self, conn: Connection, child: ChildLink, spec: ModelSpec, limits: EngineLimits,
        metrics: EngineObserver | None, on_failure: Callable[[], None] | None,
    ) -> None:  # fmt: skip
        self._conn, self._child, self._metrics, self._on_failure = conn, child, metrics, on_failure
        self._writer = PipeWriter(conn, "engine-process-writer")  # no send ever waits on the child here
        # The child's garbage collector as of its last report: replaced whole by the receiving thread.
        self.gc_counts: GcCounts | None = None
        self._cond = threading.Condition()  # guards everything below
        self._owners: dict[int, Callable[[Event], None]] = {}  # each request's on_event
        self._next_id = 1
        self._sent_sentences = 0  # sentences submitted to the child, ever
        self._child_received = 0  # of those, what its last load report had seen
        self._child_queue = self._child_active = 0  # its scheduler's queue and active slots at that report
        self._load_observed = False  # whether this server shows the child's load (a shared engine's: one server)
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
        """As `Engine.submit` (the request validated at the edge); events arrive on `on_event` from this
        proxy's reader thread."""
        with self._cond:
            self._ledger.accept(len(sentences), self._queued(), self._failed, self._stopping, self._draining, admitted)
            request_id, self._next_id = self._next_id, self._next_id + 1
            if not self._owners:  # an idle child says nothing: its silence counts from its first work
                self._last_heard = time.monotonic()
            self._owners[request_id] = on_event
            self._sent_sentences += len(sentences)
            if self._metrics is not None and self._load_observed:  # the queue grows even while the child is silent
                self._metrics.set_load(self._queued(), self._child_active)
            # Queued under _cond: the child receives submissions in the order they were counted.
            try:
                self._send(Submit(request_id, sentences, options, deadline, lang_pair))
            except OSError:  # the child is gone; the reader is about to answer what it held
                del self._owners[request_id]
                raise EngineFailedError(ENGINE_FAILED_MESSAGE) from None
        return EngineProcessHandle(self, request_id)

    def warmup(self) -> None:
        """The child's `Engine.warmup`, waited for here."""
        self._send(Warmup())
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
            self._send(Stop(join_timeout_s))
        self._reader.join(None if join_timeout_s is None else join_timeout_s + CLOSE_TIMEOUT_S)
        if not self._writer.close(CLOSE_TIMEOUT_S):  # a child that reads nothing: nothing else may write its pipe
            self._child.kill()
            self._writer.close(CLOSE_TIMEOUT_S)
        self._child.close(self._conn)
        self._reader.join()
        self._fail_owners(RequestFailed(FailureReason.UNAVAILABLE, SHUTDOWN_MESSAGE))

    def abandon_if_stalled(self, limit_s: float, now: float) -> float | None:
        """If the child, holding requests, has been silent over `limit_s` past its heartbeat (it reports at
        least every `HEARTBEAT_S` while it iterates), kill it: the reader then answers its requests UNAVAILABLE and
        tells the server, as for a child that died. Returns how long it was silent, else None.

        This catches what the child's own watchdog cannot: a child stopped, or hung with its interpreter
        lock held; a child that reads nothing sent to it (a send waiting that long) counts as silent too."""
        with self._cond:
            silent = max(now - self._last_heard, self._writer.stuck_for(now))
            if self._failed or self._stopping or not self._owners or silent <= limit_s + HEARTBEAT_S:
                return None
        log.critical("engine process %s has been silent for %.1f s while holding requests", self._child.pid, silent)
        self._child.kill()
        return silent

    # -- the pipe ------------------------------------------------------------------------------------

    def _send(self, message: ToChild) -> None:
        """Queue `message` for the writer thread: never waits for the child (OSError once it is gone)."""
        self._writer.put(message)

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
                        log.exception("handling %r from engine process %s failed", message, self._child.pid)
        except (EOFError, OSError):
            pass
        with self._cond:
            expected = self._stopping
            if not expected:
                self._failed = self._draining = True
        if not expected:
            log.critical("engine process %s ended (%s)", self._child.pid, self._child.describe_exit())
            self._die()

    def _handle(self, message: ToServer) -> None:
        match message:
            case RequestEvent(request_id, event):
                self._deliver(request_id, event)
            case LoadReport(queue, active, received, observed):
                with self._cond:
                    self._child_queue, self._child_active, self._child_received = queue, active, received
                    self._load_observed = observed
                    if self._metrics is not None and observed:  # what it has not seen yet is queued too
                        self._metrics.set_load(self._queued(), active)
            case Warm(error):
                self._warm_error = error
                self._warm.set()
            case GcCounts():
                self.gc_counts = message
            case Failed():  # its loop died or stalled: it has answered its requests; the server must go
                with self._cond:
                    self._failed = self._draining = True
                self._die()
            case _:  # a measurement
                if self._metrics is not None:
                    message.apply(self._metrics)

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


class SharedModel:
    """A front process's attachment to an engine of the `--processes` parent: the engine's facts, then, with
    `start_engine`, an `EngineProcess` over the connection. The engine is started and warm already."""

    def __init__(self, address: str, answer_timeout_s: float = START_TIMEOUT_S) -> None:
        """Connect (the parent started the engine before this server process: a refusal means it is gone)."""
        self._conn = Client(address, family="AF_UNIX", authkey=current_process().authkey)
        facts = self._conn.recv() if self._conn.poll(answer_timeout_s) else None
        if not isinstance(facts, RunnerFacts):
            self._conn.close()
            raise RuntimeError(f"the shared engine at {address} did not answer")
        self.spec, self.metadata, self.max_slots = facts.spec, facts.metadata, facts.max_slots
        self.provider, self.kv_cache, self.pid = facts.provider, facts.kv_cache, facts.pid
        log.info("attached to shared engine process %d at %s", facts.pid, address)

    def start_engine(
        self, limits: EngineLimits, metrics: EngineObserver | None, on_failure: Callable[[], None] | None,
    ) -> EngineProcess:  # fmt: skip
        """The engine as this server's `EngineProcess`: its admission bounded by `limits` against the shared
        queue, which every server's load reports count."""
        return EngineProcess(self._conn, SharedChild(self.pid), self.spec, limits, metrics, on_failure)

    def close(self) -> None:
        """Leave the engine before starting it (a model that failed to load beside it)."""
        SharedChild(self.pid).close(self._conn)
