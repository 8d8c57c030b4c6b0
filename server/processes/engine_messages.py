"""What crosses the pipe between the server and an engine process: one frozen dataclass per message.

The server sends `StartEngine`, then `Submit`, `Cancel`, `Warmup` and `Stop`, and `Close` to end a child
at any time. The child answers `RunnerFacts` or `StartFailed` once its runner is open, then batches of
`ToServer` messages, one batch per engine iteration that has something to tell. A measurement applies
itself to the server's observer, so the server never dispatches on a name it received.

A shared engine (of the `--processes` parent) takes `StartEngine`, `Warmup`, `Stop` and `Close` from the parent that
spawned it, and the same messages as any engine process from each server process that connects to its
socket, which first receives `RunnerFacts`; a server's `Stop` or `Close` there means that server leaves.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass

from model.directory import ExportMetadata, ModelSpec
from server.core.events import EngineLimits, Event
from server.core.gc_pauses import PAUSES, PauseCounts
from server.core.observer import EngineObserver, StepStats
from server.core.work import DecodeOptions

# -- server -> child ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartEngine:
    limits: EngineLimits
    stall_seconds: float  # the child's own stall watch (0 = none)
    nice: int  # added to the niceness of every thread of the child (server.processes.priority)


@dataclass(frozen=True)
class Submit:
    request_id: int
    sentences: list[list[int]]  # token ids, admitted and validated by the server
    options: DecodeOptions
    deadline: float | None  # time.monotonic() seconds; the same clock in both processes
    lang_pair: str


@dataclass(frozen=True)
class Cancel:
    request_id: int
    deadline_passed: bool


@dataclass(frozen=True)
class Warmup:
    pass


@dataclass(frozen=True)
class Stop:
    join_timeout_s: float | None  # how long the engine may take to answer what it holds


@dataclass(frozen=True)
class Close:
    """Exit now, whatever the child is doing (before or after its engine started)."""


ToChild = StartEngine | Submit | Cancel | Warmup | Stop | Close

# -- child -> server ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunnerFacts:
    """What the child's runner reports once open."""

    spec: ModelSpec
    metadata: ExportMetadata
    provider: str
    kv_cache: str
    max_slots: int
    pid: int  # the child's: a server process attached to a shared engine names and watches it by this


@dataclass(frozen=True)
class StartFailed:
    reason: str  # the child's account of why it could not open the runner


@dataclass(frozen=True)
class RequestEvent:
    request_id: int
    event: Event


@dataclass(frozen=True)
class LoadReport:
    queue_depth: int
    active_slots: int
    received: int  # sentences the child has received from this server, ever: what it sent since is still queued
    observed: bool = True  # this server shows the load in its metrics (one server per shared engine does)


@dataclass(frozen=True)
class Warm:
    error: str | None  # None: the engine warmed up


@dataclass(frozen=True)
class GcCounts:
    """The child interpreter's garbage collector so far, per generation (`gc.get_stats()`), and its pauses
    where they are timed (server.core.gc_pauses): the server exports them labelled with the child
    (server.edge.process_metrics)."""

    collections: tuple[int, ...]  # per generation, youngest first
    collected: tuple[int, ...]  # objects found unreachable and freed
    uncollectable: tuple[int, ...]
    pauses: PauseCounts | None = None

    @classmethod
    def now(cls) -> GcCounts:
        stats = gc.get_stats()
        collections, collected, uncollectable = (
            tuple(s[key] for s in stats) for key in ("collections", "collected", "uncollectable")
        )
        return cls(collections, collected, uncollectable, PAUSES.snapshot() if PAUSES.installed else None)


@dataclass(frozen=True)
class Failed:
    """The child's engine died or stalled; it has answered its requests."""


@dataclass(frozen=True)
class CapacitySet:
    max_slots: int

    def apply(self, observer: EngineObserver) -> None:
        observer.set_capacity(self.max_slots)


@dataclass(frozen=True)
class QueueWaits:
    waits: Sequence[float]

    def apply(self, observer: EngineObserver) -> None:
        observer.observe_queue_waits(self.waits)


@dataclass(frozen=True)
class StepObserved:
    stats: StepStats

    def apply(self, observer: EngineObserver) -> None:
        observer.observe_step(self.stats)


@dataclass(frozen=True)
class SentenceObserved:
    lang_pair: str
    input_tokens: int
    output_tokens: int

    def apply(self, observer: EngineObserver) -> None:
        observer.observe_sentence(self.lang_pair, self.input_tokens, self.output_tokens)


@dataclass(frozen=True)
class AbandonedObserved:
    lang_pair: str
    reason: str
    queued: int
    decoding: int

    def apply(self, observer: EngineObserver) -> None:
        observer.observe_abandoned(self.lang_pair, self.reason, self.queued, self.decoding)


Measurement = CapacitySet | QueueWaits | StepObserved | SentenceObserved | AbandonedObserved
ToServer = RequestEvent | LoadReport | Warm | Failed | GcCounts | Measurement
