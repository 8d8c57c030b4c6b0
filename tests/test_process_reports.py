"""A front process's report to its `--processes` parent (server/processes/process_reports.py): what it writes is
what the parent reads, under the server's label, and only the live servers' reports count."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from server.core.gc_pauses import BUCKETS, PauseCounts
from server.edge.metrics import forget_process
from server.edge.process_metrics import register_process_collectors
from server.processes.engine_messages import GcCounts
from server.processes.process_reports import SELF, ProcessReport, forget_report, read_reports, report_path, write_report

OWN = GcCounts((10, 2, 1), (300, 40, 5), (0, 0, 0))
TIMED = PauseCounts(tuple((n,) + (0,) * len(BUCKETS) for n in (7, 1, 0)), (0.0007, 0.0001, 0.0))  # all under 0.1 ms
ENGINE = GcCounts((7, 1, 0), (90, 3, 0), (0, 1, 0), TIMED)


def test_a_report_is_read_back_under_its_servers_label(tmp_path: Path) -> None:
    write_report(tmp_path, ProcessReport({SELF: OWN, "engine-opus#0": ENGINE}), pid=1001)
    write_report(tmp_path, ProcessReport({SELF: ENGINE}), pid=1002)
    merged = read_reports(tmp_path, {"server-0": 1001, "server-1": 1002})
    assert merged.gc == {"server-0": OWN, "server-0/engine-opus#0": ENGINE, "server-1": ENGINE}


def test_only_live_servers_count_and_a_missing_or_torn_report_adds_nothing(tmp_path: Path) -> None:
    write_report(tmp_path, ProcessReport({SELF: OWN}), pid=1001)
    assert read_reports(tmp_path, {}).gc == {}  # server-0 has exited: its report is not exported
    assert read_reports(tmp_path, {"server-0": 1003}).gc == {}  # a restarted server-0 that has not written yet
    report_path(tmp_path, 1004).write_text('{"gc": {')  # never written so by write_report (one rename)
    assert read_reports(tmp_path, {"server-1": 1004}) == ProcessReport({})
    forget_report(tmp_path, 1001)
    assert read_reports(tmp_path, {"server-0": 1001}).gc == {}
    forget_report(tmp_path, 1001)  # twice: nothing to remove


def test_rewriting_a_report_replaces_it_and_leaves_no_partial_file(tmp_path: Path) -> None:
    write_report(tmp_path, ProcessReport({SELF: OWN}), pid=1001)
    write_report(tmp_path, ProcessReport({SELF: ENGINE}), pid=1001)
    assert read_reports(tmp_path, {"server-0": 1001}).gc == {"server-0": ENGINE}
    assert [p.name for p in tmp_path.iterdir()] == ["processes-1001.json"]


def test_forgetting_an_exited_process_removes_its_report_with_its_gauges(tmp_path: Path) -> None:
    write_report(tmp_path, ProcessReport({SELF: OWN}), pid=1001)
    forget_process(1001, str(tmp_path))
    assert not report_path(tmp_path, 1001).exists()


def test_reported_counts_become_the_labelled_gc_series(tmp_path: Path) -> None:
    write_report(tmp_path, ProcessReport({SELF: OWN, "engine-opus#0": ENGINE}), pid=1001)
    registry = CollectorRegistry()
    register_process_collectors(registry, dict, lambda: read_reports(tmp_path, {"server-0": 1001}).gc)
    text = generate_latest(registry).decode()
    assert 'translation_child_python_gc_collections_total{generation="0",process="server-0"} 10.0' in text
    engine = 'translation_child_python_gc_objects_collected_total{generation="1",process="server-0/engine-opus#0"}'
    assert f"{engine} 3.0" in text
    pauses = 'translation_child_gc_pause_seconds_count{generation="0",process="server-0/engine-opus#0"}'
    assert (
        f"{pauses} 7.0" in text
        and 'translation_child_gc_pause_seconds_count{generation="0",process="server-0"}' not in text
    )
