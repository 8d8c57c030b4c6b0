"""python -m server.gates.length_penalty --model-dir DIR [--data data/valid.tsv] [--values 0.6,0.8,1.0,1.2] [--write]

BLEU of beam search at several length penalties (score / length ** penalty), both directions, through
the fp32 export on CPU. Tune on the validation sentences, never on the test set.

With `--write`, each direction's default goes into `<model-dir>/decoding.json`, with the sweep behind
it: the best penalty if it beats 1.0 by sacreBLEU's paired bootstrap test (Koehn 2004; 1,000
resamples, p < 0.05), else 1.0. A few hundred validation sentences move BLEU by tenths from noise
alone, and a default that only fits the noise would serve every request worse. The server uses the
file for a request that sets no penalty (`model.directory.read_length_penalties`), and
`server.gates.variants` scores the test set with it. Run it after each export of new weights: the file
names the weights it was tuned on, and the server refuses a file tuned on others.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import sacrebleu
from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest, Result

from model.data import read_tsv
from model.directory import (
    DECODING_FILE,
    DEFAULT_LENGTH_PENALTY,
    EVERY_DIRECTION,
    MAX_LENGTH_PENALTY,
    direction_name,
    read_metadata,
)
from model.files import TOKENIZER_FILE
from model.tokenizer import Tokenizer
from server.backend.working_batch import WorkingBatchRunner
from server.gates.variants import DIRECTIONS, TEST_FILE, translate_pairs

SIGNIFICANCE = 0.05  # a default other than 1.0 must beat 1.0 at this p-value
BOOTSTRAP_SAMPLES = 1000

Hypotheses = dict[float, list[str]]  # penalty -> one output per validation sentence


def best_penalty(bleu: dict[float, float]) -> float:
    """The penalty with the highest BLEU; a tie goes to the one nearest 1.0, then to the smaller."""
    return max(bleu, key=lambda p: (bleu[p], -round(abs(p - DEFAULT_LENGTH_PENALTY), 9), -p))


def paired_bootstrap_p(baseline: list[str], candidate: list[str], references: list[str]) -> float:
    """p-value that `candidate` is no better than `baseline` in BLEU (sacreBLEU's paired bootstrap, fixed seed)."""
    test = PairedTest(
        [("baseline", baseline), ("candidate", candidate)],
        {"BLEU": BLEU()},
        [references],
        test_type="bs",
        n_samples=BOOTSTRAP_SAMPLES,
    )
    _, results = test()
    candidate_result = results["BLEU"][1]  # [0] is the baseline
    assert isinstance(candidate_result, Result)
    return 1.0 if candidate_result.p_value is None else float(candidate_result.p_value)


@dataclass(frozen=True)
class Choice:
    """One direction's default and the evidence for it."""

    length_penalty: float  # the default: `best` if it beat 1.0 significantly, else 1.0
    best: float  # highest BLEU on the validation set
    p_value: float  # paired bootstrap, `best` against 1.0 (1.0 when best is 1.0 or no better)
    bleu_by_length_penalty: dict[str, float]


def choose(hypotheses: Hypotheses, references: list[str]) -> Choice:
    """One direction's default from its outputs at each penalty (1.0 among them)."""
    bleu = {p: round(sacrebleu.corpus_bleu(h, [references]).score, 2) for p, h in hypotheses.items()}
    best = best_penalty(bleu)
    p_value = 1.0
    if best != DEFAULT_LENGTH_PENALTY and bleu[best] > bleu[DEFAULT_LENGTH_PENALTY]:
        p_value = paired_bootstrap_p(hypotheses[DEFAULT_LENGTH_PENALTY], hypotheses[best], references)
    return Choice(
        length_penalty=best if p_value < SIGNIFICANCE else DEFAULT_LENGTH_PENALTY,
        best=best,
        p_value=round(p_value, 4),
        bleu_by_length_penalty={str(p): b for p, b in sorted(bleu.items())},
    )


def parse_values(text: str) -> list[float]:
    values = [float(v) for v in text.split(",")]
    if not all(math.isfinite(v) and 0.0 <= v <= MAX_LENGTH_PENALTY for v in values):
        raise ValueError(f"length penalties must be in 0..{MAX_LENGTH_PENALTY}, got {text}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.gates.length_penalty", description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=Path("data/valid.tsv"))
    parser.add_argument("--values", default="0.6,0.8,1.0,1.2", help="comma-separated penalties")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--write", action="store_true", help=f"write each direction's default to {DECODING_FILE}")
    args = parser.parse_args(argv)
    try:
        values = parse_values(args.values)
    except ValueError as err:
        parser.error(str(err))
    if args.write and args.data.resolve() == TEST_FILE.resolve():
        parser.error("--write sets the served defaults: tune on the validation set, never on the test set")
    if args.write and DEFAULT_LENGTH_PENALTY not in values:
        parser.error(f"--write compares each penalty with {DEFAULT_LENGTH_PENALTY}: include it in --values")
    if read_metadata(args.model_dir / "onnx" / "fp32").spec().directions.any_to_any:
        print(
            f"server.gates.length_penalty: {args.model_dir} translates any of its languages into any other; "
            f'per-direction tuning does not apply: {DECODING_FILE} keeps one default, "{EVERY_DIRECTION}", '
            "from its generation config",
            file=sys.stderr,
        )
        return 2
    tokenizer = Tokenizer(args.model_dir / TOKENIZER_FILE)
    runner = WorkingBatchRunner(args.model_dir / "onnx" / "fp32", max_slots=64)
    pairs = read_tsv(args.data)
    outputs: dict[str, Hypotheses] = {direction_name(s, t): {} for s, t in DIRECTIONS}
    for penalty in values:
        row: dict[str, float] = {}
        for src, tgt in DIRECTIONS:
            hyps = translate_pairs(runner, tokenizer, pairs, (src, tgt), args.beam_size, penalty)
            outputs[direction_name(src, tgt)][penalty] = hyps
            references = [getattr(p, tgt) for p in pairs]
            row[direction_name(src, tgt)] = round(sacrebleu.corpus_bleu(hyps, [references]).score, 2)
        print(json.dumps({"length_penalty": penalty, **row}), flush=True)
    if not args.write:
        return 0
    chosen = {
        direction_name(s, t): choose(outputs[direction_name(s, t)], [getattr(p, t) for p in pairs])
        for s, t in DIRECTIONS
    }
    record = {
        "length_penalty": {name: c.length_penalty for name, c in chosen.items()},
        "weights_sha256": runner.metadata.source_sha256,
        "tuned_on": {
            "data": str(args.data), "sentences": len(pairs), "beam_size": args.beam_size,
            "rule": f"best penalty if it beats {DEFAULT_LENGTH_PENALTY} by paired bootstrap "
            f"({BOOTSTRAP_SAMPLES} resamples) at p < {SIGNIFICANCE}",
        },
        "directions": {name: asdict(c) for name, c in chosen.items()},
    }  # fmt: skip
    path = args.model_dir / DECODING_FILE
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path}: {record['length_penalty']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
