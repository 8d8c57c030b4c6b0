"""What the engine reports of its work, to whoever observes it: the edge's Prometheus metrics in the server,
nothing offline. The core calls this protocol and never imports a metrics library."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StepStats:
    """One engine iteration, as the engine measured it."""

    duration_s: float  # wall time of the decoder step call, with the beam-row copies before it
    encode_duration_s: float  # wall time of the encoder call; 0 when nothing was admitted
    active_slots: int  # rows stepped
    encode_real_tokens: int  # source tokens encoded
    encode_padded_tokens: int  # items * longest source: what a padded encoder batch computes
    step_real_tokens: int  # sum over rows of cache entries attended (position + 1)
    step_padded_tokens: int  # rows * longest attended span
    queue_waits_s: tuple[float, ...]  # per sentence admitted this iteration


class EngineObserver(Protocol):
    """Receives the engine's measurements; implemented by server.edge.metrics.Metrics."""

    def set_capacity(self, max_slots: int) -> None: ...

    def set_load(self, queue_depth: int, active_slots: int) -> None: ...

    def observe_queue_waits(self, waits: Iterable[float]) -> None: ...

    def observe_step(self, stats: StepStats) -> None: ...

    def observe_sentence(self, lang_pair: str, input_tokens: int, output_tokens: int) -> None: ...

    def observe_abandoned(self, lang_pair: str, reason: str, queued: int, decoding: int) -> None: ...
