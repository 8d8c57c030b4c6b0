"""Throughput with and without the response cache on traffic where a share of requests repeat a text.

Each request is one text: with probability `--repeat-share` one of a few dozen short interface strings
(menus, buttons, messages; `--repeats sentences`: 20 test sentences per language, kept out of the rest)
in the request's source language, else the next unused sentence of the test set, so only those repeat.
The arms alternate (no cache, cache, no cache, ...), each on a fresh `translate-server` (a cold cache)
driven by the same closed-loop requests from bench.loadgen; each arm reports requests per second and
the server's CPU seconds over the run.

Usage: python -m bench.cache_repeats --model-dir model/shipped --variant int8 --requests 600 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.engines import EngineSettings
from bench.loadgen import Query
from bench.run import free_port, machine, start_server

UI_STRINGS = {
    "de": ["Speichern", "Abbrechen", "Einstellungen", "Anmelden", "Abmelden", "Passwort vergessen?", "Weiter",
           "Zurück", "Suchen", "Hilfe", "Konto löschen", "Änderungen gespeichert.", "In den Warenkorb",
           "Zur Kasse gehen", "Alle akzeptieren", "Mehr erfahren", "Profil bearbeiten", "Datei hochladen",
           "Bitte warten Sie einen Moment.", "Ein Fehler ist aufgetreten."],
    "en": ["Save", "Cancel", "Settings", "Sign in", "Sign out", "Forgot your password?", "Next", "Back",
           "Search", "Help", "Delete account", "Changes saved.", "Add to cart", "Proceed to checkout",
           "Accept all", "Learn more", "Edit profile", "Upload a file", "Please wait a moment.",
           "An error occurred."],
}  # fmt: skip


def repeated_workload(
    unique: list[Query], requests: int, share: float, pool: dict[str, list[str]] = UI_STRINGS, seed: int = 0
) -> list[Query]:
    """`requests` queries: a text of `pool` (by source language) in the next unique query's direction with
    probability `share`, else that unique query (each used once; ValueError if there are too few)."""
    rng = random.Random(seed)
    fresh = iter(unique)
    out: list[Query] = []
    for _ in range(requests):
        direction = next(fresh, None)
        if direction is None:
            raise ValueError(f"{len(unique)} unique sentences are too few for {requests} requests")
        if rng.random() < share:
            text = rng.choice(pool[direction.source_language])
            out.append(Query((text,), direction.source_language, direction.target_language))
            fresh = iter([direction, *fresh])  # the unique sentence waits for the next request
        else:
            out.append(direction)
    return out


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User and system CPU time of a process, all its threads, or of its thread `thread`, from /proc (Linux)."""
    stat = Path(f"/proc/{pid}/stat") if thread is None else Path(f"/proc/{pid}/task/{thread}/stat")
    fields = stat.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def one_arm(settings: EngineSettings, variant: str, cache_size: int, queries: list[Query], args: Any) -> dict[str, Any]:
    """One closed-loop run on a fresh server; the server's CPU seconds are less moved by neighbours than wall time."""
    port = free_port()
    server = start_server(settings, port, variant, ["--cache-size", str(cache_size)])
    try:
        cpu_before = cpu_seconds(server.pid)
        summary = asyncio.run(
            loadgen.run_grpc(
                f"127.0.0.1:{port}", queries, args.beam_size, duration_s=3600.0, concurrency=args.concurrency,
                max_requests=len(queries),
            )
        )  # fmt: skip
        cpu = cpu_seconds(server.pid) - cpu_before
    finally:
        server.terminate()
        server.wait(60)
    return {"cache_size": cache_size, "server_cpu_s": cpu, **asdict(summary)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("model/shipped"))
    parser.add_argument("--variant", default="int8")
    parser.add_argument("--data", type=Path, default=Path("data/test.tsv"))
    parser.add_argument("--requests", type=int, default=600, help="requests per arm (one text each)")
    parser.add_argument("--repeat-share", type=float, default=0.3, help="share of requests that repeat a text")
    parser.add_argument(
        "--repeats", choices=("ui", "sentences"), default="ui",
        help="what repeats: interface strings, or 20 test sentences per language kept out of the unique ones",
    )  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop workers")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="cores the server uses (one engine per core)")
    parser.add_argument("--rounds", type=int, default=2, help="times each arm runs, alternating")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    settings = EngineSettings(args.model_dir, "cpu", args.threads, max_len=256, max_batch=16)
    unique, pool = loadgen.load_queries(args.data), UI_STRINGS
    if args.repeats == "sentences":
        unique, kept = unique[:-40], unique[-40:]
        pool = {lang: [q.texts[0] for q in kept if q.source_language == lang] for lang in UI_STRINGS}
    queries = repeated_workload(unique, args.requests, args.repeat_share, pool)
    repeats = sum(1 for q in queries if q.texts[0] in pool[q.source_language])
    runs = [one_arm(settings, args.variant, size, queries, args) for _ in range(args.rounds) for size in (0, 10_000)]
    command = " ".join(["python -m bench.cache_repeats", *(sys.argv[1:] if argv is None else argv)])
    results = {"command": command, "machine": machine(),
               "requests": len(queries), "repeated_requests": repeats, "runs": runs}  # fmt: skip
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
