"""Choose the self-attention cache shape by measurement: slot cache against growing cache.

DESIGN names two shapes. The server runs the slot cache (`server.backend.runtime.OnnxRunner`): per layer a
preallocated (slots, H, max_target_len, Dh) array; each step gathers its rows up to the longest
position, the graph returns only the new key/value row, which is written back; a beam reorder copies
the moved slots. The growing cache feeds the decoder's own past + new `Concat` (its `present_*`
outputs) back as the next step's past, so a step whose rows stay the
same copies nothing; a beam reorder gathers the whole batch along the row axis. It runs two ways:
plain `session.run` (present comes back as numpy, a reorder is `np.take`) and IO binding (present
stays an OrtValue, a reorder is the export's kv_gather graph).

All arms decode the same encoded test sentences for the same number of steps, with the same seeded
reorders inside each sentence's beam, and must pick the slot cache's tokens at every step: the run
fails otherwise, so the timings are of the same work. Rows start together and none leaves: the
growing cache's best case (served traffic adds rows that join with a shorter past, which needs
padding, and a compaction once the rows that set the length have left).

Usage: python -m bench.cache_shape --model-dir model/shipped [--variants fp32,int8] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from bench.run import load_workload
from model.directory import KV_GATHER_FILE
from server.backend.device_cache import gather_rows
from server.backend.runtime import CANDIDATE_OUTPUTS, OnnxRunner, kv_names, make_session
from server.core.runner import EncodeItem

log = logging.getLogger("bench.cache_shape")
Ids = npt.NDArray[np.int64]
Arm = Callable[["Case", list[list[int]], list[Ids]], tuple[float, list[Ids]]]


@dataclass(frozen=True)
class Case:
    variant: str
    sentences: int
    beam: int
    steps: int


@dataclass(frozen=True)
class Timing:
    case: Case
    slot_ms: float  # median milliseconds per decoder step, slot cache
    growing_ms: float  # the same, growing cache through plain session.run (present copied out to numpy)
    growing_bound_ms: float  # the same, growing cache through IO binding (present stays an OrtValue)


def beam_reorders(case: Case, seed: int = 0) -> list[Ids]:
    """Per step, the row each row copies from: a random pick inside its own sentence's beam."""
    rng = np.random.default_rng(seed)
    rows, beam = case.sentences * case.beam, case.beam
    base = np.repeat(np.arange(case.sentences) * beam, beam)
    return [base + rng.integers(0, beam, size=rows) for _ in range(case.steps)]


class Decoders:
    """One runner (slot cache) and one present-returning session (growing cache) on the same graph."""

    def __init__(self, variant_dir: Path, max_rows: int, threads: int) -> None:
        self.runner = OnnxRunner(variant_dir, max_rows, "cpu", threads, spin_threads=False)
        meta = self.runner.metadata
        self.present = kv_names("present_k", "present_v", meta.n_decoder_layers)
        self.growing = self.runner.decoder
        self.kv_gather = make_session(variant_dir / KV_GATHER_FILE, "cpu", threads, spin_threads=False)
        self.head_shape = (meta.n_heads, 0, meta.head_dim)  # a past of length 0 at the first step

    def encode(self, sources: list[list[int]], beam: int) -> int:
        items = [EncodeItem(src, list(range(i * beam, (i + 1) * beam))) for i, src in enumerate(sources)]
        self.runner.encode(items)
        return max(len(src) for src in sources)

    def slot(self, case: Case, sources: list[list[int]], reorders: list[Ids]) -> tuple[float, list[Ids]]:
        """Seconds per step and each step's tokens, through the server's runner."""
        self.encode(sources, case.beam)
        rows = list(range(case.sentences * case.beam))
        tokens, picked = [self.runner.spec.bos_id] * len(rows), []
        start = time.perf_counter()
        for position, reorder in enumerate(reorders):
            candidates = self.runner.step(rows, tokens, [position] * len(rows), [0.0] * len(rows), 2 * case.beam)
            picked.append(candidates.ids[:, 0])
            tokens = candidates.ids[reorder, 0].tolist()  # each row continues the row it copies
            if case.beam > 1:
                self.runner.copy_slots(reorder.tolist(), rows)
        return (time.perf_counter() - start) / case.steps, picked

    def _fixed_feeds(self, case: Case, sources: list[list[int]]) -> dict[str, np.ndarray]:
        """Encode, and the feeds no step changes: cross keys/values, source mask, ranking inputs."""
        n_rows, runner = case.sentences * case.beam, self.runner
        src_len = self.encode(sources, case.beam)
        cross = zip(runner.cross_names, runner.cross_kv, strict=True)
        fixed = {name: np.ascontiguousarray(cache[:n_rows, :, :src_len]) for name, cache in cross}
        fixed["src_mask"] = np.ascontiguousarray(runner.src_mask[:n_rows, :src_len])
        return fixed | {"row_scores": np.zeros(n_rows, np.float32), "top_k": np.asarray([2 * case.beam], np.int64)}

    def _step_feeds(self, n_rows: int, tokens: Ids, position: int) -> dict[str, np.ndarray]:
        positions = np.full(n_rows, position, np.int64)
        return {"tokens": tokens, "positions": positions, "past_keep": np.ones((n_rows, position), bool)}

    def grow(self, case: Case, sources: list[list[int]], reorders: list[Ids]) -> tuple[float, list[Ids]]:
        """Seconds per step and each step's tokens, feeding the graph's present back as the next past."""
        n_rows, runner = case.sentences * case.beam, self.runner
        fixed = self._fixed_feeds(case, sources)
        past = [np.zeros((n_rows, *self.head_shape), runner.dtype)] * len(self.present)
        tokens, picked = np.full(n_rows, runner.spec.bos_id, np.int64), []
        start = time.perf_counter()
        for position, reorder in enumerate(reorders):
            feeds = fixed | dict(zip(runner.past_names, past, strict=True)) | self._step_feeds(n_rows, tokens, position)
            _, ids, *past = self.growing.run([*CANDIDATE_OUTPUTS, *self.present], feeds)
            picked.append(ids[:, 0])
            tokens = ids[reorder, 0]
            if case.beam > 1:
                past = [np.take(present, reorder, axis=0) for present in past]
        return (time.perf_counter() - start) / case.steps, picked

    def grow_bound(self, case: Case, sources: list[list[int]], reorders: list[Ids]) -> tuple[float, list[Ids]]:
        """The growing cache through IO binding: `present` stays an OrtValue and goes back in as the
        next past without a copy to numpy; a beam reorder is the export's kv_gather graph."""
        n_rows, runner = case.sentences * case.beam, self.runner
        fixed = self._fixed_feeds(case, sources)
        empty = ort.OrtValue.ortvalue_from_numpy(np.zeros((n_rows, *self.head_shape), runner.dtype))
        past = [empty] * len(self.present)
        tokens, picked = np.full(n_rows, runner.spec.bos_id, np.int64), []
        start = time.perf_counter()
        for position, reorder in enumerate(reorders):
            binding = self.growing.io_binding()
            for name, array in (fixed | self._step_feeds(n_rows, tokens, position)).items():
                binding.bind_cpu_input(name, array)
            for name, value in zip(runner.past_names, past, strict=True):
                binding.bind_ortvalue_input(name, value)
            for name in [*CANDIDATE_OUTPUTS, *self.present]:
                binding.bind_output(name, "cpu")
            self.growing.run_with_iobinding(binding)
            _, ids_value, *past = binding.get_outputs()
            ids = ids_value.numpy()
            picked.append(ids[:, 0])
            tokens = ids[reorder, 0]
            if case.beam > 1:
                past = gather_rows(self.kv_gather, past, reorder, position + 1, "cpu")
        return (time.perf_counter() - start) / case.steps, picked

    def arms(self) -> dict[str, Arm]:
        return {"slot": self.slot, "growing": self.grow, "growing_bound": self.grow_bound}


def measure(decoders: Decoders, case: Case, sources: list[list[int]], repeats: int) -> Timing:
    """Rotate the arms' order each round, discard the first round (warm-up), take the medians; every arm
    must choose the slot cache's tokens at every step."""
    reorders = beam_reorders(case)
    arms = decoders.arms()
    runs: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for round_ in range(repeats + 1):
        picked = {}
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            seconds, picked[name] = arms[name](case, sources, reorders)
            if round_:
                runs[name].append(seconds)
        for name in names[1:]:
            for step, (a, b) in enumerate(zip(picked["slot"], picked[name], strict=True)):
                if not np.array_equal(a, b):
                    raise RuntimeError(f"{case}: {name} chose other tokens than the slot cache at step {step}")
    ms = {name: 1e3 * statistics.median(values) for name, values in runs.items()}
    return Timing(case, ms["slot"], ms["growing"], ms["growing_bound"])


def render(timings: list[Timing]) -> str:
    """Milliseconds per decoder step, and the slot cache's time over each growing cache's (> 1: growing faster)."""
    lines = [
        "| variant | rows (sentences x beam) | steps | slot cache | growing, session.run | growing, IO binding |",
        "|---|---|---|---|---|---|",
    ]
    for t in timings:
        c = t.case
        rows = f"{c.sentences * c.beam} ({c.sentences} x {c.beam})"
        grow, bound = (f"{ms:.2f} ({t.slot_ms / ms:.2f}x)" for ms in (t.growing_ms, t.growing_bound_ms))
        lines.append(f"| {c.variant} | {rows} | {c.steps} | {t.slot_ms:.2f} | {grow} | {bound} |")
    return "\n".join(lines)


def workload_parser(doc: str, sentences: int, repeats: int) -> argparse.ArgumentParser:
    """The arguments both cache benchmarks take: model, test sentences, variants, beams, rounds, output."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--test", type=Path, default=Path("data/test.tsv"))
    parser.add_argument("--variants", default="fp32,int8")
    parser.add_argument("--beams", default="1,4")
    parser.add_argument("--sentences", type=int, default=sentences, help="at most this many test sentences")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    return parser


def report(table: str, records: list[dict[str, object]], out: Path | None) -> None:
    """Print the table; write the records as JSON to `out` if given."""
    print(table)
    if out:
        out.write_text(json.dumps(records, indent=2) + "\n")


def main(argv: list[str] | None = None) -> list[Timing]:
    parser = workload_parser(__doc__, sentences=32, repeats=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sources = load_workload(args.model_dir, args.test, args.sentences).sources
    beams = [int(b) for b in args.beams.split(",")]
    timings = []
    for variant in args.variants.split(","):
        decoders = Decoders(args.model_dir / "onnx" / variant, len(sources) * max(beams), args.threads)
        for beam in beams:
            case = Case(variant, len(sources), beam, min(args.steps, decoders.runner.spec.max_target_len))
            timings.append(measure(decoders, case, sources, args.repeats))
            log.info("%s", timings[-1])
    report(render(timings), [asdict(t) for t in timings], args.out)
    return timings


if __name__ == "__main__":
    main()
