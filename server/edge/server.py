"""The server's lifecycle: warm up the loaded models, serve gRPC with health, reflection and metrics, drain.

`create_server(config)` builds and starts a server on `config.serving.port` (0 = ephemeral, for tests) and
returns it with its bound port; `serve(config)` adds the metrics endpoint and SIGTERM/SIGINT
handling: health turns NOT_SERVING, in-flight requests get up to `drain_seconds` to finish, new
ones are answered UNAVAILABLE while the port stays open for `shutdown_delay_seconds`, then grpc stops
and the process exits.

Startup fails loudly (`StartupError`: one clear line, non-zero exit; `ConfigError`, a configuration mistake
such as a taken port or a path that holds no model: exit status 2, as for a bad flag) when the port is taken or
the model cannot be loaded; the port is bound without SO_REUSEPORT, so a second instance cannot share it.
Should the engine's loop die, or one of its iterations run past `--stall-seconds` (a hung runner),
every request it held fails UNAVAILABLE and health turns NOT_SERVING;
`serve` then stops the server and the process exits non-zero, so whatever supervises it (Docker's
restart policy, Kubernetes, systemd) starts a fresh one instead of keeping a replica that refuses all.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from server.core.engine import Engine
from server.core.engine_client import EngineClient
from server.core.gc_pauses import PAUSES, freeze_startup_objects
from server.core.response_cache import ResponseCache
from server.core.stall_watch import start_stall_watch
from server.edge.backends import Backend
from server.edge.config import ServerConfig
from server.edge.detect import SourceDetector
from server.edge.glossaries import GLOSSARY_DIR, GlossaryStore
from server.edge.loading import (
    ConfigError,
    LoadedModel,
    StartupError,
    checked_model_directories,
    load_models,
    request_limits,
)
from server.edge.metrics import Metrics, start_metrics_server
from server.edge.process_metrics import register_process_collectors
from server.edge.reflection import enable_reflection
from server.edge.routing import describe_directions
from server.edge.servicer import TranslatorServicer
from server.edge.tracing import Tracing, open_tracing
from server.edge.transport import (
    check_port_free,
    connection_options,
    interceptors,
    max_concurrent_rpcs,
    metrics_address,
    server_credentials,
)
from server.processes.engine_messages import GcCounts
from server.processes.engines import (
    child_gc_counts,
    child_pid,
    in_this_process,
    start_engine,
)
from server.processes.process_reports import REPORT_S, SELF, ProcessReport, write_report
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
_BIND_CAUSES = "the port taken (another instance?), or a host this machine has no address for"
T = TypeVar("T")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Translator"].full_name  # "translation.v1.Translator"
HEALTH_SERVICES = ("", SERVICE_NAME)  # "" is the whole server
MIN_STOP_GRACE_S = 1.0  # time to flush responses of requests that finished during the drain
ANSWERS_POLL_S = 0.01  # how often shutdown looks whether the service's handlers have all answered
MAX_LIFECYCLE_THREADS = 16  # loading, draining and stopping threads: engines drain side by side up to this many


class EngineDiedError(RuntimeError):
    """The decoding loop died while serving (its traceback is logged); the process must be restarted."""


class TranslationServer:
    """One grpc.aio server with the Translator, health and reflection services, and the engines of its models."""

    def __init__(
        self, config: ServerConfig, registry: CollectorRegistry | None = None, tracing: Tracing | None = None
    ) -> None:
        self.config = config
        # Loading, draining and stopping run on threads of their own (one per engine, so that engines drain
        # side by side): asyncio's default pool also splits and tokenizes requests, and a drain queued
        # behind that work would start late.
        self._lifecycle = ThreadPoolExecutor(max_workers=MAX_LIFECYCLE_THREADS, thread_name_prefix="lifecycle")
        # Set at shutdown: a model still being fetched or built stops at its next step (the loading thread would
        # otherwise keep the process alive until the build ends).
        self.stopping = threading.Event()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        # Until a model is loaded, the limits of the smallest engine the config allows (sized for the CPU).
        smallest = request_limits(config, config.engines.slots_for("cpu"), config.engines.queue_for("cpu"))
        glossaries = GlossaryStore(config.models.model_cache / GLOSSARY_DIR)  # beside the models: shared as they are
        self.servicer = TranslatorServicer(smallest, glossaries, self.metrics, tracing)
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]  # grpc-stubs lacks the aio module
        self.engines: dict[str, EngineClient] = {}  # by "<model name>#<replica>", in load order
        self.caches: dict[str, ResponseCache] = {}  # by model name
        self.engine_pids: dict[str, int] = {}  # "engine-<model name>#<replica>" -> pid, for engine processes
        self.engine_children: dict[str, EngineClient] = {}  # the same labels -> every engine, for their GC counts
        self.engine_died = asyncio.Event()  # set when an engine's loop dies or hangs; `serve` then exits
        self._stop_watching = threading.Event()  # ends every engine's stall watch
        self.credentials = server_credentials(config.security)
        self.server = grpc.aio.server(
            interceptors=interceptors(config.security, self.metrics),
            options=[
                ("grpc.max_receive_message_length", config.limits.max_message_bytes),
                ("grpc.max_send_message_length", config.limits.max_message_bytes),
                # Off, a second instance on the same port fails to start instead of sharing the traffic; on only
                # for the server processes of one `--processes` parent (server/edge/replicas.py).
                ("grpc.so_reuseport", int(config.serving.reuse_port)),
                *connection_options(config.serving),
            ],
            maximum_concurrent_rpcs=max_concurrent_rpcs(config.limits),
        )
        pb_grpc.add_TranslatorServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if config.serving.reflection:
            enable_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), self.server)

    async def start(self) -> int:
        """Bind and start answering (health says NOT_SERVING until `load` finishes); return the port."""
        if not self.engines:  # bound before loading: nothing served yet
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.serving.host}:{self.config.serving.port}"
        try:
            if self.credentials is None:
                port = self.server.add_insecure_port(address)
            else:
                port = self.server.add_secure_port(address, self.credentials)
        except RuntimeError as err:  # grpc raises when no address could be bound
            raise ConfigError(f"could not bind {address}: {_BIND_CAUSES} ({err})") from err
        if port == 0:
            raise ConfigError(f"could not bind {address}: {_BIND_CAUSES}")
        await self.server.start()
        return port

    @property
    def engine(self) -> Engine | None:
        """The first model's engine (the only one of a single-model server) when it runs in this process."""
        return in_this_process(next(iter(self.engines.values()), None))

    def children_gc(self) -> dict[str, GcCounts]:
        """The garbage collector counts of the engine processes that have reported them, by label."""
        reported = {label: child_gc_counts(engine) for label, engine in self.engine_children.items()}
        return {label: counts for label, counts in reported.items() if counts is not None}

    async def load(self, models: LoadedModel | Sequence[LoadedModel] | None = None) -> None:
        """Load (unless given) and warm up every model, each with an engine of its own, then turn SERVING."""
        if models is None:
            models = await self._off_loop(load_models, self.config, self.stopping.is_set)
        loaded = [models] if isinstance(models, LoadedModel) else list(models)
        backends = [await self._start_engine(model) for model in loaded]
        _log_serving(backends)
        sources = [source for model in loaded for source in model.runner.spec.directions.sources]
        self.servicer.attach(backends, SourceDetector(sources), first_turn=self.config.serving.process_index)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def _start_engine(self, model: LoadedModel) -> Backend:
        info = model.description
        config = self.config.engines
        # The runner was opened with the configured slots or its device's; a test's injected runner may have fewer.
        slots = min(config.max_slots or model.runner.max_slots, model.runner.max_slots)
        limits = config.limits_for("cuda" if info.provider == "CUDAExecutionProvider" else "cpu", slots)
        loop = asyncio.get_running_loop()

        def engine_failed() -> None:  # on the dying engine thread, or the one that abandoned it
            asyncio.run_coroutine_threadsafe(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING), loop)
            loop.call_soon_threadsafe(self.engine_died.set)

        observer = self.metrics.for_model(info.name)
        pid = child_pid(model.runner)
        engine = start_engine(model.runner, limits, observer, engine_failed, config.stall_seconds, config.engine_nice)
        replica = sum(1 for key in self.engines if key.rpartition("#")[0] == info.name)
        self.engines[f"{info.name}#{replica}"] = engine
        if pid is not None:
            self.engine_pids[f"engine-{info.name}#{replica}"] = pid
        # The GC counts of an engine process, or of a shared engine where this server is the one it reports to.
        self.engine_children[f"engine-{info.name}#{replica}"] = engine
        try:
            await self._off_loop(engine.warmup)
        except RuntimeError as err:
            raise StartupError(f"the model {info.name} does not run: {err}") from err
        # After warmup: a first call that builds kernels is not a hang. An engine process also watches its own.
        if config.stall_seconds > 0:
            start_stall_watch(engine, config.stall_seconds, self._stop_watching)
        self.metrics.set_model_info(info.name, info.variant, info.provider, info.opset)
        # The engine's slots, not the flag's: a runner with fewer caps the beam a request may ask for.
        limits_in_force = request_limits(self.config, slots, limits.max_queue_sentences)
        return Backend(engine, model.runner.spec, model.tokenizer, info, limits_in_force, self._cache_of(info.name))

    def _cache_of(self, model: str) -> ResponseCache | None:
        """The model's response cache, one for all its engines; None when --cache-size is 0."""
        limits = self.config.limits
        if limits.cache_size == 0:
            return None
        if model not in self.caches:
            observer = self.metrics.for_cache(model)
            self.caches[model] = ResponseCache(limits.cache_size, limits.cache_bytes, observer)
        return self.caches[model]

    async def shutdown(self, grace: float, delay: float = 0.0) -> bool:
        """NOT_SERVING, drain, then stop grpc; True if no in-flight work was cut off.

        In-flight and queued requests, and calls admitted before the drain began, get `grace` seconds to
        finish. Meanwhile the port stays open for `delay` seconds and the service answers every new call
        UNAVAILABLE with a retry pushback, so clients and balancers move to other replicas (what a
        Kubernetes preStop sleep does). grpc's stop begins only after both: it cancels calls it has
        received but not yet handed to the service, and by then every call that
        arrived before the signal has its answer; it then sends GOAWAY and waits for the last responses.
        """
        started = time.monotonic()
        self.stopping.set()
        await self.health.enter_graceful_shutdown()
        engines = list(self.engines.values())
        drains = await asyncio.gather(*(self._drain(engine, grace) for engine in engines))  # side by side
        drained = all(drains)
        await asyncio.sleep(delay - (time.monotonic() - started))  # returns at once when the drain outlasted it
        while self.metrics.calls_in_flight > 0 and time.monotonic() - started < grace:
            await asyncio.sleep(ANSWERS_POLL_S)  # the handlers still assembling and sending their answers
        # Calls that never end on their own (a client's open Health.Watch stream) do not hold the exit for the
        # rest of the grace: every answer is out, so gRPC stops after its short flush.
        await self.server.stop(MIN_STOP_GRACE_S)
        join_timeout = self.config.engines.stall_seconds or None  # a runner call hung past it is abandoned, not joined
        await asyncio.gather(*(self._off_loop(e.stop, join_timeout) for e in engines))  # joins the loop threads
        self._stop_watching.set()
        if not drained:
            logger.warning("drain grace of %.1f s ran out; unfinished requests were failed UNAVAILABLE", grace)
        return drained

    async def _drain(self, engine: EngineClient, grace: float) -> bool:
        """Finish the engine's work within `grace` (its watchdog still watches meanwhile); fail what is left
        UNAVAILABLE through its handlers, sent and counted as such, before grpc's stop could cancel them."""
        drained = await self._off_loop(engine.drain, grace)
        if not drained:
            await self._off_loop(engine.stop, self.config.engines.stall_seconds or None)
        return drained

    async def _off_loop(self, function: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._lifecycle, function, *args)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for name in HEALTH_SERVICES:
            await self.health.set(name, status)


def _log_serving(backends: list[Backend]) -> None:
    """One line per served model, however many engines run it: its variant, provider, engines and pairs."""
    for name in dict.fromkeys(b.model.name for b in backends):
        replicas = [b for b in backends if b.model.name == name]
        info = replicas[0].model
        engines = f"{len(replicas)} engine" + ("" if len(replicas) == 1 else "s")
        pairs = describe_directions(replicas[0].spec.directions)
        logger.info("serving %s (%s, %s, %s): %s", name, info.variant, info.provider, engines, pairs)


async def create_server(
    config: ServerConfig,
    model: LoadedModel | Sequence[LoadedModel] | None = None,
    registry: CollectorRegistry | None = None,
    tracing: Tracing | None = None,
) -> tuple[TranslationServer, int]:
    """A started, loaded and warmed-up server and its bound port; `model` defaults to the configured ones."""
    server = TranslationServer(config, registry, tracing)
    port = await server.start()
    try:
        await server.load(model)
    except BaseException:
        await server.shutdown(0.0)
        raise
    return server, port


async def serve(
    config: ServerConfig,
    model: LoadedModel | Sequence[LoadedModel] | None = None,
    on_serving: Callable[[], None] | None = None,
    report_to: Path | None = None,
    on_engine_died: Callable[[], None] | None = None,
) -> None:
    """Run until SIGTERM or SIGINT, then drain and return; `model` defaults to the configured ones;
    `on_serving` is called once every model is loaded and health says SERVING, `on_engine_died` when serving
    ends because an engine died or hung; with `report_to` (a server process of `--processes`), the processes
    behind this one are reported there for the parent's /metrics.

    Raises StartupError when loading fails and EngineDiedError when the decoding loop dies, after
    stopping the server either way.
    """
    if model is None:  # a configuration mistake is named before anything starts
        checked_model_directories(config.models)
    serving, observability = config.serving, config.observability
    if not serving.reuse_port:  # a server process of --processes shares the port its siblings hold
        check_port_free(serving.host, serving.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        tracing = open_tracing(observability.otlp_endpoint)
    except RuntimeError as err:
        raise StartupError(str(err)) from err
    server = TranslationServer(config, tracing=tracing)
    if observability.metrics_port >= 0:
        register_process_collectors(server.registry, lambda: server.engine_pids, server.children_gc)
        address = metrics_address(serving.host)
        try:
            metrics_port = start_metrics_server(observability.metrics_port, server.registry, address)
        except OSError as err:
            raise ConfigError(f"could not serve metrics on port {observability.metrics_port}: {err.strerror}") from err
        logger.info("metrics on :%d/metrics", metrics_port)
    # A server process of --processes binds its shared port once it can serve: the kernel hands new connections
    # to the bound sockets alone, so its siblings take them while it loads (bound first, a restarted process
    # answered its share of new connections "still loading" for as long as its models took)
    bind_when_loaded = serving.reuse_port
    if not bind_when_loaded:  # after the metrics port: a refusal there leaves no started gRPC server behind
        await _bind(server, config)
    reporting = None if report_to is None else asyncio.create_task(report_processes(server, report_to))
    loading = asyncio.create_task(server.load(model))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    failure = loading.exception() if loading.done() else None
    if failure is None and loading.done() and bind_when_loaded:
        try:
            await _bind(server, config)
        except StartupError as err:
            failure = err
    served = loading.done() and failure is None
    if served:  # serving: until a signal or the engine's death
        if on_serving is not None:
            on_serving()
        freeze_startup_objects()
        dying = asyncio.create_task(server.engine_died.wait())
        await asyncio.wait({stopping, dying}, return_when=asyncio.FIRST_COMPLETED)
        dying.cancel()
        if server.engine_died.is_set():
            failure = EngineDiedError("a decoding engine died or hung (logged above); restart the process")
            if on_engine_died is not None:
                on_engine_died()
    # A dead engine has answered its own requests UNAVAILABLE; the other models' engines drain theirs.
    grace = 0.0 if failure is not None and not isinstance(failure, EngineDiedError) else serving.drain_seconds
    # The port stays open past the drain only where balancers may still send: never to a server that never served
    delay = serving.shutdown_delay_seconds if served and failure is None else 0.0
    if failure is None:
        loading.cancel()  # a stop during loading: serve nothing; the loader stops before its next engine
        logger.info(
            "shutting down: draining for up to %.1f s, refusing new calls and closing the port after %.1f s",
            grace, delay,
        )  # fmt: skip
    stopping.cancel()
    await server.shutdown(grace, delay)
    if reporting is not None:
        reporting.cancel()
    if tracing is not None:
        await asyncio.get_running_loop().run_in_executor(None, tracing.shutdown)  # sends the last spans
    if failure is not None:
        raise failure


async def _bind(server: TranslationServer, config: ServerConfig) -> None:
    port = await server.start()
    logger.info(
        "gRPC on %s:%d (reflection %s, %s, bearer token %s)",
        config.serving.host,
        port,
        "on" if config.serving.reflection else "off",
        "mutual TLS" if config.security.tls_client_ca else "TLS" if config.security.tls_cert else "plaintext",
        "required" if config.security.auth_token_file else "not required",
    )


async def report_processes(server: TranslationServer, directory: Path) -> None:
    """Every REPORT_S, this front's GC counts and those of the engines it shows, written to `directory` for the
    parent of `--processes` (server.processes.process_reports)."""
    PAUSES.install()  # this process's collector pauses go with its GC counts
    while True:
        report = ProcessReport({SELF: GcCounts.now(), **server.children_gc()})
        try:
            write_report(directory, report)
        except OSError as err:  # the parent removed the directory as it exits: nothing reads it any more
            logger.debug("could not write the process report: %s", err)
        await asyncio.sleep(REPORT_S)


def run(
    config: ServerConfig,
    model: LoadedModel | None = None,
    on_serving: Callable[[], None] | None = None,
    report_to: Path | None = None,
    on_engine_died: Callable[[], None] | None = None,
) -> None:
    """`serve` until stopped; if it cannot start or its engine dies, exit with one line for the operator: status 2
    for a configuration mistake (as for a bad flag), else 1."""
    try:
        asyncio.run(serve(config, model, on_serving, report_to, on_engine_died))
    except ConfigError as err:
        logger.debug("the server stopped", exc_info=err)
        print(f"translate-server: {err}", file=sys.stderr)
        sys.exit(2)
    except (StartupError, EngineDiedError) as err:
        logger.debug("the server stopped", exc_info=err)
        sys.exit(f"translate-server: {err}")
