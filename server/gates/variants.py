"""python -m server.gates.variants --model-dir DIR [--provider cpu|cuda] [--limit N]: BLEU per variant and the 0.5 gate.

Decodes data/test.tsv in both directions with beam 4 through each variant's runner and caches as the
server opens them on the provider, at the length penalty the server defaults to for each direction
(`decoding.json`, tuned on validation; else 1.0), scores with sacreBLEU, times one decoder step at 1 and
64 rows, and writes the provider's record into `<model-dir>/variants.json` (other providers' records are
kept); a variant passes if its BLEU in each direction is within 0.5 of fp32's.
`model.directory.choose_variant` reads the record of the provider it serves with, and trusts it only for
the weights it names, a run over the whole test set with beam 4 and today's length penalties, and for
int8 a CPU of the same int8 class as the one measured on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import sacrebleu

from model.data import Pair, read_tsv
from model.directory import (
    VARIANTS_FILE,
    available_variants,
    direction_name,
    int8_kernels,
    read_length_penalties,
    read_metadata,
)
from model.files import load_config
from model.tokenizer import TextTokenizer, open_tokenizer
from server.backend.runners import open_runner
from server.backend.runtime import PROVIDERS, OnnxRunner
from server.core.offline import translate_ids
from server.core.runner import EncodeItem, Runner

BLEU_GATE = 0.5
TEST_FILE = Path(__file__).resolve().parents[2] / "data" / "test.tsv"
DIRECTIONS = (("de", "en"), ("en", "de"))  # the test set's; a model is gated on those of them it translates
STEP_ROWS = (1, 64)  # decoder-step latency is reported for one row and for a full batch of rows


def variant_bleu(
    model_dir: Path, variant: str, limit: int | None, beam_size: int, length_penalty: dict[str, float],
    provider: str = "cpu",
) -> dict[str, float]:  # fmt: skip
    """BLEU per direction ("de-en", "en-de") and the mean per-step wall time of this variant."""
    tokenizer = model_tokenizer(model_dir)
    directions = tested_directions(tokenizer)
    # The runner and caches the server opens on this provider (`--kv-cache auto`): int8 results move slightly
    # with what shares a step, so the gate measures the serving cache, not another.
    runner = open_runner(model_dir / "onnx" / variant, max_slots=64, provider=provider)
    if runner.provider != PROVIDERS[provider]:  # onnxruntime falls back to CPU with a warning only
        raise SystemExit(f"asked for the {provider} provider, onnxruntime gave {runner.provider}: a gate measured "
                         f"there would be recorded as {provider}'s")  # fmt: skip
    max_source = runner.spec.max_source_len
    fits = [
        p
        for p in read_tsv(TEST_FILE)
        if all(len(tokenizer.encode_source(getattr(p, s), t)) <= max_source for s, t in directions)
    ]
    pairs = fits[:limit]  # the shipped model fits every test sentence; a tiny test model may not
    scores: dict[str, float] = {"sentences": len(pairs)}
    for src_lang, tgt_lang in directions:
        name = direction_name(src_lang, tgt_lang)
        penalty = length_penalty[name]
        start = time.perf_counter()
        hypotheses = translate_pairs(runner, tokenizer, pairs, (src_lang, tgt_lang), beam_size, penalty)
        scores[f"{name}_seconds"] = round(time.perf_counter() - start, 2)
        references = [getattr(p, tgt_lang) for p in pairs]
        scores[name] = round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2)
        scores[f"{name}_chrf"] = round(sacrebleu.corpus_chrf(hypotheses, [references]).score, 2)
    source = tokenizer.encode_source(getattr(pairs[0], directions[0][0]), directions[0][1])
    for rows in STEP_ROWS:
        scores[f"step_ms_{rows}_rows"] = step_latency_ms(runner, source, rows)
    return scores


def model_tokenizer(model_dir: Path) -> TextTokenizer:
    cfg = load_config(model_dir)
    return open_tokenizer(model_dir, cfg.tokenizer, cfg.tokenizer_sha256)


def tested_directions(tokenizer: TextTokenizer) -> list[tuple[str, str]]:
    """The test set's directions that the model translates; none is an error (nothing to gate on)."""
    directions = [d for d in DIRECTIONS if tokenizer.directions.translates(*d)]
    if not directions:
        raise SystemExit(f"the model translates {tokenizer.directions}; {TEST_FILE} holds de-en and en-de only")
    return directions


def translate_pairs(
    runner: Runner,
    tokenizer: TextTokenizer,
    pairs: list[Pair],
    direction: tuple[str, str],
    beam_size: int,
    length_penalty: float,
) -> list[str]:
    """Best beam hypothesis for each pair's `direction[0]` side, as text, at the server's default output limit."""
    src_lang, tgt_lang = direction
    sources = [tokenizer.encode_source(getattr(p, src_lang), tgt_lang) for p in pairs]
    best = translate_ids(runner, sources, beam_size, length_penalty, None)
    return [tokenizer.decode(list(h[0].tokens)) for h in best]


def step_latency_ms(runner: OnnxRunner, source: list[int], rows: int, steps: int = 20) -> float:
    """Median wall time of one serving decoder step (beam-4 ranking: 8 candidates per row) for `rows` rows at
    positions 0..steps-1 (CPU, no beam logic)."""
    runner.encode([EncodeItem(source, list(range(rows)))])
    times = []
    for position in range(steps):
        start = time.perf_counter()
        runner.step(list(range(rows)), [runner.spec.bos_id] * rows, [position] * rows, [0.0] * rows, 8)
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 3)


def mark_passed(results: dict[str, dict[str, Any]], gate: float, directions: list[tuple[str, str]]) -> None:
    """Set each variant's `passed`: within `gate` BLEU of fp32 in every direction (fp32 passes itself)."""
    reference = results["fp32"]
    for scores in results.values():
        scores["passed"] = all(scores[f"{s}-{t}"] >= reference[f"{s}-{t}"] - gate for s, t in directions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.gates.variants", description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=None, help="first N test pairs (default: all)")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cpu", help="the one that will serve")
    args = parser.parse_args(argv)
    weights = read_metadata(args.model_dir / "onnx" / "fp32").source_sha256
    directions = tested_directions(model_tokenizer(args.model_dir))
    penalties = read_length_penalties(args.model_dir, [direction_name(s, t) for s, t in directions], weights)
    results = {
        v: variant_bleu(args.model_dir, v, args.limit, args.beam_size, penalties, args.provider)
        | {"recipe": read_metadata(args.model_dir / "onnx" / v).recipe}
        for v in available_variants(args.model_dir)
    }
    mark_passed(results, BLEU_GATE, directions)
    record = {
        "weights_sha256": weights,  # the server trusts the gate only for graphs exported from these
        "gate_bleu": BLEU_GATE,
        "beam_size": args.beam_size,
        "length_penalty": penalties,
        "cpu_int8": int8_kernels(),  # an int8 gate holds only on CPUs of this class (model.directory)
        "limit": args.limit,
        "variants": results,
    }
    path = args.model_dir / VARIANTS_FILE
    by_provider = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(by_provider | {args.provider: record}, indent=2, sort_keys=True) + "\n")
    print(json.dumps(record, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
