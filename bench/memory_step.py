"""Where the CPU default's resident memory steps up, and whether it comes back: one engine's working batch
(`--kv-cache auto` on CPU) under ordinary load, then the largest shapes the engine can meet (an encode of
every slot padded to the longest source within the scheduler's encode budget, then a step of every slot
at the longest source and the longest output), then ordinary load again.

    python -m bench.memory_step --model-dir model/shipped --variant int8 [--memory release|keep|no-arena]

`--memory` picks how memory goes back: `release` is the server's (`server.backend.arena_release`: the
arena shrinks and glibc's heap is trimmed once a session's calls fall to half their largest size), `keep`
never gives back (the arena keeps its peak), `no-arena` runs the sessions without onnxruntime's CPU arena
and only trims the heap at those moments. Prints one JSON line: the resident set (VmRSS) of each phase,
target tokens per second of both load phases, the CPU seconds of the largest shapes, the resident set at
and after each further spike (`--spikes`), the releases made, and the resident set after a final
`malloc_trim(0)`. docs/reliability.md quotes runs.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnxruntime as ort

from model.tokenizer import TOKENIZER_FILE, Tokenizer
from server.backend import runtime
from server.backend.arena_release import RELEASE_RATIO, RELEASE_SPACING, ArenaRelease, trim_heap
from server.backend.runners import open_runner
from server.backend.working_batch import WorkingBatchRunner
from server.core.events import EngineLimits
from server.core.offline import translate_ids
from server.core.runner import EncodeItem

MEMORY = ("release", "keep", "no-arena")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmRSS in /proc/self/status")


def without_arena(path: Path, provider: str, intra_op_threads: int, spin_threads: bool = True) -> ort.InferenceSession:
    """`runtime.make_session` with onnxruntime's CPU arena off: every tensor from malloc."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin_threads else "0")
    options.enable_cpu_mem_arena = False
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


class KeepArena(ArenaRelease):
    """Never releases: every call runs as the session's own `run`."""

    def run(
        self, session: ort.InferenceSession, names: Sequence[str] | None, feeds: Mapping[str, Any], size: int
    ) -> list[Any]:
        return session.run(names, feeds)


def open_engine(variant_dir: Path, slots: int, memory: str, release: ArenaRelease) -> WorkingBatchRunner:
    """The server's CPU default runner, its memory handled as `memory` says (`release` for release and no-arena)."""
    if memory == "no-arena":
        runtime.make_session = without_arena  # type: ignore[assignment]
    runner = open_runner(variant_dir, slots, "cpu", 1, "auto", spin_threads=False)
    assert isinstance(runner, WorkingBatchRunner), "auto on CPU is the working batch"
    runner.memory = KeepArena() if memory == "keep" else release
    if memory == "no-arena":
        runner.memory.release_options = None
    return runner


def ordinary_load(
    runner: WorkingBatchRunner, tokenizer: Tokenizer, pairs: list[list[str]], requests: int
) -> dict[str, float]:
    """`requests` requests of 1 to 128 test sentences, greedy or beam 4, both directions, the same for every
    run: the median and last resident set, and target tokens per second of wall time and of this process's CPU
    time (the CPU figure holds on a loaded machine, where the wall figure follows what other processes take)."""
    rng = random.Random(0)
    samples, tokens = [], 0
    start, before = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(requests):
        side = rng.randint(0, 1)
        texts = [rng.choice(pairs)[side] for _ in range(rng.choice([1, 16, 64, 128]))]
        sources = [tokenizer.encode_source(t, "en" if side == 0 else "de") for t in texts]
        fitting = [ids for ids in sources if len(ids) <= runner.spec.max_source_len]  # as the server refuses
        results = translate_ids(runner, fitting, rng.choice([1, 4]), 1.0, None)
        tokens += sum(len(hypotheses[0].tokens) for hypotheses in results)
        samples.append(rss_mib())
    wall, after = time.monotonic() - start, resource.getrusage(resource.RUSAGE_SELF)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {"median_mib": round(statistics.median(samples), 1), "last_mib": samples[-1],
            "tokens_per_s": round(tokens / wall, 1), "tokens_per_cpu_s": round(tokens / (user + system), 1),
            "user_s": round(user, 2), "system_s": round(system, 2),
            "minor_faults": after.ru_minflt - before.ru_minflt}  # fmt: skip


def largest_shapes(runner: WorkingBatchRunner) -> float:
    """The largest encode (every slot, padded to the longest source, within the scheduler's encode budget)
    and the largest step (every slot at the longest source, stepped to the longest output): the RSS after."""
    spec, rng, slots = runner.spec, random.Random(1), list(range(runner.max_slots))
    budget = EngineLimits(max_slots=runner.max_slots).max_encode_tokens
    short = min(spec.max_source_len, (budget - spec.max_source_len) // max(1, len(slots) - 1))
    items = []
    for slot in slots:
        length = spec.max_source_len if slot == 0 else short
        pieces = [rng.randrange(4, spec.vocab_size) for _ in range(length - 2)]
        items.append(EncodeItem([spec.tag_ids["en"], *pieces, spec.eos_id], [slot]))
    runner.encode(items)
    for position in range(spec.max_target_len):
        runner.step(slots, [spec.bos_id] * len(slots), [position] * len(slots), [0.0] * len(slots), 4)
    return rss_mib()


def spike(runner: WorkingBatchRunner, tokenizer: Tokenizer, pairs: list[list[str]], requests: int) -> list[float]:
    """The largest shapes once more, then ordinary load: [RSS at the largest, RSS after the load]."""
    largest = largest_shapes(runner)
    return [largest, ordinary_load(runner, tokenizer, pairs, requests)["last_mib"]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("model/shipped"))
    parser.add_argument("--variant", default="int8")
    parser.add_argument("--slots", type=int, default=64, help="the server's default --max-slots")
    parser.add_argument("--requests", type=int, default=20, help="requests per load phase")
    parser.add_argument("--data", type=Path, default=Path("data/test.tsv"))
    parser.add_argument("--memory", choices=MEMORY, default="release", help="how memory goes back (see above)")
    parser.add_argument("--spikes", type=int, default=1, help="times the largest shapes come, each then load")
    parser.add_argument("--release-ratio", type=int, default=RELEASE_RATIO, help="release at 1 / this of the largest")
    parser.add_argument("--release-spacing", type=int, default=RELEASE_SPACING, help="calls between two releases")
    args = parser.parse_args(argv)
    release = ArenaRelease(args.release_ratio, args.release_spacing)
    runner = open_engine(args.model_dir / "onnx" / args.variant, args.slots, args.memory, release)
    tokenizer = Tokenizer(args.model_dir / TOKENIZER_FILE)
    pairs = [line.rstrip("\n").split("\t") for line in args.data.read_text().splitlines()]
    report: dict[str, Any] = {"memory": args.memory, "slots": args.slots, "variant": args.variant}
    report |= {"release_ratio": args.release_ratio, "release_spacing": args.release_spacing}
    report["start_mib"] = rss_mib()
    report["load"] = ordinary_load(runner, tokenizer, pairs, args.requests)
    before = resource.getrusage(resource.RUSAGE_SELF)
    report["largest_mib"] = largest_shapes(runner)
    after = resource.getrusage(resource.RUSAGE_SELF)
    report["largest_cpu_s"] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2)
    report["largest_shape"] = list(runner.present[0].shape)  # (W, H, C, Dh)
    report["load_after"] = ordinary_load(runner, tokenizer, pairs, args.requests)
    report["more_spikes_mib"] = [spike(runner, tokenizer, pairs, args.requests) for _ in range(args.spikes - 1)]
    report["releases"] = runner.memory.releases
    trim_heap()
    report["after_malloc_trim_mib"] = rss_mib()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
