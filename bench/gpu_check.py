"""python -m bench.gpu_check [--wheel-parts DIR | --site-parts DIR] [--model-dir DIR | --shape NAME] [--out DIR]

The CUDA path verified end to end on a GPU node, in one command:

1. onnxruntime with CUDA: the installed one, or an onnxruntime-gpu wheel carried in parts (`split -b 25m`;
   --wheel-parts DIR, joined in name order) and installed with `pip --no-deps --target` into a folder put
   first on the path of every later step. Or --site-parts DIR: such a folder already installed elsewhere
   (`pip install --no-deps --target SITE onnxruntime-gpu ...` with the node's Python version), packed as
   `tar -cJf site.tar.xz -C SITE .` and split: xz packs onnxruntime-gpu's CUDA library to about 0.8 of the
   wheel's size, so it travels in fewer parts; it is unpacked into that folder. A `sitecustomize` there
   calls `onnxruntime.preload_dlls()`, which loads the CUDA and cuDNN libraries that torch's wheels carry,
   in every step's interpreter.
2. export: the fp32 and fp16 graphs of the model.
3. parity on CUDA: `python -m bench.parity --provider cuda` (the fp32 graphs against PyTorch).
4. the captured step on CUDA (`python -m bench.static_parity --provider cuda --variants fp16`): the served
   default `--kv-cache fused`, one CUDA graph per row bucket, against the uncaptured working batch, greedy and
   beam 4: at least FUSED_FP16_AGREEMENT of the ids identical.
5. the BLEU gate measured with the CUDA provider (`python -m server.gates.variants --provider cuda`): the record
   that lets `--variant auto` serve fp16 there.
6. the benchmark on CUDA (`python -m bench.run --device cuda`), served and offline, against CTranslate2 and
   PyTorch: the captured step (`onnx-fp16-fused` offline; the served default) beside the uncaptured working
   batch (`onnx-fp16`), and the served levers (GPU_ARMS: the encoder batched across arrivals,
   `--admission-wait-ms 20`; four and eight server processes sharing the two engines), each closed-loop run
   with the engines' own step time, rows per step and busy share read from the server's metrics. The served
   path runs the server's CUDA default of 256 slots per engine.
7. a replica's start to SERVING on CUDA (`python -m bench.startup --cases dir`, fp16, twice): the CUDA
   context, the sessions and the captured graphs, on the graphs built above (startup.json).

`--shape opus-mt-de-en` measures at the size users serve instead of the shipped model: a "model" step builds
a random MarianMTModel of that exact shape through the importer (`python -m bench.opus_size --prepare-only`,
fp32 and fp16 graphs), parity runs on it, the BLEU gate is left out (random weights), and the benchmark adds
transformers' batched `generate` (fp16) on the same weights, CTranslate2 converted from the same directory,
and the served path at 64 and 256 in flight (`--concurrency 64,256`, 16 tokens per sentence).

Each step's output goes to --out, with summary.json; the exit status is 1 if any step failed. `--provider
cpu` runs the same steps on the CPU provider, which is how tests check the command itself: `--provider cpu
--shape tiny-capturable` rehearses the shape's steps on a model small enough for a test whose head size has the
capturable step (`tiny`'s has none: its static step says so and skips).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.marian_random import SHAPES

STEPS = ("onnxruntime", "export", "parity", "static", "gate", "bench", "startup")
# with --shape: random weights, no BLEU gate
SHAPE_STEPS = ("onnxruntime", "model", "parity", "static", "fp16gate", "bench", "startup")
# The captured step is checked in fp16 on CUDA, the precision it serves there; on CPU in both float variants.
STATIC_VARIANTS = {"cuda": "fp16", "cpu": "fp32,fp16"}
# At a shape: 16 tokens per sentence (a random model never stops sooner), the generate baseline and our
# engines offline, fp16 served (what GPU nodes serve) at 64 and 256 in flight: sized so that the whole default
# command fits one `run` call.
SHAPE_BENCH_ARGS = [
    *("--max-len", "16", "--concurrency", "64,256", "--latency-requests", "40", "--sentences", "512"),
    *("--offline-s", "3", "--load-s", "3", "--load-fractions", "0.5,1.0", "--served-variants", "fp16"),
]
# Offline at a shape on CUDA: PyTorch eager (one sentence at a time) is left out, the parity step compares
# the graphs with it; generate on the same weights is the baseline.
SHAPE_ENGINES = {"cuda": ["--engines", "transformers-generate,onnx-fp32,onnx-fp16,onnx-fp16-fused"]}
# A replica's start to SERVING on the model's built graphs, serving what GPU nodes serve (the CPU: how tests
# check the step): the CUDA context, the sessions, and the captured step's graphs at warm-up
STARTUP_FLAGS = {"cuda": "--provider cuda --variant fp16", "cpu": "--provider cpu --variant fp32"}
STARTUP_RUNS = 2
# The served levers on CUDA one at a time against the default (the fused captured step, two engine processes):
# the encoder batched across arrivals, and four and eight server processes in front of the same two engines (how
# far more fronts go). The others measured (one engine, four, the removed cache placements, several processes
# of their own engines) are in bench/results/ and docs/decisions.md.
GPU_ARMS = [
    "--served-arm",
    "fp16-admission-wait=fp16 --admission-wait-ms 20",
    "--served-arm",
    "fp16-4fronts-shared=fp16 --processes 4",
    "--served-arm",
    "fp16-8fronts-shared=fp16 --processes 8",
]
SITECUSTOMIZE = """try:  # written by bench.gpu_check: load the CUDA libraries torch's wheels carry, before any session
    import onnxruntime
    onnxruntime.preload_dlls()
except Exception as err:  # an onnxruntime without preload_dlls, or no such libraries: CUDA may still load
    print(f"preload_dlls: {err}")
"""


@dataclass(frozen=True)
class StepResult:
    name: str
    returncode: int
    seconds: float
    log: str  # file under --out holding the step's output


def join_parts(parts: Path, suffix: str) -> Path:
    """The file the parts `NAME{suffix}.*` in `parts` join into (in name order, as `split` names them),
    written as `NAME{suffix}` in a new temporary folder."""
    pieces = sorted(p for p in parts.iterdir() if p.is_file() and f"{suffix}." in p.name)
    if not pieces:
        raise SystemExit(f"no parts (NAME{suffix}.*) in {parts}")
    joined = Path(tempfile.mkdtemp()) / (pieces[0].name.split(suffix)[0] + suffix)
    with joined.open("wb") as out:
        for piece in pieces:
            out.write(piece.read_bytes())
    return joined


def install_wheel(parts: Path, site: Path) -> list[str]:
    """The command that installs the wheel its parts join into (`X.whl.partaa`, ... -> `X.whl`), with every
    whole wheel beside them (`Y.whl`: the serving dependencies the node lacks, e.g. grpcio-reflection)."""
    wheel = join_parts(parts, ".whl")
    whole = sorted(str(p) for p in parts.iterdir() if p.is_file() and p.name.endswith(".whl"))
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site)]
    return [*pip, str(wheel), *whole]


def unpack_site(parts: Path, site: Path) -> int:
    """Unpack a `tar.xz` split into parts (`NAME.tar.xz.*`, joined in name order) into `site`; the files."""
    joined = join_parts(parts, ".tar.xz")
    with tarfile.open(joined, "r:xz") as archive:
        members = [m for m in archive.getmembers() if m.isfile()]
        archive.extractall(site, filter="data")
    joined.unlink()
    return len(members)


def step_commands(args: argparse.Namespace, site: Path) -> dict[str, list[str]]:
    python, model = sys.executable, str(args.model_dir)
    work = args.out.resolve() / "work"
    shaped: list[str] = []
    if args.shape:
        model = str(work / "model")
        given = {a for a in args.bench_args if a.startswith("--")}
        pairs = [*SHAPE_BENCH_ARGS, *SHAPE_ENGINES.get(args.provider, [])]
        defaults = [v for i in range(0, len(pairs), 2) if pairs[i] not in given for v in pairs[i : i + 2]]
        shaped = ["--hf-dir", str(work / "hf"), *defaults]
    arms = GPU_ARMS if args.provider == "cuda" and "--served-arm" not in args.bench_args else []
    check = (
        "import onnxruntime as ort, sys; print(ort.__version__, ort.get_available_providers()); "
        f"sys.exit({args.provider!r} == 'cuda' and 'CUDAExecutionProvider' not in ort.get_available_providers())"
    )
    limit = ["--limit", str(args.limit)] if args.limit else []
    commands = {
        "onnxruntime": [python, "-c", check],
        "model": [python, "-m", "bench.opus_size", "--prepare-only", "--work", str(work), "--shape", str(args.shape),
                  "--variants", "fp32,fp16"],
        "export": [python, "-m", "export", "--model-dir", model, "--variants", "fp32,fp16",
                   *(["--capturable-fp32"] if args.provider == "cpu" else [])],  # the CPU checks the fp32 step too
        "parity": [python, "-m", "bench.parity", "--model-dir", model, "--provider", args.provider, *limit],
        "static": [python, "-m", "bench.static_parity", "--model-dir", model, "--provider", args.provider,
                   "--variants", STATIC_VARIANTS[args.provider], *limit],
        "gate": [python, "-m", "server.gates.variants", "--model-dir", model, "--provider", args.provider, *limit],
        "fp16gate": [python, "-m", "export.fp16_gate", "--model-dir", model, "--provider", args.provider],
        "bench": [python, "-m", "bench.run", "--model-dir", model, "--device", args.provider,
                  "--out", str(args.out / "bench"), *(["--quick"] if args.quick else []), *shaped, *arms,
                  *args.bench_args],
        "startup": [python, "-m", "bench.startup", "--cases", "dir", "--model-dir", model, "--runs", str(STARTUP_RUNS),
                    "--server-flags", STARTUP_FLAGS[args.provider], "--out", str(args.out / "startup.json")],
    }  # fmt: skip
    if args.wheel_parts is not None:
        commands = {"install": install_wheel(args.wheel_parts, site)} | commands
    steps = args.steps or (SHAPE_STEPS if args.shape else STEPS)
    return {name: command for name, command in commands.items() if name == "install" or name in steps}


def run_step(name: str, command: list[str], out: Path, env: dict[str, str]) -> StepResult:
    log = out / f"{name}.log"
    started = time.monotonic()
    with log.open("w") as sink:
        sink.write("$ " + " ".join(command) + "\n")
        sink.flush()
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=env, check=False)
    return StepResult(name, done.returncode, round(time.monotonic() - started, 1), log.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel-parts", type=Path, default=None, help="folder of a split onnxruntime-gpu wheel")
    parser.add_argument("--site-parts", type=Path, default=None, help="folder of a split tar.xz of an installed site")
    parser.add_argument("--model-dir", type=Path, default=Path("model/shipped"))
    parser.add_argument("--out", type=Path, default=Path("gpu_check"))
    parser.add_argument("--limit", type=int, default=0, help="first N test pairs for parity and the gate (0 = all)")
    parser.add_argument("--provider", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="a random model of this shape")
    parser.add_argument(
        "--steps", type=lambda s: s.split(","), default=None, help=",".join(("model", "fp16gate", *STEPS))
    )
    parser.add_argument("--quick", action="store_true", help="the benchmark's smoke-test size")
    parser.add_argument("--bench-args", type=shlex.split, default=[], help="more bench.run options, one string")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    site = args.out.resolve() / "site"
    site.mkdir(exist_ok=True)
    if args.site_parts is not None:
        print(f"site: {unpack_site(args.site_parts, site)} files from {args.site_parts}")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}
    results = []
    commands = step_commands(args, site)
    for name, command in commands.items():
        results.append(result := run_step(name, command, args.out, env))
        print(f"{name}: {'ok' if result.returncode == 0 else 'FAILED'} in {result.seconds} s ({args.out / result.log})")
        if result.returncode and name in ("install", "onnxruntime", "model", "export"):  # later steps need these
            break
    passed = len(results) == len(commands) and all(r.returncode == 0 for r in results)
    summary = {"provider": args.provider, "passed": passed, "steps": [asdict(r) for r in results]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
