"""Parity of an imported Marian model with transformers: our PyTorch against MarianMTModel.

    python -m bench.hf_parity --hf DIR_OR_HUB_ID --model-dir DIR [--texts FILE] [--beam-size 4] [--max-len 64]

Three levels, as minGPT's import test: logits of teacher-forced translations within 1e-4 (recomputed in
full and decoded step by step against our key/value cache), then greedy and beam token ids equal to
`generate` at the same settings, its beam search stopping as the model's generation config says
(`early_stopping`, whose default, False, our import carries as `patient_beam`). The ONNX side of parity
(graphs against our PyTorch) is `python -m bench.parity`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model.marian_tokenizer import MarianTokenizer
from model.training.artifact import load_artifact
from model.training.decode import beam_search
from model.training.transformer import Transformer

LOGIT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class ParityReport:
    sentences: int
    max_logit_diff: float  # full recomputation against transformers
    max_cached_logit_diff: float  # our cached step decoder against transformers' full logits
    greedy_mismatches: list[int]  # sentence indices whose greedy ids differ
    beam_mismatches: list[int]  # sentence indices whose best beam ids differ

    @property
    def passed(self) -> bool:
        close = max(self.max_logit_diff, self.max_cached_logit_diff) <= LOGIT_TOLERANCE
        return close and not self.greedy_mismatches and not self.beam_mismatches


def transformers_ids(hf: Any, src: list[int], beam_size: int, max_len: int) -> list[int]:
    """generate()'s best output for one source: ids after the start token, up to and without EOS; the model's
    own generation config decides the rest (its pad ban, forced EOS, beam patience)."""
    out = hf.generate(
        input_ids=torch.tensor([src]), attention_mask=torch.ones(1, len(src), dtype=torch.long),
        num_beams=beam_size, max_new_tokens=max_len, min_length=0, length_penalty=1.0, do_sample=False,
        num_return_sequences=1,
    )[0].tolist()  # fmt: skip
    generated = out[1:]
    eos = hf.config.eos_token_id
    return generated[: generated.index(eos)] if eos in generated else generated


def logit_diffs(ours: Transformer, hf: Any, src: list[int], tokens: list[int]) -> tuple[float, float]:
    """Max |ours - transformers| of the logits after the start token and each of `tokens`: full, cached."""
    s, tgt = torch.tensor([src]), torch.tensor([[ours.cfg.bos_id, *tokens]])
    reference = hf(input_ids=s, attention_mask=torch.ones_like(s), decoder_input_ids=tgt).logits[0]
    full = ours(s, s != ours.cfg.pad_id, tgt)[0]
    cached = cached_logits(ours, s, tgt[0])
    return float((full - reference).abs().max()), float((cached - reference).abs().max())


def cached_logits(model: Transformer, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
    """(T, V) logits of `tgt_in` fed one token at a time through `decode_step` and a growing cache."""
    mask = src != model.cfg.pad_id
    cross = model.cross_kv(model.encode(src, mask))
    cfg = model.cfg
    k = [torch.zeros(1, cfg.n_heads, 0, cfg.head_dim)] * cfg.n_decoder_layers
    v = list(k)
    rows = []
    for step, token in enumerate(tgt_in.tolist()):
        keep = torch.ones(1, step, dtype=torch.bool)
        logits, new_k, new_v = model.decode_step(torch.tensor([token]), torch.tensor([step]), k, v, keep, cross, mask)
        k = [torch.cat([a, b], dim=2) for a, b in zip(k, new_k, strict=True)]
        v = [torch.cat([a, b], dim=2) for a, b in zip(v, new_v, strict=True)]
        rows.append(logits[0])
    return torch.stack(rows)


@torch.no_grad()
def compare(
    hf_dir: Path | str, model_dir: Path, sources: list[list[int]], beam_size: int, max_len: int
) -> ParityReport:
    from transformers import MarianMTModel

    hf = MarianMTModel.from_pretrained(hf_dir).eval()
    ours = load_artifact(model_dir)
    diffs, greedy_bad, beam_bad = [], [], []
    for index, src in enumerate(sources):
        greedy = transformers_ids(hf, src, 1, max_len)
        diffs.append(logit_diffs(ours, hf, src, greedy))
        if list(beam_search(ours, src, 1, max_len)[0].tokens) != greedy:
            greedy_bad.append(index)
        if list(beam_search(ours, src, beam_size, max_len)[0].tokens) != transformers_ids(hf, src, beam_size, max_len):
            beam_bad.append(index)
    return ParityReport(len(sources), max(d[0] for d in diffs), max(d[1] for d in diffs), greedy_bad, beam_bad)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hf_parity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True, help="the transformers Marian directory (or hub id) imported")
    parser.add_argument("--model-dir", type=Path, required=True, help="the artifact python -m export.hf wrote")
    parser.add_argument("--texts", type=Path, default=None, help="one source text a line (default: a few built in)")
    parser.add_argument("--target-lang", default=None, help="for multilingual models: the target tag to use")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=64)
    args = parser.parse_args(argv)
    tokenizer = MarianTokenizer(args.model_dir)
    texts = args.texts.read_text().splitlines() if args.texts else BUILT_IN_TEXTS
    target = args.target_lang or tokenizer.directions.targets[0]
    sources = [tokenizer.encode_source(text, target) for text in texts if text.strip()]
    report = compare(args.hf, args.model_dir, sources, args.beam_size, args.max_len)
    print(report)
    print("PASS" if report.passed else "FAIL")
    return 0 if report.passed else 1


BUILT_IN_TEXTS = [
    "Das Haus ist groß.",
    "Sie trinkt jeden Morgen Kaffee.",
    "The weather was fine, so we walked to the station.",
    "Wie viel kostet das?",
]

if __name__ == "__main__":
    sys.exit(main())
