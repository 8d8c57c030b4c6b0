"""What a server process of `--processes` tells its parent about the processes behind it, for /metrics.

The parent serves /metrics for every server process through prometheus-client's multiprocess mode, but two
kinds of series cannot travel through that mode's files: Python's GC counts, which each interpreter reads of
itself (`gc.get_stats()`), and the process series of the engine processes a server process starts
(`--engine-processes`), whose pids only that server process knows. So each server process writes a small
report into the same private directory every REPORT_S seconds: its own GC counts, and its engine processes'
pids and last reported GC counts. At each scrape the parent reads the reports of the server processes alive
and exports them as it exports its server processes' own series (`server.edge.process_metrics`): labelled
`process`, the server process as `server-<n>`, each of its engine processes as
`server-<n>/engine-<model>#<k>`. A report is at most REPORT_S old; it goes with its server process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from server.backend.engine_messages import GcCounts
from server.core.gc_pauses import PauseCounts

REPORT_S = 2.0  # how often a server process rewrites its report: the staleness of the series it feeds
SELF = ""  # the label of the reporting server process itself in its report's GC counts


@dataclass(frozen=True)
class ProcessReport:
    """One server process's report: its engine processes by label, and GC counts (its own under SELF)."""

    pids: Mapping[str, int]  # "engine-<model>#<k>" -> pid
    gc: Mapping[str, GcCounts]


def report_path(directory: Path, pid: int) -> Path:
    return directory / f"processes-{pid}.json"  # not *.db: prometheus-client's collector reads only those


def write_report(directory: Path, report: ProcessReport, pid: int | None = None) -> None:
    """Replace this process's report (`pid`: the writer's, by default) in one rename: a reader sees the whole
    old report or the whole new one."""
    path = report_path(directory, os.getpid() if pid is None else pid)
    body = {"pids": dict(report.pids), "gc": {label: asdict(counts) for label, counts in report.gc.items()}}
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(body))
    partial.replace(path)


def read_reports(directory: Path, servers: Mapping[str, int]) -> ProcessReport:
    """The reports of the live `servers` (label -> pid) merged, every label under its server's; a server
    process that has not written one yet adds nothing."""
    pids: dict[str, int] = {}
    gc: dict[str, GcCounts] = {}
    for server, pid in servers.items():
        try:
            body = json.loads(report_path(directory, pid).read_text())
        except (OSError, ValueError):  # not written yet, or gone with its process
            continue
        pids.update({f"{server}/{label}": int(child) for label, child in body["pids"].items()})
        for label, counts in body["gc"].items():
            gc[f"{server}/{label}" if label != SELF else server] = _gc_counts(counts)
    return ProcessReport(pids, gc)


def forget_report(directory: Path, pid: int) -> None:
    """Remove an exited server process's report."""
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
