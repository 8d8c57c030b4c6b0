"""What a front process of `--processes` tells its parent, for /metrics: the GC counts of its own interpreter and
of the engines it shows the measurements of.

The parent serves /metrics for every front through prometheus-client's multiprocess mode, and reads the process
series of the fronts and engines it started itself; but Python's GC counts cannot travel through that mode's
files: each interpreter reads them of itself (`gc.get_stats()`), and an engine sends its own to the one front
that shows its measurements. So each front writes a small report into the same private directory every REPORT_S
seconds: its own GC counts, and its engines' last reported ones. At each scrape the parent reads the reports of
the fronts alive and exports them (`server.edge.process_metrics`): labelled `process`, the front as `server-<n>`,
each engine it reported as `server-<n>/engine-<model>#<k>`. A report is at most REPORT_S old; it goes with its
front.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from server.core.gc_pauses import PauseCounts
from server.processes.engine_messages import GcCounts

REPORT_S = 2.0  # how often a server process rewrites its report: the staleness of the series it feeds
SELF = ""  # the label of the reporting server process itself in its report's GC counts


@dataclass(frozen=True)
class ProcessReport:
    """One front's report: GC counts by label, its own under SELF, its engines' as "engine-<model>#<k>"."""

    gc: Mapping[str, GcCounts]


def report_path(directory: Path, pid: int) -> Path:
    return directory / f"processes-{pid}.json"  # not *.db: prometheus-client's collector reads only those


def write_report(directory: Path, report: ProcessReport, pid: int | None = None) -> None:
    """Replace this process's report (`pid`: the writer's, by default) in one rename: a reader sees the whole
    old report or the whole new one."""
    path = report_path(directory, os.getpid() if pid is None else pid)
    body = {"gc": {label: asdict(counts) for label, counts in report.gc.items()}}
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(body))
    partial.replace(path)


def read_reports(directory: Path, servers: Mapping[str, int]) -> ProcessReport:
    """The reports of the live `servers` (label -> pid) merged, every label under its server's; a front that
    has not written one yet adds nothing."""
    gc: dict[str, GcCounts] = {}
    for server, pid in servers.items():
        try:
            body = json.loads(report_path(directory, pid).read_text())
        except (OSError, ValueError):  # not written yet, or gone with its process
            continue
        for label, counts in body["gc"].items():
            gc[f"{server}/{label}" if label != SELF else server] = _gc_counts(counts)
    return ProcessReport(gc)


def forget_report(directory: Path, pid: int) -> None:
    """Remove an exited front's report."""
    report_path(directory, pid).unlink(missing_ok=True)


def _gc_counts(fields: dict[str, Any]) -> GcCounts:
    """GcCounts from its `asdict` form, as a report carries it."""
    pauses = fields.get("pauses")
    return GcCounts(
        tuple(fields["collections"]),
        tuple(fields["collected"]),
        tuple(fields["uncollectable"]),
        None if pauses is None else PauseCounts(tuple(map(tuple, pauses["counts"])), tuple(pauses["sums"])),
    )
