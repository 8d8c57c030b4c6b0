"""The engine's own cost per iteration, over a runner that costs nothing.

On a GPU a captured decoder step takes 1.4-4 ms at opus-mt's shape (docs/benchmarks.md): the engine's Python
between two steps (scheduling, the beams, slot bookkeeping, delivering events) is then as long as the step
itself, and it is what keeps the GPU waiting. This measures that Python alone: `server.core.engine.Engine`
steps a runner whose `step` returns ranked candidates at once (no graph), over a queue of sentences that end
at varied lengths, so sentences finish and join every iteration as they do in service. It reports
microseconds per iteration (the median and the minimum of `--repeats` runs) per beam size.

Usage:
    python -m bench.engine_host --slots 256 --repeats 7
    python -m bench.engine_host --slots 256 --profile 4      # also cProfile one beam-4 run
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from model.directory import ModelSpec
from server.core.engine import Engine
from server.core.events import EngineLimits, Event
from server.core.runner import Candidates, EncodeItem
from server.core.work import DecodeOptions

SPEC = ModelSpec(
    vocab_size=58101, max_source_len=512, max_target_len=512, bos_id=58100, eos_id=0, pad_id=58100, tag_ids={},
    pairs=(("de", "en"),), source_vocab_size=58101,
)  # fmt: skip  # opus-mt-de-en's vocabulary and special ids
SOURCE = [4, *range(20, 34), SPEC.eos_id]  # 16 source tokens, as a typical sentence has
ENDS_ONE_ROW_IN = 23  # about one row in this many ends its sentence at each step: varied lengths


def fixed_candidates(row_scores: list[float], k: int) -> Candidates:
    """Every row's k candidates as a runner ranks them, the same tokens for all: ids 10.., each 1 below the last."""
    offsets = np.arange(1, k + 1, dtype=np.float32)
    scores = (np.asarray(row_scores, np.float32)[:, None] - offsets[None, :]).astype(np.float32)
    ids = np.broadcast_to(np.arange(10, 10 + k, dtype=np.int64), scores.shape).copy()
    return Candidates(scores, ids)


@dataclass
class NullRunner:
    """Ranks the same candidates for every row at once; a row ends its sentence where (slot, position) says."""

    max_slots: int
    spec: ModelSpec = SPEC

    def encode(self, items: list[EncodeItem]) -> None:
        pass

    def step(
        self, slots: list[int], tokens: list[int], positions: list[int], row_scores: list[float], k: int
    ) -> Candidates:
        candidates = fixed_candidates(row_scores, k)
        ids = candidates.ids
        where = np.asarray(slots) * 7 + np.asarray(positions) * 13
        ids[(where % ENDS_ONE_ROW_IN == 0) & (np.asarray(positions) > 2), 0] = self.spec.eos_id
        return candidates

    def copy_slots(self, sources: list[int], destinations: list[int]) -> None:
        pass


def iteration_us(beam: int, slots: int, sentences: int, max_len: int, profile: cProfile.Profile | None = None) -> float:
    """Microseconds per engine iteration while `sentences` queued sentences of `beam` decode to the end."""
    engine = Engine(NullRunner(slots), EngineLimits(max_slots=slots, max_queue_sentences=sentences))
    finished = [0]

    def on_event(event: Event) -> None:
        finished[0] += 1  # a SentenceDone and a RequestDone per one-sentence request

    options = DecodeOptions(beam_size=beam, max_output_len=max_len)
    for _ in range(sentences):
        engine.submit([SOURCE], options, on_event)
    iterations, started = 0, time.perf_counter()
    if profile is not None:
        profile.enable()
    while finished[0] < 2 * sentences:
        engine.step()
        iterations += 1
    if profile is not None:
        profile.disable()
    return 1e6 * (time.perf_counter() - started) / iterations


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=256, help="decoding rows the engine steps at once")
    parser.add_argument("--beams", type=lambda s: [int(b) for b in s.split(",")], default=[1, 4])
    parser.add_argument("--rows-of-work", type=int, default=12, help="queued rows, in multiples of --slots")
    parser.add_argument("--max-len", type=int, default=48, help="most tokens a sentence makes")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", type=int, default=0, help="cProfile one run at this beam size")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    for beam in args.beams:
        sentences = max(1, args.slots * args.rows_of_work // beam)
        runs = [iteration_us(beam, args.slots, sentences, args.max_len) for _ in range(args.repeats)]
        results[f"beam{beam}"] = {"median_us": statistics.median(runs), "min_us": min(runs)}
        print(f"beam {beam}, {args.slots} slots: {statistics.median(runs):.0f} us per iteration (min {min(runs):.0f})")
    if args.profile:
        profile = cProfile.Profile()
        iteration_us(
            args.profile, args.slots, max(1, args.slots * args.rows_of_work // args.profile), args.max_len, profile
        )
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(15)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
