"""Opened models and the engines over them: the one place that knows whether an engine runs in this process
(`server.core.engine.Engine` over a runner) or in a child (`server.backend.engine_process`). Above this
module everything holds an `OpenedModel` and an `EngineClient`, and never asks which."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from server.backend.engine_messages import GcCounts
from server.backend.engine_process import EngineProcess, ModelProcess, RunnerSettings, SharedModel
from server.backend.priority import lower_thread_priority
from server.core.engine import Engine
from server.core.engine_client import EngineClient
from server.core.events import EngineLimits
from server.core.observer import EngineObserver
from server.core.runner import Runner

if TYPE_CHECKING:
    from server.backend.runtime import OnnxRunner

# A runner in this process, a child process holding one, or a shared engine the `--processes` parent holds.
OpenedModel: TypeAlias = Runner | ModelProcess | SharedModel
OpenedGraphs: TypeAlias = "OnnxRunner | ModelProcess"  # what `open_model` opens: onnxruntime here or in a child


def open_model(settings: RunnerSettings, in_child: bool) -> OpenedGraphs:
    """The model's graphs opened in this process, or in a child process of their own (`--engine-processes`)."""
    return ModelProcess(settings) if in_child else settings.open()


def start_engine(
    model: OpenedModel,
    limits: EngineLimits,
    observer: EngineObserver | None,
    on_failure: Callable[[], None],
    stall_seconds: float,
    nice: int,
) -> EngineClient:
    """An engine over the model, started, its decoding `nice` steps below the calling process's priority
    (`server.backend.priority`); in the model's child process where it has one (which then also watches
    its engine for stalls). A shared engine runs at the niceness its parent gave it."""
    if isinstance(model, SharedModel):
        return model.start_engine(limits, observer, on_failure)
    if isinstance(model, ModelProcess):
        return model.start_engine(limits, observer, on_failure, stall_seconds, nice)
    engine = Engine(model, limits, observer, on_failure=on_failure)
    engine.start()
    assert engine.native_thread_id is not None, "a started engine has a thread"
    lower_thread_priority(engine.native_thread_id, nice)
    return engine


def close_model(model: OpenedModel) -> None:
    """Release what the model holds outside this process (a child, a shared engine's connection); a runner here
    needs nothing."""
    if isinstance(model, ModelProcess | SharedModel):
        model.close()


def child_pid(model: OpenedModel) -> int | None:
    """The pid of the child process holding the model, None for a runner in this process and for a shared
    engine (its parent reports that process)."""
    return model.pid if isinstance(model, ModelProcess) else None


def child_gc_counts(engine: EngineClient) -> GcCounts | None:
    """The garbage collector counts an engine process last reported; None for an engine in this process
    (this interpreter's own `python_gc_*` series count it)."""
    return engine.gc_counts if isinstance(engine, EngineProcess) else None


def in_this_process(engine: EngineClient | None) -> Engine | None:
    """The engine itself where it runs in this process (tests reach into it), else None."""
    return engine if isinstance(engine, Engine) else None
