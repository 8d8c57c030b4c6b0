"""BLEU and chrF (sacreBLEU) of a model artifact on the held-out test sentences, both directions.

Usage: python -m model.training.evaluate --model-dir model/shipped --test data/test.tsv --beam 1,4 --json scores.json

References are the dictionary's text with annotations stripped: no held-out sentence holds a slash
alternative (see model/data.py), so the slash rule never rewrites one.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import sacrebleu
import torch
from tqdm import tqdm

from model.config import default_output_limit
from model.data import Pair, read_tsv
from model.tokenizer import Tokenizer
from model.training.artifact import TOKENIZER_FILE, load_artifact
from model.training.decode import beam_search
from model.training.transformer import Transformer

DIRECTIONS = {"de-en": ("de", "en"), "en-de": ("en", "de")}


@dataclass(frozen=True)
class Score:
    direction: str  # "de-en" or "en-de"
    beam: int  # 1 is greedy
    bleu: float
    chrf: float
    sentences: int
    seconds: float


def sources_and_refs(pairs: list[Pair], direction: str) -> tuple[list[str], list[str]]:
    src, tgt = DIRECTIONS[direction]
    return [getattr(p, src) for p in pairs], [getattr(p, tgt) for p in pairs]


def translate(
    model: Transformer, tok: Tokenizer, texts: list[str], target: str, beam: int, length_penalty: float = 1.0
) -> list[str]:
    out = []
    for text in tqdm(texts, desc=f"->{target} beam {beam}", mininterval=10, leave=False):
        src = tok.encode_source(text, target)
        max_len = default_output_limit(len(src), model.cfg.max_len)  # as the server decodes by default
        hyp = beam_search(model, src, beam_size=beam, max_len=max_len, length_penalty=length_penalty)[0]
        out.append(tok.decode(list(hyp.tokens)))
    return out


def evaluate(model_dir: Path, pairs: list[Pair], beams: list[int]) -> tuple[list[Score], dict[str, list[str]]]:
    model = load_artifact(model_dir)
    tok = Tokenizer(model_dir / TOKENIZER_FILE)
    scores, outputs = [], {}
    for direction, (_, target) in DIRECTIONS.items():
        sources, refs = sources_and_refs(pairs, direction)
        for beam in beams:
            start = time.time()
            hyps = translate(model, tok, sources, target, beam)
            bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
            chrf = sacrebleu.corpus_chrf(hyps, [refs]).score
            scores.append(
                Score(direction, beam, round(bleu, 2), round(chrf, 2), len(hyps), round(time.time() - start, 1))
            )
            outputs[f"{direction}.beam{beam}"] = hyps
    return scores, outputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=Path("model/shipped"))
    p.add_argument("--test", type=Path, default=Path("data/test.tsv"))
    p.add_argument("--beam", default="1,4", help="comma-separated beam sizes")
    p.add_argument("--limit", type=int, default=0, help="first N test sentences only (0: all)")
    p.add_argument("--json", type=Path, help="write scores here")
    p.add_argument("--outputs", type=Path, help="write the translations here (JSON)")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pairs = read_tsv(args.test)
    if args.limit:
        pairs = pairs[: args.limit]
    scores, outputs = evaluate(args.model_dir, pairs, [int(b) for b in args.beam.split(",")])
    print("| direction | beam | BLEU | chrF | sentences | seconds |\n|---|---|---|---|---|---|")
    for s in scores:
        print(f"| {s.direction} | {s.beam} | {s.bleu} | {s.chrf} | {s.sentences} | {s.seconds} |")
    if args.json:
        args.json.write_text(json.dumps([asdict(s) for s in scores], indent=2) + "\n")
    if args.outputs:
        args.outputs.write_text(json.dumps(outputs, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
