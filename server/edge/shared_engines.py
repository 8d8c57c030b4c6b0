"""The engine processes of `translate-server --processes N`: started once, by the parent, for every front process
to use.

The parent opens each model's engines in processes of their own (`server.processes.engine_process.ModelProcess`
with a socket), warms them, and hands their Unix socket paths to the fronts (`ServingConfig.engine_sockets`);
each front connects to every engine and uses it as a single server uses its own engine process
(`server.processes.engine_process.SharedModel`), and every step gathers the calls of all of them. Each front's
admission counts the shared queue (every front gets the engine's load reports); one front, the first connected,
shows the engine's measurements in the metrics.

An engine that dies answers the requests it held UNAVAILABLE in every front, and each front then exits (a front
ends when one of its engines does); the parent starts the engine again at the same socket
(`SharedEngine.relaunch`), then the fronts, which attach to it, counting the engine's restart against the same
budget as a front's (`server.edge.replicas`); past it the parent stops the server (exit 1) for the orchestrator
to act. An engine that hangs dies the same way: the front that finds it silent while holding requests kills it
(`SharedChild.kill`). The sockets live in a private directory (mode 0700) and take only connections that prove
the parent's key (`multiprocessing`'s authkey, which its spawned processes inherit).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from server.edge.config import EnginesConfig, ServerConfig, SharedEngines
from server.edge.loading import (
    StartupError,
    available_cores,
    build_missing_graphs,
    engine_plan,
    model_sources,
    resolve_provider,
)
from server.processes.engines import EngineProcess, ModelProcess, RunnerSettings

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0  # the fronts have drained before the engines stop: nothing is left to answer


@dataclass
class SharedEngine:
    """One running shared engine: its process and the parent's pipe to it."""

    label: str  # "engine-<model name>#<replica>", as a single server labels its engine processes
    process: ModelProcess
    control: EngineProcess
    relaunch: Callable[[], SharedEngine]  # the same engine started again, at the same socket, warm

    def stop(self) -> None:
        self.control.stop(STOP_TIMEOUT_S)

    def exit_reason(self) -> str:
        return self.process.describe_exit()


def start_shared_engines(
    config: ServerConfig, stopped: Callable[[], bool] = lambda: False
) -> tuple[list[SharedEngine], tuple[SharedEngines, ...], Path]:
    """Open, start and warm every model's engines (`engine_plan` over the whole node), each listening on a socket
    in a new private directory; the engines, what the fronts attach to, and that directory."""
    socket_dir = Path(tempfile.mkdtemp(prefix="translate-engines-"))  # mode 0700
    engines: list[SharedEngine] = []
    try:
        sources = model_sources(config, stopped)
        engine_config = config.engines
        provider = resolve_provider(engine_config.provider)
        per_model, threads = engine_plan(available_cores(), len(sources), provider, engine_config)
        shared = []
        for source in sources:
            build_missing_graphs(source.directory, engine_config.variant, provider)
            variant = _variant(source.directory, engine_config.variant, provider)
            slots = engine_config.slots_for(provider)
            settings = RunnerSettings(
                source.directory / "onnx" / variant, slots, provider, threads, engine_config.kv_cache,
                engine_config.spin_threads,
            )  # fmt: skip
            sockets = []
            for replica in range(per_model):
                socket = str(socket_dir / f"engine-{len(engines)}.sock")
                engines.append(_launch(engine_config, settings, provider, f"engine-{source.name}#{replica}", socket))
                sockets.append(socket)
            shared.append(SharedEngines(source.directory, source.name, source.revision, variant, tuple(sockets)))
    except BaseException:
        stop_shared_engines(engines)
        raise
    logger.info(
        "%d shared engine process(es) per model, %s intra-op thread(s) each, at nice %d",
        per_model, threads or "onnxruntime's default", engine_config.engine_nice,
    )  # fmt: skip
    return engines, tuple(shared), socket_dir


def _variant(model_dir: Path, requested: str, provider: str) -> str:
    from model.directory import choose_variant

    try:
        return choose_variant(model_dir, requested, provider)
    except Exception as err:
        raise StartupError(f"cannot load the model from {model_dir}: {type(err).__name__}: {err}") from err


def _launch(config: EnginesConfig, settings: RunnerSettings, provider: str, label: str, socket: str) -> SharedEngine:
    """Start, warm and open one engine at `socket`: a dead engine's socket file is removed first (its listener
    cannot bind over it)."""
    with suppress(FileNotFoundError):
        Path(socket).unlink()
    try:
        process = ModelProcess(settings, listen_at=socket)
    except RuntimeError as err:
        raise StartupError(f"cannot load the model from {settings.variant_dir}: {err}") from err
    if provider == "cuda" and process.provider != "CUDAExecutionProvider":
        process.close()
        raise StartupError(
            f"onnxruntime could not run {settings.variant_dir} on CUDA and fell back to {process.provider} (its log "
            "says why); fix the CUDA libraries, or serve with --provider cpu"
        )
    slots = min(config.max_slots or process.max_slots, process.max_slots)
    limits = config.limits_for(provider, slots)
    control = process.start_engine(limits, None, None, config.stall_seconds, config.engine_nice)
    engine = SharedEngine(label, process, control, partial(_launch, config, settings, provider, label, socket))
    try:
        control.warmup()
    except RuntimeError as err:
        engine.stop()
        raise StartupError(f"the model in {settings.variant_dir} does not run: {err}") from err
    logger.info("%s (pid %s) listens at %s", label, process.pid, socket)
    return engine


def stop_shared_engines(engines: list[SharedEngine]) -> None:
    """Stop every engine (the fronts have left them), each killed if it does not exit; the list is emptied."""
    while engines:
        engine = engines.pop()
        with suppress(Exception):  # one engine that fails to stop must not keep the others running
            engine.stop()
