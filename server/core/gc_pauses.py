"""How long Python's cyclic garbage collector stops this interpreter, by generation.

A collection stops every thread of the interpreter: in the process serving calls, its event loop, which
every call in flight then waits for; in an engine process, its decoding. prometheus-client's GC collector
counts collections and the objects they freed, not the time they take. `GcPauses` times each collection
through `gc.callbacks` into per-bucket counts; the edge exports them as histograms
(`server.edge.process_metrics`): this process's as `translation_gc_pause_seconds`, an engine or server
process's (sent with its `GcCounts`) as `translation_child_gc_pause_seconds{process}`.

The callback runs inside the collector, on whichever thread's allocation triggered it, possibly while that
thread holds some lock: so it takes none and only adds to plain counters (the interpreter runs one
collection at a time), and a snapshot copies them.
"""

from __future__ import annotations

import bisect
import gc
import time
from dataclasses import dataclass
from typing import Any

# A young collection takes tens of microseconds; a full one over a large heap tens of milliseconds.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
GENERATIONS = 3


@dataclass(frozen=True)
class PauseCounts:
    """Collections so far by generation: how many fell in each bucket of BUCKETS (the last: above them all),
    not cumulative, and their seconds in all."""

    counts: tuple[tuple[int, ...], ...]  # [generation][bucket]
    sums: tuple[float, ...]  # [generation]


class GcPauses:
    """The collector's pauses of this interpreter by generation, from when `install` is called."""

    def __init__(self) -> None:
        self._counts = [[0] * (len(BUCKETS) + 1) for _ in range(GENERATIONS)]
        self._sums = [0.0] * GENERATIONS
        self._started = 0.0
        self._timed_count = 0  # collections timed so far: a snapshot is rebuilt only when it moves
        self._last: tuple[int, PauseCounts] | None = None  # the last snapshot and the count it was taken at

    @property
    def installed(self) -> bool:
        return self._timed in gc.callbacks

    def install(self) -> None:
        """Time every later collection (once, however often it is called)."""
        if not self.installed:
            gc.callbacks.append(self._timed)

    def uninstall(self) -> None:
        if self.installed:
            gc.callbacks.remove(self._timed)

    def snapshot(self) -> PauseCounts:
        """The counts so far; the same object until a collection is timed (an engine process asks at every
        iteration, and most iterations collect nothing)."""
        total = self._timed_count  # read first: a collection while copying makes the next call copy again
        if self._last is None or self._last[0] != total:
            self._last = (total, PauseCounts(tuple(tuple(counts) for counts in self._counts), tuple(self._sums)))
        return self._last[1]

    def _timed(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        generation = min(int(info["generation"]), GENERATIONS - 1)
        self._counts[generation][bisect.bisect_left(BUCKETS, seconds)] += 1
        self._sums[generation] += seconds
        self._timed_count += 1


PAUSES = GcPauses()  # one per interpreter: installed by whatever reports this process's series


def freeze_startup_objects() -> None:
    """Move every object alive once a process serves (modules, graphs' metadata, tokenizers, protobuf
    descriptors) out of the cyclic collector's sight: they live as long as the process, and a full
    collection then walks only what calls allocated since, not them too (docs/decisions.md)."""
    gc.collect()
    gc.freeze()
