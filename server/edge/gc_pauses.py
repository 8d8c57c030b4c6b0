"""How long Python's cyclic garbage collector stops the process serving /metrics: `translation_gc_pause_seconds`.

prometheus-client's GC collector counts collections and the objects they freed, not the time they take, and
a collection stops every thread of the interpreter that holds the gRPC event loop: a full one over a large
heap is tens of milliseconds that every call in flight waits. `GcPauses` times each collection through
`gc.callbacks` into a histogram by generation.

The callback runs inside the collector, on whichever thread's allocation triggered it, possibly while that
thread holds a prometheus-client lock: so it takes no lock and only adds to plain counters (collections
never overlap, the interpreter runs one at a time), and the histogram is built from them at each scrape.
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

NAME = "translation_gc_pause_seconds"
# A young collection takes tens of microseconds; a full one over a large heap tens of milliseconds.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
GENERATIONS = 3


class GcPauses(Collector):
    """The collector's pauses of this interpreter by generation, from when `install` is called."""

    def __init__(self) -> None:
        self._counts = [[0] * (len(BUCKETS) + 1) for _ in range(GENERATIONS)]  # per bucket; the last is +Inf
        self._sums = [0.0] * GENERATIONS
        self._started = 0.0

    def install(self) -> None:
        """Time every later collection (once, however often it is called)."""
        if self._timed not in gc.callbacks:
            gc.callbacks.append(self._timed)

    def uninstall(self) -> None:
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)

    def _timed(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        generation = min(int(info["generation"]), GENERATIONS - 1)
        self._counts[generation][bisect.bisect_left(BUCKETS, seconds)] += 1
        self._sums[generation] += seconds

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(
            NAME, "Pauses of Python's cyclic garbage collector in the process serving /metrics, by generation.",
            labels=["generation"],
        )  # fmt: skip
        for generation in range(GENERATIONS):
            cumulative, buckets = 0, []
            for bound, count in zip([*map(str, BUCKETS), "+Inf"], self._counts[generation], strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([str(generation)], buckets, self._sums[generation])
        return [family]


PAUSES = GcPauses()  # one per interpreter: every registry of this process exports the same pauses
