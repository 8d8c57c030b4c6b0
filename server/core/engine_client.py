"""The one engine interface the edge sees, whatever runs the engine: `server.core.engine.Engine` in this
process, or `server.processes.engine_process.EngineProcess` for an engine in a child process. The edge holds
engines through it and never asks which it has."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

from server.core.admission_ledger import Admission
from server.core.events import Event
from server.core.work import DecodeOptions


class Cancellable(Protocol):
    """The submitter's grip on a request."""

    def cancel(self, deadline_passed: bool = False) -> None: ...


class EngineClient(Protocol):
    """Admission, submission and lifecycle of one engine."""

    @property
    def load(self) -> int: ...  # queued, reserved and running sentences: the least loaded engine gets a call

    @property
    def draining(self) -> bool: ...

    @property
    def failed(self) -> bool: ...

    def admission(self, sentences: int = 0) -> AbstractContextManager[Admission]: ...

    def submit(
        self,
        sentences: list[list[int]],
        options: DecodeOptions,
        on_event: Callable[[Event], None],
        deadline: float | None = None,
        lang_pair: str = "",
        *,
        admitted: Admission | None = None,
    ) -> Cancellable: ...

    def warmup(self) -> None: ...

    def drain(self, timeout: float) -> bool: ...

    def stop(self, join_timeout_s: float | None = None) -> None: ...

    def abandon_if_stalled(self, limit_s: float, now: float) -> float | None: ...
