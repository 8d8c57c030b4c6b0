"""The series every prometheus-client exporter has: the process's memory, CPU, file descriptors, Python's GC.

`register_process_collectors` puts prometheus-client's own process, platform and GC collectors on the
service's registry: `process_*`, `python_info` and `python_gc_*` describe the process that serves
/metrics, unlabelled, as Prometheus's conventions (and its dashboards) expect of one target.

The processes that do not serve /metrics get their process series from the one that does, through
`ChildProcessCollector`, as `translation_child_process_*` labelled `process`: each engine process of
`--engine-processes` (`engine-<model>#<replica>`) and each server process of `--processes`
(`server-<index>`, read by the supervising parent, which then owns the unlabelled `process_*`). Each is
one process, never a sum: alerts and dashboards sum them (`sum without (process)`) where they want the
whole. Python's GC series are per interpreter and read in-process: the children's are not exported.

`_created` samples are off (`disable_created_metrics`, called by the entrypoints): a second series
per counter and histogram that Prometheus's text format only carries for OpenMetrics consumers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import partial

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client import disable_created_metrics as _disable_created_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

CHILD_PREFIX = "translation_child_"
Children = Callable[[], Mapping[str, int]]  # the live child processes: label -> pid


def disable_created_metrics() -> None:
    """Leave out the `_created` samples of counters and histograms (prometheus-client's process-wide switch)."""
    _disable_created_metrics()


def register_process_collectors(registry: CollectorRegistry, children: Children | None = None) -> None:
    """This process's process, platform and GC series on `registry`, and those of `children` if given."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    if children is not None:
        registry.register(ChildProcessCollector(children))


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
