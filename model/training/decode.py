"""Reference greedy and beam-search decoding in PyTorch, on the cached incremental path.

This is the specification that the ONNX decoder and the server's scheduler must reproduce token for
token. Beam search, per source sentence with beam size K:

1. Start with one live hypothesis [BOS] of score 0.
2. Each step, every live hypothesis proposes score + log_softmax(logits) for every token; the 2K best
   candidates over all live hypotheses are taken in descending score order (ties: lower flat index
   `hyp * V + token` first). A candidate ending in EOS among the K best is finished, with normalised
   score score / (generated length incl. EOS) ** length_penalty; an EOS candidate ranked below the K
   best is passed over (as fairseq, transformers and CTranslate2 do); any other candidate becomes
   live until K are live. Candidates past those K are dropped.
3. Stop when K hypotheses have finished (every EOS among a step's K best candidates counts, however many
   finished before it in that step), or when the generated length reaches `max_len`, at which point the
   live hypotheses among that step's K best candidates are finished as they are (normalised by their
   length), and the K best of everything finished are kept: transformers' `generate`. A model with
   `patient_beam` (transformers' default, `early_stopping=False`) goes on past K finished while the best
   live hypothesis, normalised at its present length, scores above the K-th best finished one. A model with
   `forced_eos_at_limit` (transformers' `forced_eos_token_id`) instead ends every live hypothesis with
   EOS in place `max_len`, at no cost to its score (normalised by its length with that EOS).
4. Return finished hypotheses by descending normalised score (ties: earlier finished first).

Greedy is the same with K = 1 but stops at the first EOS and is normalised the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.training.transformer import Transformer


@dataclass(frozen=True)
class Hypothesis:
    tokens: tuple[int, ...]  # generated ids, EOS excluded
    score: float  # sum of token log-probabilities, EOS included when it was generated
    normalized: float  # score / length ** length_penalty; the ranking key


class CachedDecoder:
    """Runs `decode_step` for a set of rows whose caches grow by one position per call."""

    def __init__(self, model: Transformer, src: Tensor) -> None:
        """src (1, S) ids of one sentence."""
        self.model = model
        self.src_mask = src != model.cfg.pad_id
        self.cross = model.cross_kv(model.encode(src, self.src_mask))
        n_layers, cfg = len(model.decoder), model.cfg
        empty = torch.zeros(1, cfg.n_heads, 0, cfg.head_dim, device=src.device)
        self.k = [empty] * n_layers
        self.v = [empty] * n_layers
        self.rows = 1

    def step(self, tokens: Tensor, step: int) -> Tensor:
        """tokens (R,) for the current rows -> log-probs (R, V); caches grow by one position."""
        rows = tokens.size(0)
        cross = [(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in self.cross]
        keep = torch.ones(rows, self.k[0].size(2), dtype=torch.bool, device=tokens.device)
        positions = torch.full((rows,), step, dtype=torch.long, device=tokens.device)
        logits, new_k, new_v = self.model.decode_step(
            tokens, positions, self.k, self.v, keep, cross, self.src_mask.expand(rows, -1)
        )
        self.k = [torch.cat([k, nk], dim=2) for k, nk in zip(self.k, new_k, strict=True)]
        self.v = [torch.cat([v, nv], dim=2) for v, nv in zip(self.v, new_v, strict=True)]
        return self.model.log_probs(logits)

    def reorder(self, rows: Tensor) -> None:
        """Keep cache rows `rows` (R',), in that order (beam reordering)."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]


def normalize(score: float, length: int, length_penalty: float) -> float:
    return score / (max(length, 1) ** length_penalty)


@torch.no_grad()
def beam_search(
    model: Transformer,
    src_ids: list[int],
    beam_size: int = 4,
    max_len: int = 128,
    length_penalty: float = 1.0,
    forced_first: int | None = None,
) -> list[Hypothesis]:
    """All finished hypotheses of one source, best first (see the module docstring for the rules); `forced_first`
    is the first generated token's only candidate, at log-probability 0 (generate's `forced_bos_token_id`: the
    target language's code of M2M100 and NLLB)."""
    cfg = model.cfg
    if beam_size < 1 or max_len < 1:
        raise ValueError(f"beam_size and max_len must be >= 1, got {beam_size} and {max_len}")
    patient = cfg.patient_beam and beam_size > 1  # greedy stops at its EOS (transformers decodes it without beams)
    device = next(model.parameters()).device  # every tensor of the search where the model is
    decoder = CachedDecoder(model, torch.tensor([src_ids], dtype=torch.long, device=device))
    live: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    finished: list[Hypothesis] = []
    new_live: list[tuple[tuple[int, ...], float]] = []
    last = torch.tensor([cfg.bos_id], device=device)
    for step in range(max_len):
        if cfg.forced_eos_at_limit and step == max_len - 1:  # the only candidate left is EOS, at log-prob 0
            finished.extend(Hypothesis(t, s, normalize(s, len(t) + 1, length_penalty)) for t, s in live)
            return sorted(finished, key=lambda h: -h.normalized)
        logp = decoder.step(last, step)  # (R, V)
        if step == 0 and forced_first is not None:
            live, last = [((forced_first,), 0.0)], torch.tensor([forced_first], device=device)
            if max_len == 1:
                return [Hypothesis((forced_first,), 0.0, normalize(0.0, 1, length_penalty))]
            continue
        scores = torch.tensor([s for _, s in live], device=device).unsqueeze(1) + logp
        flat = scores.view(-1)
        k = min(2 * beam_size, flat.numel())
        # stable descending order: equal scores keep the lower flat index first
        order = torch.sort(flat, descending=True, stable=True).indices[:k]
        new_live = []
        parents: list[int] = []
        top_live = 0  # how many of new_live rank among the K best candidates
        for rank, idx in enumerate(order.tolist()):
            hyp, token = divmod(idx, cfg.vocab_size)
            tokens, score = live[hyp][0], float(flat[idx])
            if token == cfg.eos_id and rank >= beam_size:
                continue  # as fairseq, transformers and CTranslate2: EOS counts only among the K best
            if token == cfg.eos_id:  # every EOS among the K best joins the pool, however full it is by now
                length = len(tokens) + 1
                finished.append(Hypothesis(tokens, score, normalize(score, length, length_penalty)))
            else:
                new_live.append(((*tokens, token), score))
                parents.append(hyp)
                top_live += rank < beam_size
            if len(new_live) == beam_size:
                break
        if step + 1 == max_len:  # the K best candidates all end here, EOS or not, and the K best of all stay
            finished.extend(Hypothesis(t, s, normalize(s, len(t), length_penalty)) for t, s in new_live[:top_live])
            return sorted(finished, key=lambda h: -h.normalized)
        if len(finished) >= beam_size:
            finished = sorted(finished, key=lambda h: -h.normalized)[:beam_size]  # only the K best can be returned
            if not (
                patient and new_live and normalize(new_live[0][1], step + 1, length_penalty) > finished[-1].normalized
            ):
                break
        live = new_live
        decoder.reorder(torch.tensor(parents, device=device))
        last = torch.tensor([t[-1] for t, _ in live], device=device)
    return sorted(finished, key=lambda h: -h.normalized)  # sorted() is stable: ties keep finish order


@torch.no_grad()
def greedy(model: Transformer, src_ids: list[int], max_len: int = 128) -> Hypothesis:
    """Most likely token at each step until EOS or `max_len` generated tokens."""
    return beam_search(model, src_ids, beam_size=1, max_len=max_len)[0]
