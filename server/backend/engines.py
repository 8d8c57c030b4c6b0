"""Opened models and the engines over them: the one place that knows whether an engine runs in this process
(`server.core.engine.Engine` over a runner) or in a child (`server.backend.engine_process`). Above this
module everything holds an `OpenedModel` and an `EngineClient`, and never asks which."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from server.backend.engine_process import ModelProcess, RunnerSettings
from server.core.engine import Engine, EngineLimits
from server.core.engine_client import EngineClient
from server.core.observer import EngineObserver
from server.core.runner import Runner

if TYPE_CHECKING:
    from server.backend.runtime import OnnxRunner

OpenedModel: TypeAlias = Runner | ModelProcess  # a runner in this process, or a child process holding one
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
) -> EngineClient:
    """An engine over the model, started; in the model's child process where it has one (which then also
    watches its engine for stalls)."""
    if isinstance(model, ModelProcess):
        return model.start_engine(limits, observer, on_failure, stall_seconds)
    engine = Engine(model, limits, observer, on_failure=on_failure)
    engine.start()
    return engine


def close_model(model: OpenedModel) -> None:
    """Release what the model holds outside this process (a child); a runner here needs nothing."""
    if isinstance(model, ModelProcess):
        model.close()


def child_pid(model: OpenedModel) -> int | None:
    """The pid of the child process holding the model, None for a runner in this process."""
    return model.pid if isinstance(model, ModelProcess) else None


def in_this_process(engine: EngineClient | None) -> Engine | None:
    """The engine itself where it runs in this process (tests reach into it), else None."""
    return engine if isinstance(engine, Engine) else None
