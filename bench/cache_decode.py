"""Whole decodes through each host cache the server can open: the slot cache against the working batch.

`bench.cache_shape` times one batch whose rows start together and never leave, the growing cache's best
case. This runs what an engine does under continuous batching: `server.core.offline.translate_ids` over
the test sentences with `--slots` slots (a finished sentence's slots take the next sentence at once),
through `open_runner(kv_cache=...)` with one intra-op thread, as each of the server's engines runs.
The arms alternate over `--repeats` rounds after a warm-up; the table gives the median tokens/s and
how many sentences each arm translated exactly as the first one did. fp32 results do not depend on
the batch; int8 quantizes each call's activations over the whole batch, so its results move with
what shares a step, under either cache.

Usage: python -m bench.cache_decode --model-dir model/shipped [--variants fp32,int8] [--beams 1,4]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.cache_shape import report, workload_parser
from bench.run import load_workload
from server.backend.runners import open_runner
from server.core.offline import translate_ids

ARMS = ("host", "working")  # --kv-cache values with caches in host memory


@dataclass(frozen=True)
class DecodeRate:
    variant: str
    beam: int
    kv_cache: str
    tokens_per_s: float  # the median round
    same_as_first: int  # sentences whose best hypothesis equals the first arm's
    sentences: int


def decode_rates(variant_dir: Path, sources: list[list[int]], beam: int, slots: int, repeats: int) -> list[DecodeRate]:
    runners = {arm: open_runner(variant_dir, slots * beam, "cpu", 1, arm, spin_threads=False) for arm in ARMS}
    for runner in runners.values():
        translate_ids(runner, sources[:64], beam, 1.0, None)  # warm-up
    rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
    best: dict[str, list[tuple[int, ...]]] = {}
    for round_ in range(repeats):
        for arm in ARMS[round_ % 2 :] + ARMS[: round_ % 2]:
            start = time.perf_counter()
            results = translate_ids(runners[arm], sources, beam, 1.0, None)
            seconds = time.perf_counter() - start
            best[arm] = [tuple(hyps[0].tokens) for hyps in results]
            rates[arm].append(sum(len(tokens) for tokens in best[arm]) / seconds)
    first = best[ARMS[0]]
    return [
        DecodeRate(variant_dir.name, beam, arm, statistics.median(rates[arm]),
                   sum(a == b for a, b in zip(first, best[arm], strict=True)), len(sources))
        for arm in ARMS
    ]  # fmt: skip


def render(rates: list[DecodeRate]) -> str:
    lines = ["| variant | beam | kv cache | tokens/s | over host | same best as host |", "|---|---|---|---|---|---|"]
    host = {(r.variant, r.beam): r.tokens_per_s for r in rates if r.kv_cache == "host"}
    for r in rates:
        ratio = r.tokens_per_s / host[(r.variant, r.beam)]
        row = f"| {r.variant} | {r.beam} | {r.kv_cache} | {r.tokens_per_s:,.0f} | {ratio:.2f}x |"
        lines.append(f"{row} {r.same_as_first}/{r.sentences} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[DecodeRate]:
    parser = workload_parser(__doc__, sentences=100_000, repeats=3)
    parser.add_argument("--slots", type=int, default=32, help="sentences decoding at once")
    args = parser.parse_args(argv)
    sources = load_workload(args.model_dir, args.test, args.sentences).sources
    rates = []
    for variant in args.variants.split(","):
        for beam in (int(b) for b in args.beams.split(",")):
            rates += decode_rates(args.model_dir / "onnx" / variant, sources, beam, args.slots, args.repeats)
    report(render(rates), [asdict(r) for r in rates], args.out)
    return rates


if __name__ == "__main__":
    main()
