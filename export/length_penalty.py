"""python -m export.length_penalty --model-dir DIR [--data data/valid.tsv] [--values 0.6,0.8,1.0,1.2]

BLEU of beam search at several length penalties (score / length ** penalty), both directions, through
the fp32 export on CPU. Tune on the validation sentences, never on the test set: the chosen value
becomes the server's default (`server.convert.DEFAULT_LENGTH_PENALTY`).
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
from server.runtime import OnnxRunner


def bleu_at(runner: OnnxRunner, tokenizer: Tokenizer, pairs: list[Pair], penalty: float, beam: int) -> dict[str, float]:
    """Corpus BLEU per direction ("de-en", "en-de") at one length penalty."""
    scores = {}
    for src_lang, tgt_lang in DIRECTIONS:
        hypotheses = translate_pairs(runner, tokenizer, pairs, (src_lang, tgt_lang), beam, penalty)
        references = [getattr(p, tgt_lang) for p in pairs]
        scores[f"{src_lang}-{tgt_lang}"] = round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2)
    return scores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.length_penalty", description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=Path("data/valid.tsv"))
    parser.add_argument("--values", default="0.6,0.8,1.0,1.2", help="comma-separated penalties")
    parser.add_argument("--beam-size", type=int, default=4)
    args = parser.parse_args(argv)
    tokenizer = Tokenizer(args.model_dir / TOKENIZER_FILE)
    runner = OnnxRunner(args.model_dir / "onnx" / "fp32", max_slots=64)
    pairs = read_tsv(args.data)
    results = {}
    for penalty in (float(v) for v in args.values.split(",")):
        results[penalty] = bleu_at(runner, tokenizer, pairs, penalty, args.beam_size)
        print(json.dumps({"length_penalty": penalty, **results[penalty]}), flush=True)
    best = max(results, key=lambda p: sum(results[p].values()))
    print(f"best on {args.data} ({len(pairs)} sentences): length penalty {best}: {results[best]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
