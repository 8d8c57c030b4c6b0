"""Where the CPU default's resident memory steps up, and what holds it: one engine's working batch
(`--kv-cache auto` on CPU) under ordinary load, then one step at the largest shape the batch can take
(every slot, the longest source, the longest output), then ordinary load again.

    python -m bench.memory_step --model-dir model/shipped --variant int8 [--no-arena]

Prints the resident set (VmRSS) of each phase as JSON, and once more after glibc's `malloc_trim(0)`:
memory that onnxruntime's arena keeps survives the trim; memory only glibc keeps does not.
docs/reliability.md quotes a run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import time
from pathlib import Path

import onnxruntime as ort

from model.tokenizer import TOKENIZER_FILE, Tokenizer
from server.backend import runtime
from server.backend.runners import open_runner
from server.backend.working_batch import WorkingBatchRunner
from server.core.offline import translate_ids
from server.core.runner import EncodeItem


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def without_arena(path: Path, provider: str, intra_op_threads: int, spin_threads: bool = True) -> ort.InferenceSession:
    """`runtime.make_session` with onnxruntime's CPU arena off: every tensor from malloc."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin_threads else "0")
    options.enable_cpu_mem_arena = False
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def ordinary_load(runner: WorkingBatchRunner, tokenizer: Tokenizer, pairs: list[list[str]], seconds: float) -> float:
    """Requests of 1 to 128 test sentences, greedy or beam 4, both directions, for `seconds`: median RSS."""
    rng = random.Random(0)
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        side = rng.randint(0, 1)
        texts = [rng.choice(pairs)[side] for _ in range(rng.choice([1, 16, 64, 128]))]
        sources = [tokenizer.encode_source(t, "en" if side == 0 else "de") for t in texts]
        fitting = [ids for ids in sources if len(ids) <= runner.spec.max_source_len]  # as the server refuses
        translate_ids(runner, fitting, rng.choice([1, 4]), 1.0, None)
        samples.append(rss_mib())
    return statistics.median(samples)


def largest_step(runner: WorkingBatchRunner) -> float:
    """Every slot with the longest source, stepped to the longest output: the batch's largest shape."""
    spec, rng = runner.spec, random.Random(1)
    slots = list(range(runner.max_slots))
    for slot in slots:
        pieces = [rng.randrange(4, spec.vocab_size) for _ in range(spec.max_source_len - 2)]
        runner.encode([EncodeItem([spec.tag_ids["en"], *pieces, spec.eos_id], [slot])])
    for position in range(spec.max_target_len):
        runner.step(slots, [spec.bos_id] * len(slots), [position] * len(slots), [0.0] * len(slots), 4)
    return rss_mib()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("model/shipped"))
    parser.add_argument("--variant", default="int8")
    parser.add_argument("--slots", type=int, default=64, help="the server's default --max-slots")
    parser.add_argument("--load-seconds", type=float, default=30.0)
    parser.add_argument("--data", type=Path, default=Path("data/test.tsv"))
    parser.add_argument("--no-arena", action="store_true", help="onnxruntime's CPU arena off")
    args = parser.parse_args(argv)
    if args.no_arena:
        runtime.make_session = without_arena  # type: ignore[assignment]
    runner = open_runner(args.model_dir / "onnx" / args.variant, args.slots, "cpu", 1, "auto", spin_threads=False)
    assert isinstance(runner, WorkingBatchRunner), "auto on CPU is the working batch"
    tokenizer = Tokenizer(args.model_dir / TOKENIZER_FILE)
    pairs = [line.rstrip("\n").split("\t") for line in args.data.read_text().splitlines()]
    report = {"arena": not args.no_arena, "slots": args.slots, "variant": args.variant, "start_mib": rss_mib()}
    report["load_mib"] = ordinary_load(runner, tokenizer, pairs, args.load_seconds)
    report["largest_step_mib"] = largest_step(runner)
    report["largest_shape"] = list(runner.present[0].shape)  # (W, H, C, Dh)
    report["load_after_mib"] = ordinary_load(runner, tokenizer, pairs, args.load_seconds)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    report["after_malloc_trim_mib"] = rss_mib()
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in report.items()}))


if __name__ == "__main__":
    main()
