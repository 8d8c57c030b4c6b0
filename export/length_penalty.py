"""python -m export.length_penalty --model-dir DIR [--data data/valid.tsv] [--values 0.6,0.8,1.0,1.2] [--write]

BLEU of beam search at several length penalties (score / length ** penalty), both directions, through
the fp32 export on CPU. Tune on the validation sentences, never on the test set. With `--write` the
best penalty of each direction goes into `<model-dir>/decoding.json`, with the sweep that chose it:
the server's default for a request that sets none (`server.metadata.read_length_penalties`), and
what `export.variants` scores the test set with.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sacrebleu

from export.variants import DIRECTIONS, translate_pairs
from model.artifact import TOKENIZER_FILE
from model.data import Pair, read_tsv
from model.tokenizer import Tokenizer
from server.metadata import DECODING_FILE
from server.runtime import OnnxRunner

Sweep = dict[float, dict[str, float]]  # penalty -> BLEU by direction ("de-en")


def bleu_at(runner: OnnxRunner, tokenizer: Tokenizer, pairs: list[Pair], penalty: float, beam: int) -> dict[str, float]:
    """Corpus BLEU per direction ("de-en", "en-de") at one length penalty."""
    scores = {}
    for src_lang, tgt_lang in DIRECTIONS:
        hypotheses = translate_pairs(runner, tokenizer, pairs, (src_lang, tgt_lang), beam, penalty)
        references = [getattr(p, tgt_lang) for p in pairs]
        scores[f"{src_lang}-{tgt_lang}"] = round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2)
    return scores


def best_per_direction(sweep: Sweep) -> dict[str, float]:
    """The penalty with the highest BLEU in each direction; a tie goes to the one nearest 1.0 (no penalty
    change without evidence), then to the smaller."""
    directions = next(iter(sweep.values())).keys()
    return {d: max(sweep, key=lambda p: (sweep[p][d], -abs(p - 1.0), -p)) for d in directions}


def decoding_record(sweep: Sweep, data: Path, sentences: int, beam: int) -> dict[str, object]:
    """What `decoding.json` holds: the chosen penalties and the evidence for them."""
    return {
        "length_penalty": best_per_direction(sweep),
        "tuned_on": {"data": str(data), "sentences": sentences, "beam_size": beam},
        "bleu_by_length_penalty": {str(p): scores for p, scores in sorted(sweep.items())},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.length_penalty", description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=Path("data/valid.tsv"))
    parser.add_argument("--values", default="0.6,0.8,1.0,1.2", help="comma-separated penalties")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument(
        "--write", action="store_true", help=f"write the best per direction to <model-dir>/{DECODING_FILE}"
    )
    args = parser.parse_args(argv)
    if args.write and args.data.name == "test.tsv":
        parser.error("--write tunes the served defaults: use the validation set, never the test set")
    tokenizer = Tokenizer(args.model_dir / TOKENIZER_FILE)
    runner = OnnxRunner(args.model_dir / "onnx" / "fp32", max_slots=64)
    pairs = read_tsv(args.data)
    sweep: Sweep = {}
    for penalty in (float(v) for v in args.values.split(",")):
        sweep[penalty] = bleu_at(runner, tokenizer, pairs, penalty, args.beam_size)
        print(json.dumps({"length_penalty": penalty, **sweep[penalty]}), flush=True)
    record = decoding_record(sweep, args.data, len(pairs), args.beam_size)
    print(f"best on {args.data} ({len(pairs)} sentences), per direction: {record['length_penalty']}")
    if args.write:
        path = args.model_dir / DECODING_FILE
        path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
