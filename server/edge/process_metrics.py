"""The series every prometheus-client exporter has: the process's memory, CPU, file descriptors, Python's GC.

`register_process_collectors` puts prometheus-client's own process, platform and GC collectors on the
service's registry: `process_*`, `python_info` and `python_gc_*` describe the process that serves
/metrics, unlabelled, as Prometheus's conventions (and its dashboards) expect of one target.

The processes that do not serve /metrics get their process series from the one that does, through
`ChildProcessCollector`, as `translation_child_process_*` labelled `process`: each engine process
(`engine-<model>#<replica>`) and each front process of `--processes` (`server-<index>`), read by the process
that started it (with `--processes` the supervising parent, which then owns the unlabelled `process_*`). Each
is one process, never a sum: alerts and dashboards sum them (`sum without (process)`) where they want the
whole. Python's GC series are per interpreter: an engine process sends its own through its pipe
(`server.processes.engine_messages.GcCounts`); a front of `--processes` writes its own and those of the engines
it shows into its report (`server.processes.process_reports`), the engines' as `server-<index>/engine-<model>#<k>`;
all are exported as `translation_child_python_gc_*`.

`translation_gc_pause_seconds{generation}` is how long the collector stopped the process serving /metrics
(server.core.gc_pauses), which prometheus-client's GC series do not say; each child's pauses come with its
GC counts, as `translation_child_gc_pause_seconds{generation,process}`.

`_created` samples are off (`disable_created_metrics`, called by the entrypoints): a second series
per counter and histogram that Prometheus's text format only carries for OpenMetrics consumers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import partial

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client import disable_created_metrics as _disable_created_metrics
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from server.core.gc_pauses import BUCKETS, GENERATIONS, PAUSES, PauseCounts
from server.processes.engine_messages import GcCounts

CHILD_PREFIX = "translation_child_"
LABELS = ("generation", "process")
Children = Callable[[], Mapping[str, int]]  # the live child processes: label -> pid
ChildrenGc = Callable[[], Mapping[str, GcCounts]]  # the children that report their garbage collector: label -> counts
GC_SERIES = (  # prometheus-client's GCCollector's series, from the fields of GcCounts
    ("python_gc_objects_collected", "Objects collected during gc", "collected"),
    ("python_gc_objects_uncollectable", "Uncollectable objects found during GC", "uncollectable"),
    ("python_gc_collections", "Number of times this generation was collected", "collections"),
)


def disable_created_metrics() -> None:
    """Leave out the `_created` samples of counters and histograms (prometheus-client's process-wide switch)."""
    _disable_created_metrics()


def register_process_collectors(
    registry: CollectorRegistry, children: Children | None = None, children_gc: ChildrenGc | None = None
) -> None:
    """This process's process, platform and GC series on `registry`, and those of `children` (process
    series) and `children_gc` (GC series) if given."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    PAUSES.install()
    registry.register(OwnGcPauses())
    if children is not None:
        registry.register(ChildProcessCollector(children))
    if children_gc is not None:
        registry.register(ChildGcCollector(children_gc))


class ChildProcessCollector(Collector):
    """prometheus-client's process series of other processes, renamed `translation_child_process_*` and
    labelled `process`; a child that has exited since it was listed is left out."""

    def __init__(self, children: Children, proc: str = "/proc") -> None:
        self._children = children
        self._proc = proc

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for label, pid in sorted(self._children().items()):
            reader = ProcessCollector(pid=partial(int, pid), proc=self._proc, registry=None)
            for family in reader.collect():
                name = CHILD_PREFIX + family.name
                renamed = families.setdefault(name, Metric(name, f"{family.documentation} By process.", family.type))
                for sample in family.samples:
                    renamed.add_sample(CHILD_PREFIX + sample.name, {**sample.labels, "process": label}, sample.value)
        return list(families.values())


PAUSE_NAME = "gc_pause_seconds"
PAUSE_HELP = "Pauses of Python's cyclic garbage collector, by generation"


def pause_family(
    name: str, documentation: str, label_names: tuple[str, ...], labelled: Iterable[tuple[tuple[str, ...], PauseCounts]]
) -> Metric:
    """A histogram of collector pauses labelled `generation` and `label_names`, one series set per item."""
    family = HistogramMetricFamily(name, documentation, labels=["generation", *label_names])
    for values, pauses in labelled:
        for generation in range(GENERATIONS):
            cumulative, buckets = 0, []
            for bound, count in zip([*map(str, BUCKETS), "+Inf"], pauses.counts[generation], strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([str(generation), *values], buckets, pauses.sums[generation])
    return family


class OwnGcPauses(Collector):
    """`translation_gc_pause_seconds{generation}` of this process (PAUSES must be installed)."""

    def collect(self) -> Iterable[Metric]:
        own = [((), PAUSES.snapshot())]
        return [pause_family(f"translation_{PAUSE_NAME}", f"{PAUSE_HELP}, of the process serving /metrics.", (), own)]


class ChildGcCollector(Collector):
    """The GC series of other interpreters, as prometheus-client's GCCollector names them, renamed
    `translation_child_python_gc_*` and labelled `process` (and `generation`)."""

    def __init__(self, children_gc: ChildrenGc) -> None:
        self._children_gc = children_gc

    def collect(self) -> Iterable[Metric]:
        reported = sorted(self._children_gc().items())
        families: list[Metric] = []
        for name, documentation, field in GC_SERIES:
            family = CounterMetricFamily(CHILD_PREFIX + name, f"{documentation}. By process.", labels=LABELS)
            for label, counts in reported:
                for generation, count in enumerate(getattr(counts, field)):
                    family.add_metric([str(generation), label], count)
            families.append(family)
        timed = [((label,), counts.pauses) for label, counts in reported if counts.pauses is not None]
        families.append(pause_family(CHILD_PREFIX + PAUSE_NAME, f"{PAUSE_HELP}. By process.", ("process",), timed))
        return families
