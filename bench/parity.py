"""python -m bench.parity --model-dir DIR [--limit N]: the fp32 export against PyTorch.

Checks, in the order of the minGPT parity test: encoder outputs and per-step log-probabilities
within 1e-4 (max abs; ten sources per direction, their reference translations teacher-forced to
the end), then greedy and beam-4 token ids identical on the test set, both directions.
Where ids differ, the report shows the first differing position and PyTorch's own margin for its
choice: greedy, the log-prob gap between its token and the ONNX one there; beam, the gap between the
normalised scores of the two whole hypotheses, both scored by PyTorch (a near-tie in the final
ranking can part hypotheses from their first token, where a single-token gap says nothing). Under
1e-4 (the two implementations differ by ~1e-5) it is a numerical tie that either may break, and is
reported as such; anything larger fails. A near-tie at a beam's pruning cut is not recognised: its
two searches may end far apart, so it fails, erring on the side of a false alarm, never a false pass.
Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model.data import read_tsv
from model.tokenizer import TextTokenizer
from model.training.artifact import load_artifact
from model.training.decode import beam_search, normalize
from model.training.transformer import Transformer
from server.backend.runtime import PROVIDERS, OnnxRunner
from server.backend.working_batch import WorkingBatchRunner
from server.core.offline import translate_ids
from server.core.runner import EncodeItem
from server.core.scheduler import output_limit
from server.gates.variants import model_tokenizer, tested_directions

TOLERANCE = 1e-4
LOGIT_CASES_PER_DIRECTION = 10  # sources whose reference translations are teacher-forced step by step
LENGTH_PENALTY = 1.0  # both decoders rank with it; the served default per direction is tuned apart
TEST_FILE = Path(__file__).resolve().parent.parent / "data" / "test.tsv"


@dataclass(frozen=True)
class Divergence:
    """Where the ONNX decoder's best hypothesis first leaves PyTorch's, and by how much PyTorch preferred its own."""

    source: list[int]
    position: int  # first target position where the token ids differ (EOS counted as a token)
    reference_token: int
    onnx_token: int
    # PyTorch's preference for its own output. Greedy: log-prob of its token minus the ONNX token's,
    # given the common prefix. Beam: normalised score of its hypothesis minus the ONNX hypothesis's.
    margin: float

    @property
    def tie(self) -> bool:
        """Two candidates closer than the implementations' log-prob difference may swap: not a bug.

        The margin may even be negative: PyTorch's full recomputation can rank the two the other way
        round from its own cached decoding, which made the reference choice.
        """
        return abs(self.margin) <= TOLERANCE


@dataclass(frozen=True)
class DecodingReport:
    identical: int  # sources whose best hypothesis has the same token ids
    total: int
    divergences: list[Divergence]

    @property
    def passed(self) -> bool:
        """Identical everywhere, except where PyTorch itself had a numerical tie at the first difference."""
        return all(d.tie for d in self.divergences)


def compare_decoding(
    model: Transformer, runner: OnnxRunner, sources: list[list[int]], beam_size: int, max_len: int | None
) -> DecodingReport:
    """Best-hypothesis ids of the ONNX offline decoder vs model/training/decode.py.

    Both decoders get the server's output limit: `max_len` capped at the model's, or when None
    the source-relative default.
    """
    onnx_best = translate_ids(runner, sources, beam_size, LENGTH_PENALTY, max_len)
    divergences = []
    for src, hyps in zip(sources, onnx_best, strict=True):
        limit = output_limit(max_len or 0, len(src), runner.spec.max_target_len)
        reference = beam_search(model, src, beam_size=beam_size, max_len=limit, length_penalty=LENGTH_PENALTY)[0]
        if tuple(reference.tokens) != hyps[0].tokens:
            found = first_divergence(model, src, list(reference.tokens), list(hyps[0].tokens), beam_size, limit)
            divergences.append(found)
    return DecodingReport(len(sources) - len(divergences), len(sources), divergences)


@torch.no_grad()
def first_divergence(
    model: Transformer, src: list[int], reference: list[int], onnx: list[int], beam_size: int = 1, limit: int = 0
) -> Divergence:
    """The first position where two outputs differ, and PyTorch's margin for its own (see `Divergence`).

    `limit` is the decoders' output limit: a hypothesis that long ended there, without an EOS.
    """
    eos = model.cfg.eos_id
    with_eos = [*reference, eos], [*onnx, eos]
    position = next(i for i, (a, b) in enumerate(zip(*with_eos, strict=False)) if a != b)
    if beam_size == 1:
        log_probs = teacher_forced(model, src, with_eos[0][:position])[-1]
        margin = float(log_probs[with_eos[0][position]] - log_probs[with_eos[1][position]])
    else:
        margin = normalized_score(model, src, reference, limit) - normalized_score(model, src, onnx, limit)
    return Divergence(src, position, with_eos[0][position], with_eos[1][position], margin)


def teacher_forced(model: Transformer, src: list[int], tokens: list[int]) -> torch.Tensor:
    """(len(tokens) + 1, V) log-probabilities after BOS and after each of `tokens`, recomputed in full."""
    s = torch.tensor([src])
    logits = model(s, s != model.cfg.pad_id, torch.tensor([[model.cfg.bos_id, *tokens]]))[0]
    return model.log_probs(logits)


@torch.no_grad()
def normalized_score(model: Transformer, src: list[int], tokens: list[int], limit: int) -> float:
    """A hypothesis's ranking key as model/training/decode.py defines it: summed log-probs, EOS included unless
    the hypothesis ran to `limit`, over its length to the power of the length penalty."""
    ended = len(tokens) < limit or limit == 0
    scored = [*tokens, model.cfg.eos_id] if ended else list(tokens)
    log_probs = teacher_forced(model, src, scored[:-1])
    score = float(log_probs[torch.arange(len(scored)), torch.tensor(scored)].sum())
    return normalize(score, len(scored), LENGTH_PENALTY)


def _unpadded(heads: np.ndarray, head_dim: int) -> np.ndarray:
    """(H, S, Dh') cross keys or values as the model's (H, S, Dh); the padding's entries must be zero."""
    if np.any(heads[..., head_dim:]):
        raise RuntimeError("the cross keys/values' head padding is not zero")
    return heads[..., :head_dim]


@torch.no_grad()
def max_logit_difference(model: Transformer, runner: OnnxRunner, src: list[int], target: list[int]) -> float:
    """Max abs difference of cross K/V and of the log-probabilities at every step of `target` (pieces +
    EOS) teacher-forced through the cached ONNX decoder, up to the model's target length."""
    s = torch.tensor([src])
    runner.encode([EncodeItem(src, [0])])
    cross = model.cross_kv(model.encode(s, s != model.cfg.pad_id))
    diff = max(
        float(np.abs(_unpadded(runner.cross_kv[2 * i + j][0, :, : len(src)], kv[j].shape[-1]) - kv[j][0].numpy()).max())
        for i, kv in enumerate(cross)
        for j in range(2)
    )
    tgt_in = [model.cfg.bos_id, *target[:-1]][: runner.spec.max_target_len]
    full = teacher_forced(model, src, tgt_in[1:]).numpy()
    for pos, token in enumerate(tgt_in):
        diff = max(diff, float(np.abs(runner.step_log_probs([0], [token], [pos])[0] - full[pos]).max()))
    return diff


Case = tuple[list[int], list[int]]  # source ids (tag + pieces + EOS), reference target ids (pieces + EOS)


def parity_cases(tokenizer: TextTokenizer, limit: int | None) -> list[list[Case]]:
    """The first `limit` test pairs in each test-set direction the model translates (de->en, en->de)."""
    pairs = read_tsv(TEST_FILE)[:limit]
    return [
        [(tokenizer.encode_source(getattr(p, s), t), tokenizer.encode_target(getattr(p, t))) for p in pairs]
        for s, t in tested_directions(tokenizer)
    ]


def fits(case: Case, max_source_len: int) -> bool:
    return len(case[0]) <= max_source_len


def logit_cases(by_direction: list[list[Case]], per_direction: int) -> list[Case]:
    """The first `per_direction` cases of each direction."""
    return [case for cases in by_direction for case in cases[:per_direction]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.parity", description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=None, help="first N test pairs (default: all)")
    parser.add_argument("--max-len", type=int, default=0, help="generated tokens; 0 = the server's default")
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cpu", help="where the fp32 graphs run")
    args = parser.parse_args(argv)
    model = load_artifact(args.model_dir)
    runner = WorkingBatchRunner(args.model_dir / "onnx" / "fp32", max_slots=64, provider=args.provider)
    if runner.provider != PROVIDERS[args.provider]:  # onnxruntime falls back to CPU with a warning only
        raise SystemExit(f"asked for the {args.provider} provider, onnxruntime gave {runner.provider}")
    every = parity_cases(model_tokenizer(args.model_dir), args.limit)
    by_direction = [[c for c in cases if fits(c, runner.spec.max_source_len)] for cases in every]
    if skipped := sum(map(len, every)) - sum(map(len, by_direction)):
        print(f"skipped {skipped} test pairs whose source is longer than the model's {runner.spec.max_source_len}")
    sources = [source for cases in by_direction for source, _ in cases]
    checked = logit_cases(by_direction, LOGIT_CASES_PER_DIRECTION)
    diff = max(max_logit_difference(model, runner, source, target) for source, target in checked)
    ok = diff <= TOLERANCE
    print(
        f"max abs difference (cross K/V, log-probs at every step of {len(checked)} reference translations,"
        f" {len(by_direction)} direction(s)): {diff:.2e} (limit {TOLERANCE:.0e})"
    )
    for beam in (1, 4):
        report = compare_decoding(model, runner, sources, beam, args.max_len or None)
        ok &= report.passed
        ties = sum(d.tie for d in report.divergences)
        print(f"beam {beam}: identical token ids {report.identical}/{report.total}, numerical ties {ties}")
        for d in report.divergences:
            kind = "tie" if d.tie else "MISMATCH"
            print(
                f"  {kind}: source {d.source} position {d.position}: PyTorch {d.reference_token}, "
                f"ONNX {d.onnx_token}, PyTorch margin {d.margin:.2e} (a tie within +-{TOLERANCE:.0e})"
            )
    print("parity: PASS" if ok else "parity: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
