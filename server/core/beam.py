"""Beam search for one sentence as a pure state machine over a step's ranked candidates (numpy only).

The server advances from each row's k best tokens, which the runner ranks where it computes them
(`advance_candidates` after `merge_candidates`); `advance` takes whole log-probability rows, for the
references in tests. Both pick the same candidates.

It follows the specification in `model/training/decode.py` token for token: 2K candidates in descending score
order (ties: lower flat index first), EOS candidates among the K best finish with
score / length ** length_penalty (EOS ranked lower is passed over), the rest stay live until K are
live; stop at K finished (every EOS among a step's K best counting; a patient search: once no live row could
beat the K-th) or at `max_len` generated tokens, where the live rows among the step's K best finish too and the
K best of all are kept. A forced first token (the target's code of NLLB and M2M100) is the first step's only
candidate, at score 0: the step still runs, for the cache, and its candidates are passed over.
The caller owns the rows (slots): after `advance`, live row i continues from parent row
`parents[i]` with token `tokens[i]`. Greedy is K = 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import overload

import numpy as np
import numpy.typing as npt

from server.core.runner import RowBias


@dataclass(frozen=True)
class Hypothesis:
    tokens: tuple[int, ...]  # generated ids, EOS excluded
    score: float  # sum of token log-probabilities, EOS included when generated
    normalized: float  # score / length ** length_penalty; the ranking key


@dataclass(frozen=True)
class Advance:
    """What the caller must do to its rows after one step."""

    parents: list[int]  # for each new live row, the row it continues (index into the previous rows)
    tokens: list[int]  # the token each new live row feeds next
    done: bool  # no live rows remain to step


def normalize(score: float, length: int, length_penalty: float) -> float:
    return score / (max(length, 1) ** length_penalty)


def top_k_stable(scores: npt.NDArray[np.float32], k: int) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.float32]]:
    """The k best flat indices of `scores` (R, V) and their values, best first, ties to the lower index.

    Equal to `np.argsort(-scores.ravel(), kind="stable")[:k]`, without sorting R*V values: a row's
    k-th largest value bounds what can make the cut, so only the few values at or above it are sorted.
    """
    vocab = scores.shape[1]
    if k < vocab:
        kth = np.partition(scores, vocab - k, axis=1)[:, vocab - k]  # (R,) k-th largest of each row
        rows, cols = np.nonzero(scores >= kth[:, None])  # row-major: flat indices ascend
        flat, values = rows * vocab + cols, scores[rows, cols]
    else:
        flat, values = np.arange(scores.size), scores.reshape(-1)
    order = np.argsort(-values, kind="stable")[:k]  # stable: among equal scores the lower flat index first
    return flat[order], values[order]


def top_1(scores: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.float32]]:
    """`top_k_stable(scores, 1)` in one pass: argmax returns the first (lowest) index among ties."""
    best = int(np.argmax(scores))
    return np.asarray([best]), scores.reshape(-1)[best : best + 1]


@overload
def row_candidates(
    logprobs: npt.NDArray[np.float32], row_scores: npt.ArrayLike, k: int, bias: None = None
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]: ...


@overload
def row_candidates(
    logprobs: npt.NDArray[np.float32], row_scores: npt.ArrayLike, k: int, bias: RowBias
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.float32]]: ...


def row_candidates(
    logprobs: npt.NDArray[np.float32], row_scores: npt.ArrayLike, k: int, bias: RowBias | None = None
) -> tuple[np.ndarray, ...]:
    """The runner's ranking contract in numpy (fakes and tests): each row's k best next tokens, scored
    row_scores[i] + log p in float32, best first, ties to the lower id. Runners rank in the graph.

    With a `bias` its values are added first (repeated ids add up, as the graph's scatter does), and the
    (B, J) scores of its ids come back as a third array."""
    scores = np.asarray(row_scores, dtype=np.float32)[:, None] + logprobs.astype(np.float32)
    if bias is not None:
        np.add.at(scores, (np.arange(scores.shape[0])[:, None], bias.ids), bias.values)
    ids = np.argsort(-scores, axis=1, kind="stable")[:, : min(k, scores.shape[1])]
    ranked = (np.take_along_axis(scores, ids, axis=1), ids.astype(np.int64))
    return ranked if bias is None else (*ranked, np.take_along_axis(scores, bias.ids, axis=1))


def merge_candidates(
    scores: npt.NDArray[np.float32], ids: npt.NDArray[np.int64], vocab: int, needed: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """A sentence's `needed` best candidates from its R rows' own k best (k >= needed), as flat indices.

    Equal to `top_k_stable` over the full (R, V) scores: a candidate among the sentence's best `needed`
    has fewer than `needed` better ones, so it is within its own row's k best. Each row lists ties
    lower id first, so a stable sort of the rows' lists in row order ranks ties by flat index.
    """
    flat = (np.arange(scores.shape[0], dtype=np.int64)[:, None] * vocab + ids).reshape(-1)
    values = scores.reshape(-1)
    order = np.argsort(-values, kind="stable")[:needed]
    return flat[order], values[order]


def merge_candidates_of(
    scores: npt.NDArray[np.float32], ids: npt.NDArray[np.int64], vocab: int, spans: list[tuple[int, int, int]]
) -> list[tuple[list[int], list[float]]]:
    """`merge_candidates` for many sentences of one step at once, as lists: span (start, rows, needed) is a
    sentence's rows `scores[start:start + rows]` and how many candidates it needs. One stable sort over
    the sentences' rows side by side, each padded to the widest with -inf (which sorts after every real
    score), ranks each sentence's own candidates as its own sort would, at a fraction of the calls."""
    if not spans:
        return []
    k = scores.shape[1]
    starts, rows, needed = (np.asarray(column, dtype=np.int64) for column in zip(*spans, strict=True))
    widest = int(rows.max())
    local = np.arange(widest, dtype=np.int64)
    row_of = starts[:, None] + local[None, :]  # (S, widest) a sentence's rows, then padding
    real = local[None, :] < rows[:, None]
    row_of = np.where(real, row_of, 0)
    values = np.where(real[:, :, None], scores[row_of], np.float32(-np.inf)).reshape(len(spans), widest * k)
    flat = (local[None, :, None] * vocab + ids[row_of]).reshape(len(spans), widest * k)
    keep = int(min(needed.max(), widest * k))
    order = np.argsort(-values, axis=1, kind="stable")[:, :keep]
    top_flat = np.take_along_axis(flat, order, axis=1).tolist()
    top_values = np.take_along_axis(values, order, axis=1).tolist()
    counts = np.minimum(needed, rows * k).tolist()
    return [(f[:n], v[:n]) for f, v, n in zip(top_flat, top_values, counts, strict=True)]


@dataclass
class BeamState:
    """The live and finished hypotheses of one sentence."""

    beam_size: int
    max_len: int
    length_penalty: float
    eos_id: int
    forced_eos: bool = False  # the step at max_len ends every live row with EOS, score unchanged (generate's ending)
    patient: bool = False  # go on past K finished while the best live row could beat the K-th (model.training.decode)
    forced_first: int | None = None  # the first step's only candidate, at log-probability 0 (DecodeOptions')
    live: list[tuple[tuple[int, ...], float]] = field(default_factory=lambda: [((), 0.0)])
    finished: list[Hypothesis] = field(default_factory=list)
    steps: int = 0  # tokens generated so far by every live row

    def __post_init__(self) -> None:
        assert self.beam_size >= 1 and self.max_len >= 1, f"unchecked work: {self.beam_size=}, {self.max_len=}"
        self.patient = self.patient and self.beam_size > 1  # greedy stops at its EOS, patient model or not

    @property
    def candidates_needed(self) -> int:
        """Candidates a step must rank: 2K (K may finish with EOS and K stay live); greedy's first decides."""
        return 1 if self.beam_size == 1 else 2 * self.beam_size

    def fresh(self) -> BeamState:
        """This beam as it was before its first step (a sentence restarted from scratch)."""
        return BeamState(
            self.beam_size, self.max_len, self.length_penalty, self.eos_id, self.forced_eos, patient=self.patient,
            forced_first=self.forced_first,
        )  # fmt: skip

    def live_scores(self) -> npt.NDArray[np.float32]:
        """(R,) the live rows' scores; float32, as torch adds scores to log-probs in float32 in the reference."""
        return np.asarray([s for _, s in self.live], dtype=np.float32)

    def advance(self, logprobs: npt.NDArray[np.float32]) -> Advance:
        """Take log-probabilities (R, V) of the R live rows; return the rows' next moves."""
        if logprobs.shape[0] != len(self.live):
            raise ValueError(f"expected {len(self.live)} rows of log-probabilities, got {logprobs.shape[0]}")
        scores = self.live_scores()[:, None] + logprobs.astype(np.float32)
        candidates = min(self.candidates_needed, scores.size)
        order, top = top_1(scores) if candidates == 1 else top_k_stable(scores, candidates)
        return self.advance_candidates(order, top, logprobs.shape[1])

    def advance_ranked(self, scores: npt.NDArray[np.float32], ids: npt.NDArray[np.int64], vocab: int) -> Advance:
        """Advance from the live rows' own ranked candidates (R, k), as a runner's step returns them."""
        order, top = merge_candidates(scores, ids, vocab, self.candidates_needed)
        return self.advance_candidates(order, top, vocab)

    def advance_greedy(self, score: float, token: int, vocab: int) -> Advance:
        """`advance_ranked` for greedy (K = 1) in plain Python, from the one live row's best candidate: a
        single row's ranked list needs no merging, and its first entry is the one candidate greedy takes.
        `_advance` over that one candidate, unrolled: the engine runs it once per greedy row and step."""
        if (
            self.beam_size != 1
            or (self.forced_eos and self.steps == self.max_len - 1)
            or (self.steps == 0 and self.forced_first is not None)
            or not 0 <= token < vocab
        ):
            return self._advance([token], [score], vocab)
        tokens = self.live[0][0]
        self.steps += 1
        if token == self.eos_id:
            length = len(tokens) + 1
            self.finished.append(Hypothesis(tokens, score, normalize(score, length, self.length_penalty)))
            self.live = []
            return Advance([], [], done=True)
        grown = (*tokens, token)
        if self.steps >= self.max_len:
            self.finished.append(Hypothesis(grown, score, normalize(score, len(grown), self.length_penalty)))
            self.live = []
            return Advance([], [], done=True)
        self.live = [(grown, score)]
        return Advance([0], [token], done=False)

    def advance_candidates(self, order: npt.NDArray[np.integer], top: npt.NDArray[np.float32], vocab: int) -> Advance:
        """Advance from this step's best candidates: flat indices (row * V + token) into the live rows and
        their scores, best first (ties: lower index first), `candidates_needed` of them or all there are."""
        return self._advance(order.tolist(), top.tolist(), vocab)

    def advance_merged(self, order: list[int], top: list[float], vocab: int) -> Advance:
        """`advance_candidates` from lists, as `merge_candidates_of` ranks them."""
        return self._advance(order, top, vocab)

    def _advance(self, order: list[int], top: list[float], vocab: int) -> Advance:
        if self.forced_eos and self.steps == self.max_len - 1:
            return self._force_eos()
        if self.steps == 0 and self.forced_first is not None:
            return self._force_first(self.forced_first)
        new_live: list[tuple[tuple[int, ...], float]] = []
        parents: list[int] = []
        top_live = 0  # how many of new_live rank among the K best candidates
        for rank, (idx, score) in enumerate(zip(order, top, strict=True)):
            hyp, token = divmod(idx, vocab)
            tokens = self.live[hyp][0]
            if token == self.eos_id and rank >= self.beam_size:
                continue  # an EOS outside the K best candidates finishes nothing
            if token == self.eos_id:  # every EOS among the K best joins the pool, however full it is by now
                length = len(tokens) + 1
                self.finished.append(Hypothesis(tokens, score, normalize(score, length, self.length_penalty)))
            else:
                new_live.append(((*tokens, token), score))
                parents.append(hyp)
                top_live += rank < self.beam_size
            if len(new_live) == self.beam_size:
                break
        self.steps += 1
        if self.steps >= self.max_len:  # the K best candidates all end here, EOS or not, and the K best of all stay
            grown = new_live[:top_live]
            self.finished.extend(Hypothesis(t, s, normalize(s, len(t), self.length_penalty)) for t, s in grown)
            self.finished = self.best(self.beam_size)
            self.live = []
            return Advance([], [], done=True)
        if len(self.finished) >= self.beam_size:
            # Patient: only the K best can still be returned (a repetition loop would otherwise pile up one per step)
            self.finished = self.best(self.beam_size) if self.patient else self.finished
            if not (self.patient and self._could_improve(new_live)):
                self.live = []
                return Advance([], [], done=True)
        self.live = new_live
        return Advance(parents, [t[-1] for t, _ in new_live], done=False)

    def _could_improve(self, live: list[tuple[tuple[int, ...], float]]) -> bool:
        """Whether the best live row, normalised at its present length, beats the K-th best finished
        hypothesis (the last of `finished`, kept as the K best): transformers' heuristic for
        `early_stopping=False` (generation/utils.py `_check_early_stop_heuristic`), which assumes a longer
        hypothesis scores no better."""
        return bool(live) and normalize(live[0][1], self.steps, self.length_penalty) > self.finished[-1].normalized

    def _force_first(self, token: int) -> Advance:
        """The first step under `forced_first`: the one live row's only candidate is `token`, at log-probability 0
        (as transformers' ForcedBOSTokenLogitsProcessor leaves it after log_softmax), whatever the step ranked."""
        self.steps = 1
        if self.max_len == 1:
            self.finished.append(Hypothesis((token,), 0.0, normalize(0.0, 1, self.length_penalty)))
            self.live = []
            return Advance([], [], done=True)
        self.live = [((token,), 0.0)]
        return Advance([0], [token], done=False)

    def _force_eos(self) -> Advance:
        """The last step under `forced_eos`: each live row's only candidate is EOS, at log-probability 0 (as
        transformers' ForcedEOSTokenLogitsProcessor leaves it): every live row finishes as it stands."""
        for tokens, score in self.live:
            self.finished.append(Hypothesis(tokens, score, normalize(score, len(tokens) + 1, self.length_penalty)))
        self.steps += 1
        self.live = []
        return Advance([], [], done=True)

    def best(self, n: int = 1) -> list[Hypothesis]:
        """The n best finished hypotheses (stable sort: ties keep finishing order)."""
        return sorted(self.finished, key=lambda h: -h.normalized)[:n]
