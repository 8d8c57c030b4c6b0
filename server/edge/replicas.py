"""`translate-server --processes N`: N front processes on one port over the engine processes this parent starts,
supervised by it.

Each front process is a whole server (gRPC, validation, preparation, health, drain, stall watchdog) whose port
is bound with SO_REUSEPORT, so the kernel hands each new client connection to one of them; every front reaches
every engine over its Unix socket (`server.edge.shared_engines`), so that each step gathers the calls of all of
them. A client's calls follow its connection (gRPC keeps one per channel), and `--max-connection-age-s` has
clients reconnect, and spread again, every few minutes. The parent:

- refuses, as a single server does (one line, status 2), a model directory that holds no model and a port
  another server holds; then starts and warms the engines (one line, status 1, where a model cannot load) and
  spawns the fronts, each with the parsed config and the engines' sockets (`replica_config`);
- serves /metrics for all of them: prometheus-client's multiprocess mode, every process writing its series
  to files in a private directory that the parent's collector sums (gauges over live processes only);
- on SIGTERM/SIGINT passes SIGTERM to every front, which drains as a single server does, stops the engines once
  the last front has drained, and exits: 0 if every one drained cleanly, else 1;
- restarts a front that dies while serving, and an engine that dies at its socket (the fronts that ended with
  it are started again without counting them), up to RESTART_LIMIT times in RESTART_WINDOW_S; more often, or a
  front that fails to start, stops all and exits 1 for the orchestrator to act on.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from contextlib import suppress
from dataclasses import dataclass, replace
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event as ProcessEvent
from pathlib import Path
from types import FrameType

from server.edge.config import ServerConfig, SharedEngines
from server.edge.loading import ConfigError, StartupError, checked_model_directories
from server.edge.logs import configure_logging
from server.edge.metrics import forget_process, start_multiprocess_metrics_server
from server.edge.process_metrics import disable_created_metrics
from server.edge.server import run
from server.edge.shared_engines import SharedEngine, start_shared_engines, stop_shared_engines
from server.edge.transport import check_port_free, metrics_address
from server.processes.parent_watch import follow_parent

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # where prometheus-client's multiprocess mode keeps its files
RESTART_LIMIT = 3  # restarts within the window before the parent gives up
RESTART_WINDOW_S = 300.0
# A server process that ends because its engine died, this soon after a shared engine was started again, is
# restarted without counting: the engine's restart was counted (a hung engine is killed, so it restarts too)
ENGINE_RESTART_GRACE_S = 60.0
ENGINE_EXIT_WAIT_S = 5.0  # how long the parent waits for a shared engine's exit to show
POLL_S = 0.2  # how often the parent looks at its signals while no process exits


@dataclass
class ServerProcess:
    """One spawned server and the event it sets once it serves."""

    index: int
    process: SpawnProcess
    serving: ProcessEvent
    engine_lost: ProcessEvent  # set if it stops serving because an engine died or hung


def replica_config(config: ServerConfig) -> ServerConfig:
    """A front process's config: one process, the port shared, no metrics server of its own; the engines are the
    parent's, which `Supervisor.share` adds."""
    serving = replace(config.serving, processes=1, reuse_port=True)
    return replace(config, serving=serving, observability=replace(config.observability, metrics_port=-1))


def serve_replica(config: ServerConfig, serving: ProcessEvent, engine_lost: ProcessEvent, parent: int) -> None:
    """A server process's entry point (spawned: a fresh interpreter that reads MULTIPROC_ENV at import)."""
    configure_logging(config.observability.log_level, config.observability.log_format)
    disable_created_metrics()
    stop_with_parent(parent)
    run(config, on_serving=serving.set, report_to=Path(os.environ[MULTIPROC_ENV]), on_engine_died=engine_lost.set)


def stop_with_parent(parent: int) -> None:
    """SIGTERM to this process once the parent is gone (killed, it cannot stop us), so that no server process
    keeps the port alone; it then drains as on any SIGTERM."""
    follow_parent(parent, lambda: os.kill(os.getpid(), signal.SIGTERM))


class Supervisor:
    """Starts the server processes, restarts one that dies while serving (and a shared engine that dies), and stops
    them all on a signal."""

    def __init__(self, config: ServerConfig, metrics_dir: str) -> None:
        self.config = config
        self.engines: list[SharedEngine] = []  # every front's (`share`)
        self.metrics_dir = metrics_dir
        self.context = multiprocessing.get_context("spawn")
        self.stopping = threading.Event()
        self.failure: str | None = None
        self.restarts: deque[float] = deque()
        self.engine_restarted_at = -ENGINE_RESTART_GRACE_S  # when a shared engine was last started again
        # "server-<index>" -> pid of each running server process, "engine-<model>#<replica>" of each shared
        # engine: the processes whose CPU and memory the metrics show
        self.pids: dict[str, int] = {}

    def share(self, engines: list[SharedEngine], sockets: tuple[SharedEngines, ...]) -> None:
        """Have every server process use these engines, reached at these sockets."""
        self.engines = engines
        self.config = replace(self.config, serving=replace(self.config.serving, engine_sockets=sockets))
        self.pids.update({e.label: e.process.pid for e in engines if e.process.pid is not None})

    def start(self, index: int) -> ServerProcess:
        serving, engine_lost = self.context.Event(), self.context.Event()
        config = replace(self.config, serving=replace(self.config.serving, process_index=index))
        process = self.context.Process(
            target=serve_replica,
            args=(config, serving, engine_lost, os.getpid()),
            name=f"translate-server-{index}",
        )
        process.start()
        logger.info("server process %d started (pid %s)", index, process.pid)
        if process.pid is not None:
            self.pids[f"server-{index}"] = process.pid
        return ServerProcess(index, process, serving, engine_lost)

    def stop_all(self, running: dict[int, ServerProcess]) -> None:
        for server in running.values():
            if server.process.is_alive() and server.process.pid is not None:
                os.kill(server.process.pid, signal.SIGTERM)

    def run(self, count: int) -> int:
        running = {index: self.start(index) for index in range(count)}
        told_to_stop = False
        while running:
            if self.stopping.is_set() and not told_to_stop:
                logger.info("stopping %d server process(es): each drains its requests", len(running))
                self.stop_all(running)
                told_to_stop = True
            multiprocessing.connection.wait(
                [s.process.sentinel for s in running.values()] + [e.process.sentinel for e in self.engines],
                timeout=POLL_S,
            )
            self.check_engines()
            for server in [s for s in running.values() if not s.process.is_alive()]:
                del running[server.index]
                self.ended(server, running)
        if self.failure is not None:
            logger.error("%s", self.failure)
            return 1
        return 0

    def check_engines(self) -> None:
        """Start a shared engine that died again, at its socket, within the restart budget (every server process
        has answered its requests UNAVAILABLE and ends, to be restarted by `ended`); past the budget, or if it
        cannot start, stop all."""
        gone = multiprocessing.connection.wait([e.process.sentinel for e in self.engines], timeout=0)
        for engine in [e for e in self.engines if e.process.sentinel in gone]:
            engine.process.join(ENGINE_EXIT_WAIT_S)  # its exit status follows its sentinel by a moment
            self.engines.remove(engine)
            with suppress(Exception):  # closes the parent's pipe to it; nothing is left to answer
                engine.stop()
            self.pids.pop(engine.label, None)
            if engine.process.pid is not None:
                forget_process(engine.process.pid, self.metrics_dir)
            if self.stopping.is_set():
                continue
            reason = f"shared engine {engine.label} ended ({engine.exit_reason()})"
            if not self.may_restart():
                self.give_up(f"{reason}: stopping the server after {len(self.restarts)} restarts in "
                             f"{RESTART_WINDOW_S:.0f} s")  # fmt: skip
                return
            logger.warning("%s: starting it again", reason)
            try:
                restarted = engine.relaunch()
            except StartupError as err:
                self.give_up(f"{reason}, and could not start again: {err}")
                return
            self.engines.append(restarted)
            self.engine_restarted_at = time.monotonic()
            if restarted.process.pid is not None:
                self.pids[restarted.label] = restarted.process.pid

    def engine_restarted_lately(self) -> bool:
        return time.monotonic() - self.engine_restarted_at < ENGINE_RESTART_GRACE_S

    def may_restart(self) -> bool:
        """Whether the budget allows one more restart (RESTART_LIMIT in RESTART_WINDOW_S); counts it if so."""
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > RESTART_WINDOW_S:
            self.restarts.popleft()
        if len(self.restarts) >= RESTART_LIMIT:
            return False
        self.restarts.append(now)
        return True

    def ended(self, server: ServerProcess, running: dict[int, ServerProcess]) -> None:
        """Account for a server process that exited: restart it, or stop everything."""
        server.process.join()
        self.pids.pop(f"server-{server.index}", None)
        if server.process.pid is not None:
            forget_process(server.process.pid, self.metrics_dir)
        code = server.process.exitcode
        if self.stopping.is_set():
            if code != 0:
                self.failure = self.failure or f"server process {server.index} exited with {code} while stopping"
            return
        if not server.serving.is_set():
            self.give_up(f"server process {server.index} failed to start (exit code {code}; its log says why)")
            return
        if server.engine_lost.is_set() and self.engines and not self.engine_restarted_lately():
            # it saw its engine go before the parent did: the engine starts again first, then it attaches to it
            multiprocessing.connection.wait([e.process.sentinel for e in self.engines], timeout=ENGINE_EXIT_WAIT_S)
            self.check_engines()
            if self.stopping.is_set():
                return
        if server.engine_lost.is_set() and self.engine_restarted_lately():
            logger.warning("server process %d ended with its shared engine: starting it again", server.index)
        elif not self.may_restart():
            self.give_up(f"server processes died {len(self.restarts) + 1} times in {RESTART_WINDOW_S:.0f} s")
            return
        else:
            logger.warning("server process %d exited with %s while serving: starting it again", server.index, code)
        running[server.index] = self.start(server.index)

    def give_up(self, reason: str) -> None:
        self.failure = reason
        self.stopping.set()

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping.set()


def run_replicas(config: ServerConfig) -> int | str:
    """Serve with `--processes` server processes until stopped; the exit status, or a one-line reason."""
    try:
        checked_model_directories(config.models)
        check_port_free(config.serving.host, config.serving.port)
        child = replica_config(config)
    except StartupError as err:
        return _refused(err)
    metrics_dir = tempfile.mkdtemp(prefix="translate-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir  # inherited by every spawned process
    supervisor = Supervisor(child, metrics_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, supervisor.on_signal)
    socket_dir: Path | None = None
    try:
        if (failure := _serve_metrics(config, supervisor, metrics_dir)) is not None:
            return failure  # before any engine loads: a taken port costs no model load
        try:
            engines, sockets, socket_dir = start_shared_engines(config, supervisor.stopping.is_set)
        except StartupError as err:
            return _refused(err)
        supervisor.share(engines, sockets)
        return _supervise(config, supervisor)
    finally:
        stop_shared_engines(supervisor.engines)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)


def _refused(err: StartupError) -> int | str:
    """The exit of a server that cannot start, as a single server's: one line, status 2 for a configuration
    mistake (the line printed here), else the line itself (status 1)."""
    if isinstance(err, ConfigError):
        print(f"translate-server: {err}", file=sys.stderr)
        return 2
    return f"translate-server: {err}"


def _serve_metrics(config: ServerConfig, supervisor: Supervisor, metrics_dir: str) -> str | None:
    """The parent's /metrics, summing every server process's; the one-line reason where it cannot be served."""
    metrics_port = config.observability.metrics_port
    if metrics_port < 0:
        return None
    try:
        address = metrics_address(config.serving.host)
        port = start_multiprocess_metrics_server(metrics_port, metrics_dir, address, supervisor.pids.copy)
    except OSError as err:
        return f"translate-server: could not serve metrics on port {metrics_port}: {err.strerror}"
    logger.info("metrics of all server processes on :%d/metrics", port)
    return None


def _supervise(config: ServerConfig, supervisor: Supervisor) -> int | str:
    serving = config.serving
    logger.info("%d server processes on %s:%d sharing %d engine(s)",
                serving.processes, serving.host, serving.port, len(supervisor.engines))  # fmt: skip
    return supervisor.run(serving.processes)
