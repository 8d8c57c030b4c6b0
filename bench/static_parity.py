"""python -m bench.static_parity --model-dir DIR [--provider cuda] [--variants fp32,fp16] [--limit N]: the
captured runner (`--kv-cache fused`: the fused capturable step over static buffers, CUDA graphs on CUDA) against
the uncaptured step of the working batch (`--kv-cache working`), on the same provider and graphs' weights.

For each variant, the test set's sources (both directions the model translates) decoded offline through
`server.core.offline.translate_ids` by both runners, greedy and beam 4, with fewer slots than rows so rows
join and leave at different lengths: the token ids must be identical (the fused build in float16: at least
FUSED_FP16_AGREEMENT of them, below); the largest score difference is reported beside them. A model whose
head size GroupQueryAttention does not take has no capturable step and is skipped, said so; exits 1 if ids
differ beyond that or a capturable model's variant lacks the step. Both runners are opened by class, on any
provider, so that a CPU rehearses the command (the captured runner runs uncaptured there).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from bench.parity import fits, parity_cases
from model.directory import FUSED_DECODER_FILE, MetadataError, capturable_head_dim, read_metadata
from server.backend.captured import CapturedRunner
from server.backend.runtime import PROVIDERS, OnnxRunner
from server.backend.working_batch import WorkingBatchRunner
from server.core.beam import Hypothesis
from server.core.offline import translate_ids
from server.gates.variants import model_tokenizer

BEAMS = (1, 4)
# The fused step in float16 runs other kernels than the uncaptured step (fp32 sums inside SkipLayerNormalization
# and MultiHeadAttention, each rounded once), so float16's near-ties may break the other way: at least this share
# of its ids must agree, where every other comparison must agree exactly.
FUSED_FP16_AGREEMENT = 0.9


def decode(runner: OnnxRunner, sources: list[list[int]], beam: int, max_len: int) -> tuple[list[Hypothesis], float]:
    """Best hypotheses and the seconds they took."""
    started = time.perf_counter()
    best = [hyps[0] for hyps in translate_ids(runner, sources, beam, 1.0, max_len)]
    return best, time.perf_counter() - started


def compare(variant_dir: Path, provider: str, sources: list[list[int]], slots: int, max_len: int) -> bool:
    """The captured runner against the working batch on one variant; prints one line per beam; whether every id
    agreed."""
    uncaptured = WorkingBatchRunner(variant_dir, slots, provider)
    expected = {beam: decode(uncaptured, sources, beam, max_len) for beam in BEAMS}
    del uncaptured  # its sessions go before the captured runner's buffers come
    captured = CapturedRunner(variant_dir, slots, provider)
    if captured.provider != PROVIDERS[provider]:  # onnxruntime falls back to CPU with a warning only
        raise SystemExit(f"asked for the {provider} provider, onnxruntime gave {captured.provider}")
    ok = True
    for beam in BEAMS:
        (want, want_s), (got, got_s) = expected[beam], decode(captured, sources, beam, max_len)
        same = sum(a.tokens == b.tokens for a, b in zip(got, want, strict=True))
        gap = max(abs(a.score - b.score) for a, b in zip(got, want, strict=True))
        inexact = captured.dtype == np.float16
        ok &= same >= FUSED_FP16_AGREEMENT * len(sources) if inexact else same == len(sources)
        print(
            f"{variant_dir.name} {captured.kv_cache} beam {beam}: identical token ids {same}/{len(sources)}, max score"
            f" difference {gap:.2e}; working {want_s:.2f} s, {captured.kv_cache} {got_s:.2f} s"
        )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.static_parity", description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cpu")
    parser.add_argument("--variants", default="fp32,fp16")
    parser.add_argument("--limit", type=int, default=None, help="first N test pairs per direction (default: all)")
    parser.add_argument("--max-len", type=int, default=16, help="most generated tokens per sentence")
    parser.add_argument("--slots", type=int, default=32, help="decoding slots of each runner")
    args = parser.parse_args(argv)
    tokenizer = model_tokenizer(args.model_dir)
    ok = True
    for variant in (v for v in args.variants.split(",") if v):
        variant_dir = args.model_dir / "onnx" / variant
        meta = read_metadata(variant_dir)
        if not capturable_head_dim(meta.head_dim):
            print(f"{variant}: skipped, head size {meta.head_dim} has no capturable step")
            continue
        if not (variant_dir / FUSED_DECODER_FILE).is_file():  # fp32 builds it only when asked
            print(f"{variant}: skipped, no capturable step exported (python -m export --capturable-fp32 builds it)")
            continue
        spec = meta.spec()
        cases = [case for cases in parity_cases(tokenizer, args.limit) for case in cases]
        sources = [source for source, target in cases if fits((source, target), spec.max_source_len)]
        try:
            ok &= compare(variant_dir, args.provider, sources, args.slots, min(args.max_len, spec.max_target_len))
        except MetadataError as err:
            print(f"{variant}: {err}")
            ok = False
    print("static parity: PASS" if ok else "static parity: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
