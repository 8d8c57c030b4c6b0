"""`translate-server`: load the exported model, warm it up, serve gRPC with health, reflection and metrics.

`create_server(config)` builds and starts a server on `config.port` (0 = ephemeral, for tests) and
returns it with its bound port; `serve(config)` adds the metrics endpoint and SIGTERM/SIGINT
handling: health turns NOT_SERVING, in-flight requests get up to `drain_seconds` to finish, new
ones are answered UNAVAILABLE while the port stays open for `shutdown_delay_seconds`, then grpc stops
and the process exits.

Startup fails loudly (`StartupError`: one clear line, non-zero exit) when the port is taken or the
model cannot be loaded; the port is bound without SO_REUSEPORT, so a second instance cannot share it.
Should the engine's loop die, or one of its iterations run past `--stall-seconds` (a hung runner),
every request it held fails UNAVAILABLE and health turns NOT_SERVING;
`serve` then stops the server and the process exits non-zero, so whatever supervises it (Docker's
restart policy, Kubernetes, systemd) starts a fresh one instead of keeping a replica that refuses all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from model.config import LANG_TAGS, ModelConfig
from model.languages import bcp47, parse
from model.tokenizer import TextTokenizer, open_tokenizer
from server.backend.engines import (
    OpenedGraphs,
    OpenedModel,
    RunnerSettings,
    child_pid,
    close_model,
    in_this_process,
    open_model,
    start_engine,
)
from server.core.documents import RequestLimits
from server.core.engine import Engine, EngineLimits
from server.core.engine_client import EngineClient
from server.core.response_cache import ResponseCache
from server.core.runner import ModelSpec
from server.core.splitter import PUNCTUATION, rule_for
from server.core.stall_watch import start_stall_watch
from server.edge.config import DEFAULT_MODEL_DIR, ServerConfig, parse_config
from server.edge.convert import DEFAULT_BEAM_SIZE, ModelDescription, language_pairs
from server.edge.detect import SourceDetector
from server.edge.interceptors import AuthInterceptor, Interceptor, ParseInterceptor
from server.edge.logs import configure_logging
from server.edge.metrics import Metrics, start_metrics_server
from server.edge.process_metrics import disable_created_metrics, register_process_collectors
from server.edge.servicer import Backend, TranslatorServicer
from server.edge.tracing import Tracing, open_tracing
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
T = TypeVar("T")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Translator"].full_name  # "translation.v1.Translator"
HEALTH_SERVICES = ("", SERVICE_NAME)  # "" is the whole server
MIN_STOP_GRACE_S = 1.0  # time to flush responses of requests that finished during the drain
MAX_LIFECYCLE_THREADS = 16  # loading, draining and stopping threads: engines drain side by side up to this many
NEVER_MS = 2**31 - 1  # the largest duration grpc takes (24.8 days), for a timer that is off


class StartupError(RuntimeError):
    """The server cannot start as configured; the message says why, for the operator."""


class ModelSourceError(StartupError):
    """A --model that cannot be served as named (unknown, unreachable, not importable): exit status 2."""


class EngineDiedError(RuntimeError):
    """The decoding loop died while serving (its traceback is logged); the process must be restarted."""


@dataclass(frozen=True)
class ModelSource:
    """A model directory to serve, the name requests route by, and the commit it was built from ("" if none)."""

    directory: Path
    name: str
    revision: str = ""


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve: its runner (or the process holding it), tokenizer and what ListModels reports."""

    runner: OpenedModel
    tokenizer: TextTokenizer
    description: ModelDescription


def resolve_provider(requested: str) -> str:
    """ "cuda" or "cpu": auto picks CUDA when onnxruntime offers its execution provider."""
    if requested != "auto":
        return requested
    import onnxruntime  # imported here: tests that inject a runner never load onnxruntime

    return "cuda" if "CUDAExecutionProvider" in onnxruntime.get_available_providers() else "cpu"


def model_directories(config: ServerConfig) -> list[Path]:
    """The directories to serve, in load order: each --model-dir, then every directory inside --models-dir
    that holds an export (onnx/), by name; none of these nor a --model given: the shipped model. An empty
    --models-dir beside another model is no error (an image's mount point with nothing mounted yet); with
    nothing to serve it is."""
    directories = list(config.model_dirs)
    if config.models_dir is None:
        return directories or ([] if config.models else [DEFAULT_MODEL_DIR])
    if not config.models_dir.is_dir():
        raise StartupError(f"models directory {config.models_dir} does not exist")
    found = sorted(d for d in config.models_dir.iterdir() if (d / "onnx").is_dir())
    if not found and not directories and not config.models:
        raise StartupError(f"no model directory (one with onnx/) in {config.models_dir}: nothing to serve")
    if not found:
        logger.warning("no model directory (one with onnx/) in %s", config.models_dir)
    return directories + found


def load_models(config: ServerConfig, stopped: Callable[[], bool] = lambda: False) -> list[LoadedModel]:
    """Every configured model, each under its name (a directory's, or the hub id of a --model), which must be
    unique, loaded once per engine (`engine_plan`): replicas of a model share its name and are listed one after
    the other. A --model still building or waiting for another replica's build gives up once `stopped()`."""
    sources = [ModelSource(d, d.resolve().name) for d in model_directories(config)] + fetch_models(config, stopped)
    names = [source.name for source in sources]
    if duplicated := sorted({n for n in names if names.count(n) > 1}):
        raise StartupError(f"two models share the name {duplicated}: rename a directory, names route requests")
    engines, threads = engine_plan(available_cores(), len(sources), resolve_provider(config.provider), config)
    logger.info("%d engine(s) per model, %s intra-op thread(s) each", engines, threads or "onnxruntime's default")
    each = replace(config, threads=threads)
    return [load_model(each, s.directory, s.name, s.revision) for s in sources for _ in range(engines)]


def fetch_models(config: ServerConfig, stopped: Callable[[], bool]) -> list[ModelSource]:
    """Each --model fetched, imported and built for the served variant, or found built in the cache."""
    if not config.models:
        return []
    try:  # the [import] extra: huggingface_hub and the graph builder
        from export.fetch import FetchError, HubSettings
        from export.hub import BuildError, ensure_model, plan_for
        from export.publish import Stopped
    except ImportError as err:
        raise ModelSourceError(f"--model needs pip install 'translate-service[import]' ({err})") from err
    from model.directory import int8_kernels

    plan = plan_for(config.variant, resolve_provider(config.provider), int8_kernels())
    cache = config.model_cache
    hub = HubSettings(config.hf_hub_cache, config.hf_offline)
    sources = []
    for model in config.models:
        try:
            built = ensure_model(model, plan, cache, hub, stopped)
        except (FetchError, BuildError) as err:
            raise ModelSourceError(str(err)) from err
        except Stopped as err:
            raise StartupError(f"{err}: the server is shutting down") from err
        except OSError as err:
            raise StartupError(f"cannot build {model} into the model cache {cache}: {err}") from err
        except Exception as err:  # a fault of the importer or exporter on this model: its traceback is logged
            logger.exception("building %s failed", model)
            raise StartupError(f"cannot build {model}: {type(err).__name__}: {err}") from err
        sources.append(ModelSource(built.directory, built.name, built.revision))
    return sources


def available_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may use: its affinity (taskset, cpusets), capped by a cgroup v2 CPU quota (a
    container's --cpus, a Kubernetes CPU limit), which the affinity does not show."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    return cores if quota == "max" else max(1, min(cores, -(-int(quota) // int(period))))


def engine_plan(cores: int, models: int, provider: str, config: ServerConfig) -> tuple[int, int]:
    """(engines per model, intra-op threads per engine). On CPU one single-threaded engine per core serves more
    than one engine with every core (docs/benchmarks.md, docs/service.md measure both): by default the cores are
    split between the models' engines. On CUDA one engine per model, the GPU's own parallelism doing the rest."""
    if provider != "cpu":
        return config.engines or 1, config.threads
    engines = config.engines or max(1, cores // (models * (config.threads or 1)))
    threads = config.threads or (max(1, cores // (engines * models)) if engines * models > 1 else 0)
    return engines, threads


def load_model(config: ServerConfig, model_dir: Path, name: str | None = None, revision: str = "") -> LoadedModel:
    """Open the configured variant of the exported model, named `name` (default: the directory's name);
    StartupError naming the cause if it cannot."""
    if not model_dir.is_dir():
        raise StartupError(f"model directory {model_dir} does not exist")
    build_missing_graphs(model_dir)
    try:
        return _open_model(config, model_dir, name or model_dir.resolve().name, revision)
    except Exception as err:  # missing files, bad metadata, corrupt graphs, a tokenizer that does not match
        raise StartupError(f"cannot load the model from {model_dir}: {type(err).__name__}: {err}") from err


def build_missing_graphs(model_dir: Path) -> None:
    """Build the graphs of a model directory that has weights and no export yet, as `python -m export` does
    (in its own process, so that the memory the build takes goes with it); the build needs no torch."""
    from model.directory import available_variants
    from model.files import CONFIG_FILE, WEIGHTS_FILE

    has_weights = all((model_dir / name).is_file() for name in (CONFIG_FILE, WEIGHTS_FILE))
    if available_variants(model_dir) or not has_weights:
        return
    command = [sys.executable, "-m", "export", "--model-dir", str(model_dir)]
    logger.info("no graphs exported in %s: building them (%s)", model_dir, " ".join(command[1:]))
    started = time.perf_counter()
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    if built.returncode != 0:
        last = (built.stderr.strip().splitlines() or ["no output"])[-1]
        raise StartupError(f"building the graphs of {model_dir} failed: {last}")
    logger.info("built the graphs of %s in %.1f s", model_dir, time.perf_counter() - started)


def _open_model(config: ServerConfig, model_dir: Path, name: str, revision: str) -> LoadedModel:
    # Every file comes from model_dir: the variant is one of a fixed set of names, never a path.
    from model.directory import (
        available_variants,
        choose_variant,
        direction_name,
        read_decoding_defaults,
        read_length_penalties,
    )

    provider = resolve_provider(config.provider)

    def open_on(provider: str) -> tuple[str, OpenedGraphs]:
        variant = choose_variant(model_dir, config.variant, provider)
        settings = RunnerSettings(
            model_dir / "onnx" / variant, config.max_slots, provider, config.threads, config.kv_cache,
            config.spin_threads,
        )  # fmt: skip
        return variant, open_model(settings, config.engine_processes)

    variant, runner = open_on(provider)
    if provider == "cuda" and runner.provider != "CUDAExecutionProvider":  # onnxruntime fell back to CPU
        why = f"onnxruntime could not run {variant} on CUDA and fell back to {runner.provider} (its log says why)"
        close_model(runner)  # a child holding the fallback session is not kept
        if config.provider == "cuda":  # asked for explicitly: never hold a GPU while computing on the CPU
            raise StartupError(f"{why}; fix the CUDA libraries or serve with --provider cpu")
        logger.warning("%s; --provider auto: serving on the CPU", why)
        provider = "cpu"
        variant, runner = open_on(provider)
    meta = runner.metadata
    directions = [direction_name(s, t) for s, t in language_pairs(runner.spec)]
    length_penalty = read_length_penalties(model_dir, directions, meta.source_sha256)
    beam_size, max_output_len = read_decoding_defaults(model_dir, meta.source_sha256)
    logger.info(
        "loaded %s variant %s on %s with %s caches (requested provider %s)",
        model_dir, variant, runner.provider, runner.kv_cache, provider,
    )  # fmt: skip
    description = ModelDescription(
        name=name,
        revision=revision,
        variant=variant,
        available_variants=available_variants(model_dir),
        provider=runner.provider,
        opset=int(meta.opset),
        model_sha256=str(meta.source_sha256),
        dtype=str(meta.dtype),
        default_length_penalty=length_penalty,
        default_beam_size=beam_size or DEFAULT_BEAM_SIZE,
        default_max_output_len=max_output_len or 0,
        target_tags=target_tags(runner.spec, ModelConfig.from_dict(meta.model_config)),
    )
    log_sentence_rules(name, runner.spec)
    tokenizer = load_tokenizer(model_dir, runner.spec, ModelConfig.from_dict(meta.model_config))
    return LoadedModel(runner, tokenizer, description)


def target_tags(spec: ModelSpec, cfg: ModelConfig) -> dict[str, str]:
    """The tag text the model reads in front of a source, by target code: `>>pob<<` (Marian) or `<2en>`."""
    if cfg.tokenizer == "marian":
        return {target: f">>{target}<<" for target in spec.tag_ids}
    return {target: LANG_TAGS[target] for target in spec.tag_ids if target in LANG_TAGS}


def log_sentence_rules(name: str, spec: ModelSpec) -> None:
    """Say which sentence rule each source language gets (pysbd's, or the punctuation fallback)."""
    for source in dict.fromkeys(s for s, _ in spec.pairs):
        rule = rule_for(source)
        how = f"pysbd's {rule!r} rules" if rule != PUNCTUATION else "the punctuation rule (pysbd has none)"
        group = " (a group: each request's own language code chooses)" if parse(source).is_group else ""
        logger.info("%s: source %s (%s) is split into sentences by %s%s", name, source, bcp47(source), how, group)


def load_tokenizer(model_dir: Path, spec: ModelSpec, cfg: ModelConfig) -> TextTokenizer:
    """The model's tokenizer: the files the exported graphs were trained or imported with, whose language
    tags and pairs are those the graphs know."""
    tokenizer = open_tokenizer(model_dir, cfg.tokenizer, cfg.tokenizer_sha256)
    if tokenizer.tag_ids != spec.tag_ids or tuple(tokenizer.pairs) != spec.pairs:
        raise ValueError(f"tokenizer tags {tokenizer.tag_ids} differ from the model's {spec.tag_ids}")
    return tokenizer


def request_limits(config: ServerConfig, slots: int) -> RequestLimits:
    """The documented limits, tightened to what this server's `slots` and queue can ever take: a request
    over them is refused INVALID_ARGUMENT (and ListModels says so), never "queue full, retry" forever."""
    documented = RequestLimits()
    return replace(
        documented,
        max_beam_size=min(documented.max_beam_size, slots),
        max_sentences=min(documented.max_sentences, config.max_queue),
        max_response_bytes=config.max_message_bytes,
    )


class TranslationServer:
    """One grpc.aio server with the Translator, health and reflection services, and one engine per model."""

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
        self.servicer = TranslatorServicer(request_limits(config, config.max_slots), self.metrics, tracing)
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]  # grpc-stubs lacks the aio module
        self.engines: dict[str, EngineClient] = {}  # by "<model name>#<replica>", in load order
        self.caches: dict[str, ResponseCache] = {}  # by model name
        self.engine_pids: dict[str, int] = {}  # "engine-<model name>#<replica>" -> pid, for engine processes
        self.engine_died = asyncio.Event()  # set when an engine's loop dies or hangs; `serve` then exits
        self._stop_watching = threading.Event()  # ends every engine's stall watch
        self.credentials = server_credentials(config)
        self.server = grpc.aio.server(
            interceptors=interceptors(config, self.metrics),
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
                # Off, a second instance on the same port fails to start instead of sharing the traffic; on only
                # for the server processes of one `--processes` parent (server/edge/replicas.py).
                ("grpc.so_reuseport", int(config.reuse_port)),
                *connection_options(config),
            ],
            maximum_concurrent_rpcs=max_concurrent_rpcs(config),
        )
        pb_grpc.add_TranslatorServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if config.reflection:
            names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, self.server)

    async def start(self) -> int:
        """Bind and start answering (health says NOT_SERVING until `load` finishes); return the port."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        try:
            if self.credentials is None:
                port = self.server.add_insecure_port(address)
            else:
                port = self.server.add_secure_port(address, self.credentials)
        except RuntimeError as err:  # grpc raises when no address could be bound
            raise StartupError(f"could not bind {address}; is another instance running? ({err})") from err
        if port == 0:
            raise StartupError(f"could not bind {address}; is another instance running?")
        await self.server.start()
        return port

    @property
    def engine(self) -> Engine | None:
        """The first model's engine (the only one of a single-model server) when it runs in this process."""
        return in_this_process(next(iter(self.engines.values()), None))

    async def load(self, models: LoadedModel | Sequence[LoadedModel] | None = None) -> None:
        """Load (unless given) and warm up every model, each with an engine of its own, then turn SERVING."""
        if models is None:
            models = await self._off_loop(load_models, self.config, self.stopping.is_set)
        loaded = [models] if isinstance(models, LoadedModel) else list(models)
        backends = [await self._start_engine(model) for model in loaded]
        sources = [source for model in loaded for source, _ in model.runner.spec.pairs]
        self.servicer.attach(backends, SourceDetector(sources))
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def _start_engine(self, model: LoadedModel) -> Backend:
        info = model.description
        slots = min(self.config.max_slots, model.runner.max_slots)
        limits = EngineLimits(max_slots=slots, max_queue_sentences=self.config.max_queue)
        loop = asyncio.get_running_loop()

        def engine_failed() -> None:  # on the dying engine thread, or the one that abandoned it
            asyncio.run_coroutine_threadsafe(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING), loop)
            loop.call_soon_threadsafe(self.engine_died.set)

        observer = self.metrics.for_model(info.name)
        engine = start_engine(model.runner, limits, observer, engine_failed, self.config.stall_seconds)
        replica = sum(1 for key in self.engines if key.rpartition("#")[0] == info.name)
        self.engines[f"{info.name}#{replica}"] = engine
        if (pid := child_pid(model.runner)) is not None:
            self.engine_pids[f"engine-{info.name}#{replica}"] = pid
        try:
            await self._off_loop(engine.warmup)
        except RuntimeError as err:
            raise StartupError(f"the model {info.name} does not run: {err}") from err
        # After warmup: a first call that builds kernels is not a hang. An engine process also watches its own.
        if self.config.stall_seconds > 0:
            start_stall_watch(engine, self.config.stall_seconds, self._stop_watching)
        self.metrics.set_model_info(info.name, info.variant, info.provider, info.opset)
        logger.info("serving %s (%s, %s): %s", info.name, info.variant, info.provider,
                    ", ".join(f"{s}-{t}" for s, t in model.runner.spec.pairs))  # fmt: skip
        # The engine's slots, not the flag's: a runner with fewer caps the beam a request may ask for.
        limits_in_force = request_limits(self.config, slots)
        return Backend(engine, model.runner.spec, model.tokenizer, info, limits_in_force, self._cache_of(info.name))

    def _cache_of(self, model: str) -> ResponseCache | None:
        """The model's response cache, one for all its engines; None when --cache-size is 0."""
        if self.config.cache_size == 0:
            return None
        if model not in self.caches:
            observer = self.metrics.for_cache(model)
            self.caches[model] = ResponseCache(self.config.cache_size, self.config.cache_bytes, observer)
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
        await self.server.stop(max(0.0, grace - (time.monotonic() - started)) + MIN_STOP_GRACE_S)
        join_timeout = self.config.stall_seconds or None  # a runner call hung past it is abandoned, not joined
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
            await self._off_loop(engine.stop, self.config.stall_seconds or None)
        return drained

    async def _off_loop(self, function: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._lifecycle, function, *args)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for name in HEALTH_SERVICES:
            await self.health.set(name, status)


def connection_options(config: ServerConfig) -> list[tuple[str, int]]:
    """grpc's HTTP/2 connection timers from the config (docs/reliability.md, "Connections", says why each default).

    Age: GOAWAY after it (gRPC adds +-10% jitter), calls in flight get the grace; clients dial again and
    re-resolve, so replicas the autoscaler adds get traffic from clients already connected. Idle:
    connections without calls close, and dial again on their next call. Keepalive: pings find a client
    gone without closing its connection and cancel its calls, freeing their slots before their deadline;
    pings are allowed on connections without calls too, both ways, so clients whose own keepalive is at
    least `min_ping_interval_s` keep their connections (gRPC's default answers such pings with GOAWAY).
    """
    options = [
        ("grpc.keepalive_time_ms", _ms(config.keepalive_time_s) or NEVER_MS),
        ("grpc.keepalive_timeout_ms", _ms(config.keepalive_timeout_s)),
        # grpc closes on an unanswered ping only once this one (default 1 min) has passed too
        ("grpc.http2.ping_timeout_ms", _ms(config.keepalive_timeout_s)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(config.min_ping_interval_s)),
    ]
    optional = [  # 0 = never: left to grpc, whose default is no limit
        ("grpc.max_connection_age_ms", config.max_connection_age_s),
        ("grpc.max_connection_age_grace_ms", config.max_connection_age_grace_s),
        ("grpc.max_connection_idle_ms", config.max_connection_idle_s),
    ]
    return options + [(name, _ms(seconds)) for name, seconds in optional if seconds > 0]


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def max_concurrent_rpcs(config: ServerConfig) -> int | None:
    """gRPC's own cap on calls in progress (None: no cap). Off by default: it counts health checks too,
    so a cap near what the queue holds would fail readiness probes under load, and its refusals come
    from gRPC, not the service, so they are neither counted in the metrics nor say "queue is full"."""
    return config.max_concurrent_rpcs or None


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured PEM files (client certificates required with a client CA)."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    client_ca = _read_file(config.tls_client_ca, "TLS client CA") if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(_read_file(config.tls_key, "TLS key"), _read_file(config.tls_cert, "TLS certificate"))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def interceptors(config: ServerConfig, metrics: Metrics) -> list[Interceptor]:
    """Authentication first (a refused call's request is never parsed), then request parsing."""
    chain: list[Interceptor] = [ParseInterceptor(metrics)]
    if config.auth_token_file is not None:
        token = _read_file(config.auth_token_file, "auth token file").decode().strip()
        if not token:
            raise StartupError(f"the auth token file {config.auth_token_file} is empty")
        chain.insert(0, AuthInterceptor(token, metrics))
    return chain


def _read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise StartupError(f"cannot read the {what} {path}: {err.strerror}") from err


def metrics_address(host: str) -> str:
    """The gRPC bind address as the metrics HTTP server takes it: "[::]" -> "::", "" -> every interface."""
    return host.strip("[]") or "0.0.0.0"


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
) -> None:
    """Run until SIGTERM or SIGINT, then drain and return; `model` defaults to the configured ones;
    `on_serving` is called once every model is loaded and health says SERVING.

    Raises StartupError when loading fails and EngineDiedError when the decoding loop dies, after
    stopping the server either way.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        tracing = open_tracing(config.otlp_endpoint)
    except RuntimeError as err:
        raise StartupError(str(err)) from err
    server = TranslationServer(config, tracing=tracing)
    port = await server.start()
    logger.info(
        "gRPC on %s:%d (reflection %s, %s, bearer token %s)",
        config.host,
        port,
        "on" if config.reflection else "off",
        "mutual TLS" if config.tls_client_ca else "TLS" if config.tls_cert else "plaintext",
        "required" if config.auth_token_file else "not required",
    )
    if config.metrics_port >= 0:
        register_process_collectors(server.registry, lambda: server.engine_pids)
        try:
            metrics_port = start_metrics_server(config.metrics_port, server.registry, metrics_address(config.host))
        except OSError as err:
            raise StartupError(f"could not serve metrics on port {config.metrics_port}: {err.strerror}") from err
        logger.info("metrics on :%d/metrics", metrics_port)
    loading = asyncio.create_task(server.load(model))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    failure = loading.exception() if loading.done() else None
    if loading.done() and failure is None:  # serving: until a signal or the engine's death
        if on_serving is not None:
            on_serving()
        dying = asyncio.create_task(server.engine_died.wait())
        await asyncio.wait({stopping, dying}, return_when=asyncio.FIRST_COMPLETED)
        dying.cancel()
        if server.engine_died.is_set():
            failure = EngineDiedError("a decoding engine died or hung (logged above); restart the process")
    if failure is None:
        loading.cancel()  # a stop during loading: serve nothing; the loader thread ends with the process
        logger.info(
            "shutting down: draining for up to %.1f s, refusing new calls and closing the port after %.1f s",
            config.drain_seconds, config.shutdown_delay_seconds,
        )  # fmt: skip
    stopping.cancel()
    # A dead engine has answered its own requests UNAVAILABLE; the other models' engines drain theirs.
    grace = 0.0 if failure is not None and not isinstance(failure, EngineDiedError) else config.drain_seconds
    delay = 0.0 if failure is not None else config.shutdown_delay_seconds
    await server.shutdown(grace, delay)
    if tracing is not None:
        await asyncio.get_running_loop().run_in_executor(None, tracing.shutdown)  # sends the last spans
    if failure is not None:
        raise failure


def main(argv: Sequence[str] | None = None) -> None:
    try:
        config = parse_config(argv, os.environ)
    except ValueError as err:
        sys.exit(f"translate-server: {err}")
    configure_logging(config.log_level, config.log_format)
    disable_created_metrics()
    if config.processes > 1:
        from server.edge.replicas import run_replicas

        sys.exit(run_replicas(config))
    run(config)


def run(config: ServerConfig, model: LoadedModel | None = None, on_serving: Callable[[], None] | None = None) -> None:
    """`serve` until stopped; exit 1 with one line for the operator if it cannot start or its engine dies."""
    try:
        asyncio.run(serve(config, model, on_serving))
    except ModelSourceError as err:  # bad input, as a bad flag is: status 2
        logger.debug("the server stopped", exc_info=err)
        print(f"translate-server: {err}", file=sys.stderr)
        sys.exit(2)
    except (StartupError, EngineDiedError) as err:
        logger.debug("the server stopped", exc_info=err)
        sys.exit(f"translate-server: {err}")


if __name__ == "__main__":
    main()
