"""How long a new replica takes from its process start to SERVING, in the cases a scale-out meets.

Each case starts `translate-server` on a free loopback port and polls its health every 50 ms until every
model is loaded and warm (SERVING), then stops it; the image pull and pod scheduling before the process
starts are the cluster's and not measured here. Cases:

- `shipped`: the shipped model with its graphs built (a replica on a node that has them);
- `shipped-build`: the shipped model without graphs: the server builds them at start (torch-free builder);
- `opus-dir`: a random model of opus-mt-de-en's shape (bench.marian_random), imported and built once, served
  from its directory (a replica with a warm model volume);
- `opus-hub`: the same model as a hub id from a Hugging Face cache laid out by hand, offline, into an empty
  model cache: import, graph building (fp32 and int8) and load at start (a replica on a fresh node whose
  download is done; the download itself depends on the network);
- `dir`: the model directory `--model-dir` names, its graphs built (how `bench.gpu_check` times a GPU
  replica: creating the CUDA context and sessions, and capturing the step's graphs at warm-up).

`--server-flags` adds flags to every case's server (`--provider cuda --variant fp16`, say).

    python -m bench.startup --cases shipped,shipped-build,opus-dir,opus-hub --runs 3 [--out startup.json]
    python -m bench.startup --cases dir --model-dir DIR --server-flags "--provider cuda" --runs 2

Prints each run's seconds to SERVING, the graph build time the server logged and the resident memory of the
server and its engine processes once SERVING (Linux's /proc) as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.burst import serving
from bench.marian_random import build_marian_dir

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "model" / "shipped"
CASES = ("shipped", "shipped-build", "opus-dir", "opus-hub", "dir")
POLL_S = 0.05
START_TIMEOUT_S = 900.0
REPO = "Helsinki-NLP/opus-mt-de-en"
SNAPSHOT = "0" * 40


@dataclass(frozen=True)
class Start:
    case: str
    run: int
    seconds_to_serving: float
    graph_build_seconds: float | None  # what the server logged for building graphs at start, if it did
    resident_mb: int  # the server's and its engine processes' resident memory once SERVING, summed
    load_average: float  # the machine's 1-minute load average as the run ended: other work slows a start


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return int(probe.getsockname()[1])


def resident_mb(pid: int) -> int:
    """Resident memory of process `pid` and all its descendants, in MB."""
    total_kb, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            children = [Path(f"/proc/{current}/task/{task}/children").read_text().split()
                        for task in os.listdir(f"/proc/{current}/task")]  # fmt: skip
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
        total_kb += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        pending += [int(child) for task_children in children for child in task_children]
    return total_kb // 1024


def time_to_serving(flags: list[str], env: dict[str, str], log: Path) -> tuple[float, int]:
    """Seconds from spawning `translate-server flags` to its first SERVING answer, and then its resident MB
    (`resident_mb`); the server is stopped."""
    port = free_port()
    command = [sys.executable, "-m", "server.edge.main", "--host", "localhost", "--port", str(port)]
    started = time.monotonic()
    with log.open("w") as sink:
        process = subprocess.Popen([*command, "--metrics-port", "-1", *flags], stderr=sink, cwd=ROOT, env=env)
    try:
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            while not serving(channel):
                if process.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                    raise RuntimeError(f"the server did not become SERVING; see {log}")
                time.sleep(POLL_S)
        return time.monotonic() - started, resident_mb(process.pid)
    finally:
        process.terminate()
        process.wait(60)


def logged_build_seconds(log: Path) -> float | None:
    """The build time the server logged, summed over models: graphs built for a directory ("built the graphs
    of DIR in X s") or a hub id imported and built ("built ID: N MB in X s")."""
    found = re.findall(r"built (?:the graphs of .*|\S+: [0-9.]+ MB) in ([0-9.]+) s", log.read_text())
    return sum(float(s) for s in found) if found else None


def hub_layout(hub: Path, source: Path) -> None:
    """`source`'s files as the snapshot of REPO in a Hugging Face cache at `hub`, refs/main naming it."""
    folder = hub / ("models--" + REPO.replace("/", "--"))
    shutil.copytree(source, folder / "snapshots" / SNAPSHOT)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(SNAPSHOT)


def prepare_opus(work: Path) -> tuple[Path, Path]:
    """The opus-mt-de-en-shaped transformers directory, and it imported with its graphs built."""
    hf = build_marian_dir(work / "hf", shape="opus-mt-de-en")
    model = work / "model"
    for step in (["export.hf", "--model", str(hf), "--out", str(model)], ["export", "--model-dir", str(model)]):
        subprocess.run([sys.executable, "-m", *step], check=True, cwd=ROOT, capture_output=True)
    return hf, model


def case_flags(
    case: str, work: Path, run: int, opus: tuple[Path, Path] | None, given: Path | None = None
) -> tuple[list[str], dict[str, str]]:
    """The server flags and environment of one run of `case`, its files prepared fresh under `work`; `given`:
    the `dir` case's model directory."""
    env = dict(os.environ)
    if case == "dir":
        assert given is not None
        return ["--model-dir", str(given)], env
    if case == "shipped":
        return ["--model-dir", str(SHIPPED)], env
    if case == "shipped-build":
        copy = work / f"shipped-{run}"
        shutil.copytree(SHIPPED, copy, ignore=shutil.ignore_patterns("onnx"))
        return ["--model-dir", str(copy)], env
    assert opus is not None
    hf, model = opus
    if case == "opus-dir":
        return ["--model-dir", str(model)], env
    hub, cache = work / f"hub-{run}", work / f"cache-{run}"
    hub_layout(hub, hf)
    env |= {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    return ["--model", REPO, "--cache-dir", str(cache)], env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write every run here as JSON")
    parser.add_argument("--model-dir", type=Path, help="the `dir` case's model directory, its graphs built")
    parser.add_argument("--server-flags", default="", help="flags for every case's server, as one string")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    if unknown := set(cases) - set(CASES):
        parser.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    if "dir" in cases and args.model_dir is None:
        parser.error("the dir case needs --model-dir")
    starts: list[Start] = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        work = Path(tmp)
        opus = prepare_opus(work / "opus") if {"opus-dir", "opus-hub"} & set(cases) else None
        for run in range(args.runs):
            for case in cases:  # the cases alternate, so a machine's drift spreads over all of them
                flags, env = case_flags(case, work, run, opus, args.model_dir)
                log = work / f"{case}-{run}.log"
                seconds, resident = time_to_serving([*flags, *shlex.split(args.server_flags)], env, log)
                start = Start(case, run, round(seconds, 2), logged_build_seconds(log), resident, os.getloadavg()[0])
                starts.append(start)
                print(json.dumps(asdict(start)), flush=True)
    if args.out:
        args.out.write_text(json.dumps([asdict(s) for s in starts], indent=1) + "\n")


if __name__ == "__main__":
    main()
