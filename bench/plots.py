"""Markdown table and PNG plots from a bench results dict (see bench.run)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt

BEAMS = (1, 4)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


REFERENCE = "pytorch-eager"  # the engine every other one's ids are compared with, where it ran


def _engine_rows(results: dict[str, Any]) -> list[str]:
    rows = []
    for name, entry in results["offline"].items():
        if "skipped" in entry:
            rows.append(f"| {name} | skipped: {entry['skipped']} | | | | | | |")
            continue
        cells = []
        for beam in BEAMS:
            b = entry[f"beam{beam}"]
            agree = b.get("agreement_with_pytorch")
            reference = "reference" if name == REFERENCE else "-"
            agree_txt = f"{agree['identical']}/{agree['compared']}" if agree else reference
            twin = b.get("agreement_with_uncaptured")
            if twin:  # a captured engine: its ids against the uncaptured engine it must reproduce
                agree_txt += f" ({twin['identical']}/{twin['compared']} = uncaptured)"
            cells += [
                _fmt(b["throughput"]["tokens_per_s"]),
                f"{_fmt(b['latency']['p50_ms'])} / {_fmt(b['latency']['p99_ms'])}",
                agree_txt,
            ]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def _served_runs(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The served variants that ran, by variant."""
    return {variant: run for variant, run in results["served"].items() if "skipped" not in run}


def served_rows(results: dict[str, Any]) -> list[str]:
    rows = []
    for variant, served in results["served"].items():
        if "skipped" in served:
            rows.append(f"| served {variant} (gRPC) | skipped: {served['skipped']} | | | | | |")
            continue
        cells = []
        for beam in BEAMS:
            b = served[f"beam{beam}"]
            single = b["single"]
            cells += [_fmt(b["saturation_tokens_per_s"]), f"{_fmt(single['p50_ms'])} / {_fmt(single['p99_ms'])}", "-"]
        engines = served["engines"] or "the server's default"  # 0: the server plans them (two per GPU)
        layout = f"{engines} engines x {served['threads_per_engine']} thread"
        layout += "".join(f" {arg}" for arg in served.get("server_args", []))
        rows.append(f"| served {variant} (gRPC, end to end, {layout}) | " + " | ".join(cells) + " |")
    return rows


def _load_rows(results: dict[str, Any]) -> list[str]:
    runs = _served_runs(results)
    if not runs:
        return []
    rows = [
        "",
        "Served path under load (closed = fixed concurrency, open = fixed offered rate):",
        "",
        "| variant | beam | mode | concurrency / offered req/s | achieved req/s | tokens/s | p50 ms | p95 ms | p99 ms "
        "| errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, served in runs.items():
        for beam in BEAMS:
            b = served[f"beam{beam}"]
            for run in b["closed"] + b.get("open", []):
                level = run["concurrency"] if run["mode"] == "closed" else _fmt(run["offered_rate"])
                rows.append(
                    f"| {variant} | {beam} | {run['mode']} | {level} | {_fmt(run['achieved_rps'])} | "
                    f"{_fmt(run['tokens_per_s'])} | {_fmt(run['p50_ms'], 0)} | {_fmt(run['p95_ms'], 0)} | "
                    f"{_fmt(run['p99_ms'], 0)} | {run['errors'] or 0} |"
                )
    return rows + _engine_step_rows(runs)


def _engine_step_rows(runs: dict[str, dict[str, Any]]) -> list[str]:
    """What the engines did during each closed-loop run, read from the server's step histograms."""
    measured = [
        (variant, beam, run)
        for variant, served in runs.items()
        for beam in BEAMS
        for run in served[f"beam{beam}"]["closed"]
        if "engine" in run
    ]
    if not measured:
        return []
    rows = [
        "",
        "Engines during each closed-loop run (the server's step histograms; busy = decoder and encoder seconds per"
        " second of the run, summed over engines; engine MB = the largest engine process's resident memory at the"
        " run's end):",
        "",
        "| variant | beam | concurrency | decoder steps | ms per step | rows per step | encoder ms | busy "
        "| queue wait ms | server ms per call | client p50 ms | engine MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, beam, run in measured:
        e = run["engine"]
        rows.append(
            f"| {variant} | {beam} | {run['concurrency']} | {e['steps']:.0f} | {_fmt(e['step_ms'], 2)} | "
            f"{_fmt(e['rows_per_step'], 1)} | {_fmt(e['encode_ms'], 2)} | {_fmt(e['busy_share'], 2)} | "
            f"{_fmt(e.get('queue_wait_ms'), 1)} | {_fmt(e.get('server_call_ms'), 1)} | {_fmt(run['p50_ms'], 0)} | "
            f"{_fmt(e.get('engine_mb'), 0)} |"
        )
    return rows


def _coverage_notes(results: dict[str, Any]) -> list[str]:
    """Which engines ran out of budget before the last sentence: their throughput is over fewer sentences."""
    notes = []
    for name, entry in results["offline"].items():
        done = {beam: entry[f"beam{beam}"]["throughput"]["sentences"] for beam in BEAMS if f"beam{beam}" in entry}
        if any(n < results["sentences"] for n in done.values()):
            counts = " / ".join(f"{done[beam]} (beam {beam})" for beam in done)
            total = results["sentences"]
            notes.append(f"- {name} translated the first {counts} of {total} sentences within its budget.")
    return ["", *notes] if notes else []


def _ratio_rows(results: dict[str, Any]) -> list[str]:
    if not results["ratios_to_ctranslate2"]:
        return ["", "Ratios to CTranslate2: none, CTranslate2 was not measured on this machine (see the skipped rows)."]
    rows = [
        "",
        "Ratios to CTranslate2 at the same precision, in its best layout for each measure (throughput: higher is"
        " better; single-sentence p50 latency: lower is better):",
        "",
        "| precision | beam | CTranslate2 tokens/s (layout) | CTranslate2 p50 ms (layout) | ours | throughput ratio "
        "| p50 latency ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for compute_type, per_beam in results["ratios_to_ctranslate2"].items():
        for key, row in per_beam.items():
            base = row["ctranslate2"]
            for name, r in row.items():
                if name == "ctranslate2":
                    continue
                rows.append(
                    f"| {compute_type} | {key[4:]} | {_fmt(base['tokens_per_s'])} ({base['throughput_layout']}) | "
                    f"{_fmt(base['p50_ms'])} ({base['latency_layout']}) | {name} | {_fmt(r['throughput'], 2)} | "
                    f"{_fmt(r['latency_p50'], 2)} |"
                )
    return rows


def _transformers_rows(results: dict[str, Any]) -> list[str]:
    per_beam = results.get("ratios_to_transformers") or {}
    if not per_beam:
        return []
    rows = [
        "",
        "Served against transformers' batched `generate` on the same weights (throughput at saturation over"
        " generate's; single-sentence p50 over generate's one-sentence p50):",
        "",
        "| beam | generate tokens/s | generate p50 ms | served | throughput ratio | p50 latency ratio |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in per_beam.items():
        base = row["transformers"]
        for name, r in row.items():
            if name != "transformers":
                rows.append(
                    f"| {key[4:]} | {_fmt(base['tokens_per_s'])} | {_fmt(base['p50_ms'])} | {name} | "
                    f"{_fmt(r['throughput'], 2)} | {_fmt(r['latency_p50'], 2)} |"
                )
    return rows


def render_markdown(results: dict[str, Any]) -> str:
    """The README-ready table: throughput, single-request latency, agreement, load sweep, ratios."""
    m = results["machine"]
    s = results["settings"]
    header = [
        f"Machine: {m['cpu']}, {m['cores']} cores{', ' + m['gpu'] if m.get('gpu') else ''}, {m['platform']}; "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
        f"Device {s['device']}, {s['threads']} threads per engine, batch {s['max_batch']} sentences, "
        f"max {s['max_len']} tokens, {results['sentences']} test sentences (the model's directions); "
        f"weights sha256 {results['model_sha256'][:12]}; wall {results['wall_s']:.0f} s"
        + (" (--quick: smoke-test budgets, not comparable numbers)" if s["quick"] else ""),
        "",
        f"Command: `{results['command']}`",
        "",
        "| engine | beam 1 tokens/s | beam 1 latency p50 / p99 ms | beam 1 ids = PyTorch "
        "| beam 4 tokens/s | beam 4 latency p50 / p99 ms | beam 4 ids = PyTorch |",
        "|---|---|---|---|---|---|---|",
    ]
    latency = results["budget"]["latency_requests"]
    notes = [
        "",
        f"Latency: one sentence at a time over the same first {latency} sentences for every engine and the"
        " served path (p99 only from 100 sentences up). `-workers`: CTranslate2 with one translator worker"
        " per thread (inter_threads), its throughput layout; without: one worker with every thread.",
        *_coverage_notes(results),
    ]
    rows = _engine_rows(results) + served_rows(results)
    lines = header + rows + notes + _load_rows(results) + _ratio_rows(results) + _transformers_rows(results)
    return "\n".join(lines) + "\n"


def _offline_lines(ax: Any, results: dict[str, Any], beam: int) -> None:
    for i, (name, entry) in enumerate(results["offline"].items()):
        if f"beam{beam}" in entry:
            tps = entry[f"beam{beam}"]["throughput"]["tokens_per_s"]
            # axhline does not advance the colour cycle: give each engine its own colour.
            ax.axhline(tps, color=f"C{i + 1}", linestyle="--", linewidth=1, label=f"{name} offline")


def plot_throughput(results: dict[str, Any], out: Path) -> Path:
    """Served tokens/s vs concurrency per beam and variant, with offline engines as reference lines."""
    fig, axes = plt.subplots(1, len(BEAMS), figsize=(12, 4.5))
    served = _served_runs(results)
    for ax, beam in zip(axes, BEAMS, strict=True):
        _offline_lines(ax, results, beam)
        for variant, run in served.items():
            closed = run[f"beam{beam}"]["closed"]
            x, y = [r["concurrency"] for r in closed], [r["tokens_per_s"] for r in closed]
            style = {"color": "k" if variant == "int8" else "C0", "marker": "o" if variant == "int8" else "s"}
            ax.plot(x, y, "-", **style, label=f"served {variant} (gRPC)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # engines differ by orders of magnitude
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("target tokens / s")
        ax.set_title(f"throughput vs concurrency, beam {beam}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "throughput_vs_concurrency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency(results: dict[str, Any], out: Path) -> Path:
    """Served p50/p99 latency vs offered request rate (open loop, beam 4), per variant."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    served = _served_runs(results)
    for variant, run in served.items():
        runs = run["beam4"].get("open", [])
        for key in ("p50_ms", "p99_ms"):
            ax.plot([r["offered_rate"] for r in runs], [r[key] for r in runs], "o-", label=f"{variant} {key[:3]}")
    ax.set_xlabel("offered requests / s (one sentence each)")
    ax.set_ylabel("latency ms")
    ax.set_title("served latency vs offered load, beam 4")
    if served:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "served path skipped", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    path = out / "latency_vs_load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(results: dict[str, Any], out: Path) -> list[Path]:
    return [plot_throughput(results, out), plot_latency(results, out)]
