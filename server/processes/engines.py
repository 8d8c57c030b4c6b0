"""Opened models and the engines over them: the one place that knows whether an engine runs in an engine
process (`server.processes.engine_process`: what the server always serves with) or in this process
(`server.core.engine.Engine` over a runner: offline tools and tests). Above this module everything holds an
`OpenedModel` and an `EngineClient`, and never asks which."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from server.core.engine import Engine
from server.core.engine_client import EngineClient
from server.core.events import EngineLimits
from server.core.observer import EngineObserver
from server.core.runner import Runner
from server.processes.engine_messages import GcCounts
from server.processes.engine_process import EngineProcess, ModelProcess, RunnerSettings, SharedModel

if TYPE_CHECKING:
    from server.backend.runtime import OnnxRunner

# An engine process holding the model, an engine the `--processes` parent holds, or a runner in this process
# (offline tools and tests).
OpenedModel: TypeAlias = ModelProcess | SharedModel | Runner
OpenedGraphs: TypeAlias = "ModelProcess | OnnxRunner"  # what `open_model` opens: in an engine process, or here


def open_model(settings: RunnerSettings, in_process: bool = False) -> OpenedGraphs:
    """The model's graphs opened in an engine process of their own, as the server always serves them; or in this
    process (`in_process`), for offline tools and tests that drive the runner."""
    return settings.open() if in_process else ModelProcess(settings)


def start_engine(
    model: OpenedModel,
    limits: EngineLimits,
    observer: EngineObserver | None,
    on_failure: Callable[[], None],
    stall_seconds: float,
    nice: int,
) -> EngineClient:
    """An engine over the model, started: in the model's engine process, the whole process `nice` steps below
    the calling process's priority (`server.processes.priority`), which then also watches its engine for stalls.
    A shared engine runs at the niceness its parent gave it; an engine in this process (offline tools, tests)
    at the caller's."""
    if isinstance(model, SharedModel):
        return model.start_engine(limits, observer, on_failure)
    if isinstance(model, ModelProcess):
        return model.start_engine(limits, observer, on_failure, stall_seconds, nice)
    engine = Engine(model, limits, observer, on_failure=on_failure)
    engine.start()
    return engine


def close_model(model: OpenedModel) -> None:
    """Release what the model holds outside this process (a child, a shared engine's connection); a runner here
    needs nothing."""
    if isinstance(model, ModelProcess | SharedModel):
        model.close()


def child_pid(model: OpenedModel) -> int | None:
    """The pid of the engine process holding the model, None for a shared engine (its parent reports that
    process) and for a runner in this process."""
    return model.pid if isinstance(model, ModelProcess) else None


def child_gc_counts(engine: EngineClient) -> GcCounts | None:
    """The garbage collector counts an engine process last reported; None for an engine in this process
    (this interpreter's own `python_gc_*` series count it)."""
    return engine.gc_counts if isinstance(engine, EngineProcess) else None


def in_this_process(engine: EngineClient | None) -> Engine | None:
    """The engine itself where it runs in this process (tests reach into it), else None."""
    return engine if isinstance(engine, Engine) else None
