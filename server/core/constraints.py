"""Lexically constrained beam search: dynamic beam allocation (Post & Vilar 2018) over the runner's candidates.

A sentence with glossary terms carries each term's target token ids (a constraint), once per time the term stood in
its source. Every hypothesis must contain each constraint that often before it may end, and never more often:
- Before a step, each live row asks the runner (`RowBias`) for the scores of the tokens that would advance an unmet
  constraint (value 0: report the score), and bans EOS while a constraint is unmet and the last token of a constraint
  already met as often as needed (value -inf): a forced token outside the step's top-k can then still be chosen, and
  the runner's ranking never spends a place on a banned one.
- After it, the candidates (each row's top-k and its asked tokens) are ranked by score; EOS among the K best finishes
  as in `server.core.beam`; the K live rows are shared out across banks, one per count of constraint tokens met, so
  that hypotheses that have placed a term do not crowd out those about to, and those that have not placed it yet
  are not all dropped for it (dynamic beam allocation). A bank with fewer candidates than its share leaves its
  places to the best of the rest.
- At the output limit every live row finishes as it stands; the best hypothesis that meets every constraint ranks
  first, then the others by their normalised score.

Progress is counted on the tokens themselves: a constraint's occurrences in the hypothesis, and the longest prefix of
an unmet one that ends it. Nothing is undone: a row that starts a term and leaves it simply has that prefix no more.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from server.core.beam import Advance, BeamState, Hypothesis, normalize

Constraint = tuple[int, ...]  # a term's target token ids, in order (no EOS)

BANNED = -math.inf  # a bias that keeps a token out of the runner's ranking
ASKED = 0.0  # a bias that only asks for the token's score


@dataclass(frozen=True)
class Constraints:
    """What one sentence's translation must contain: each distinct constraint and how many times."""

    sequences: tuple[Constraint, ...]  # distinct, non-empty
    needed: tuple[int, ...]  # occurrences each must reach, >= 1

    @staticmethod
    def of(terms: tuple[Constraint, ...]) -> Constraints:
        """From a sentence's constraints, one per matched term (a repeated term counts twice); empty ones dropped."""
        counts = Counter(term for term in terms if term)
        return Constraints(tuple(counts), tuple(counts.values()))

    @property
    def total_tokens(self) -> int:
        """Constraint tokens a hypothesis meeting every constraint has placed: the highest bank."""
        return sum(len(c) * n for c, n in zip(self.sequences, self.needed, strict=True))


@dataclass(frozen=True)
class Progress:
    """One hypothesis's standing against its sentence's constraints."""

    occurrences: tuple[int, ...]  # per constraint, how many times it stands in the hypothesis (capped at needed + 1)
    prefixes: tuple[int, ...]  # per constraint, the longest proper prefix of it that ends the hypothesis

    @staticmethod
    def start(constraints: Constraints) -> Progress:
        zeros = (0,) * len(constraints.sequences)
        return Progress(zeros, zeros)

    def after(self, tokens: tuple[int, ...], constraints: Constraints) -> Progress:
        """The progress of `tokens`, a hypothesis one token longer than the one this progress is of."""
        occurrences, prefixes = [], []
        for sequence, count, needed in zip(constraints.sequences, self.occurrences, constraints.needed, strict=True):
            size = len(sequence)
            completed = len(tokens) >= size and tokens[-size:] == sequence
            occurrences.append(min(count + completed, needed + 1))
            prefixes.append(_longest_prefix_ending(tokens, sequence))
        return Progress(tuple(occurrences), tuple(prefixes))

    def met_tokens(self, constraints: Constraints) -> int:
        """Constraint tokens placed: whole occurrences up to what is needed, and the prefix of an unmet one."""
        met = 0
        for sequence, count, needed, prefix in zip(
            constraints.sequences, self.occurrences, constraints.needed, self.prefixes, strict=True
        ):
            met += len(sequence) * min(count, needed) + (prefix if count < needed else 0)
        return met

    def all_met(self, constraints: Constraints) -> bool:
        return all(count >= needed for count, needed in zip(self.occurrences, constraints.needed, strict=True))


def _longest_prefix_ending(tokens: tuple[int, ...], sequence: Constraint) -> int:
    """The length of the longest proper prefix of `sequence` that `tokens` ends with (0: none)."""
    for length in range(min(len(sequence) - 1, len(tokens)), 0, -1):
        if tokens[-length:] == sequence[:length]:
            return length
    return 0


def row_bias(
    progress: Progress,
    constraints: Constraints,
    eos_id: int,
    limit: int,
    tokens: tuple[int, ...] = (),
    banned_words: tuple[tuple[int, ...], ...] = (),
) -> tuple[list[int], list[float]]:
    """What one live row (its `tokens`) asks of the runner: bans first (the model's banned words where the row
    stands one token before completing one, EOS while a constraint is unmet, the last token of one met as often as
    needed where the row stands one token before another occurrence), then the tokens that advance an unmet
    constraint. At most `limit` entries: asks past it are left out (the row can still reach them by rank)."""
    asked: list[int] = []
    for sequence, count, needed, prefix in zip(
        constraints.sequences, progress.occurrences, constraints.needed, progress.prefixes, strict=True
    ):
        if count < needed:
            asked.append(sequence[prefix])
            if prefix:
                asked.append(sequence[0])  # a fresh start, should the one under way go astray
    wanted = set(asked)
    banned = [word[-1] for word in banned_words if len(word) == 1 or tokens[-(len(word) - 1) :] == word[:-1]]
    banned += [] if progress.all_met(constraints) else [eos_id]
    for sequence, count, needed, prefix in zip(
        constraints.sequences, progress.occurrences, constraints.needed, progress.prefixes, strict=True
    ):
        if count >= needed and prefix == len(sequence) - 1 and sequence[-1] not in wanted:
            banned.append(sequence[-1])
    banned = list(dict.fromkeys(banned))
    ids = list(dict.fromkeys([*banned, *asked]))[:limit]
    values = [BANNED if i < len(banned) else ASKED for i in range(len(ids))]
    return ids, values


@dataclass
class ConstrainedBeam(BeamState):
    """A `BeamState` whose hypotheses must contain its sentence's constraints (module docstring)."""

    constraints: Constraints = field(default_factory=lambda: Constraints((), ()))
    bias_limit: int = 32  # entries per row the runner takes (`server.core.runner.MAX_BIAS_PER_ROW`)
    banned_words: tuple[tuple[int, ...], ...] = ()  # sequences no hypothesis completes (ModelSpec.banned_words)
    progress: list[Progress] = field(default_factory=list)  # per live row

    def __post_init__(self) -> None:
        super().__post_init__()
        self.progress = [Progress.start(self.constraints) for _ in self.live]

    @property
    def candidates_needed(self) -> int:
        return 2 * self.beam_size

    def fresh(self) -> ConstrainedBeam:
        return ConstrainedBeam(
            self.beam_size, self.max_len, self.length_penalty, self.eos_id, self.forced_eos, patient=self.patient,
            forced_first=self.forced_first, constraints=self.constraints, bias_limit=self.bias_limit,
            banned_words=self.banned_words,
        )  # fmt: skip

    def row_biases(self) -> list[tuple[list[int], list[float]]]:
        """Per live row, in order: the ids to bias and their values (`row_bias`)."""
        return [
            row_bias(progress, self.constraints, self.eos_id, self.bias_limit, tokens, self.banned_words)
            for progress, (tokens, _) in zip(self.progress, self.live, strict=True)
        ]

    def advance_constrained(
        self,
        scores: npt.NDArray[np.float32],
        ids: npt.NDArray[np.int64],
        bias_ids: npt.NDArray[np.int64],
        bias_scores: npt.NDArray[np.float32],
        vocab: int,
    ) -> Advance:
        """Advance from the live rows' ranked candidates (R, k) and the scores of the ids each asked for (R, J)."""
        if self.forced_eos and self.steps == self.max_len - 1:
            return self._force_eos()
        if self.steps == 0 and self.forced_first is not None:
            move = self._force_first(self.forced_first)
            self.progress = [self.progress[0].after(tokens, self.constraints) for tokens, _ in self.live]
            return move
        ranked = _ranked(scores, ids, bias_ids, bias_scores, vocab)
        constraints, k = self.constraints, self.beam_size
        grown: list[tuple[int, int, float, Progress]] = []  # (candidate rank, parent, score, progress) of non-EOS ones
        for rank, (flat, score) in enumerate(ranked):
            parent, token = divmod(flat, vocab)
            tokens, progress = self.live[parent][0], self.progress[parent]
            if token == self.eos_id:
                if rank < k and progress.all_met(constraints):
                    hypothesis = Hypothesis(tokens, score, normalize(score, len(tokens) + 1, self.length_penalty))
                    self.finished.append(hypothesis)
                continue
            grown.append((rank, parent, score, progress.after((*tokens, token), constraints)))
        chosen = _allocate(grown, k, constraints)
        new_live = [((*self.live[parent][0], ranked[rank][0] % vocab), score) for rank, parent, score, _ in chosen]
        new_progress = [progress for _, _, _, progress in chosen]
        parents = [parent for _, parent, _, _ in chosen]
        self.steps += 1
        if self.steps >= self.max_len or not new_live:
            # The rows end as they stand: without terms, those among the K best candidates (as `BeamState`); with
            # them, every one, since one that holds the terms may rank lower
            ranks = [rank for rank, _, _, _ in chosen]
            ending = [row for row, rank in zip(new_live, ranks, strict=True) if constraints.sequences or rank < k]
            self.finished.extend(Hypothesis(t, s, normalize(s, len(t), self.length_penalty)) for t, s in ending)
            self.finished = self.best(self.beam_size)
            self.live, self.progress = [], []
            return Advance([], [], done=True)
        if len(self.finished) >= self.beam_size:
            self.finished = self.best(self.beam_size) if self.patient else self.finished
            if not (self.patient and self._could_improve(new_live)):
                self.live, self.progress = [], []
                return Advance([], [], done=True)
        self.live, self.progress = new_live, new_progress
        return Advance(parents, [t[-1] for t, _ in new_live], done=False)

    def best(self, n: int = 1) -> list[Hypothesis]:
        """The n best finished hypotheses: those that meet every constraint first, then by normalised score."""
        return sorted(self.finished, key=lambda h: (not self.meets(h.tokens), -h.normalized))[:n]

    def meets(self, tokens: tuple[int, ...]) -> bool:
        """Whether `tokens` holds every constraint as often as needed."""
        return all(
            _occurrences(tokens, sequence) >= needed
            for sequence, needed in zip(self.constraints.sequences, self.constraints.needed, strict=True)
        )


def _occurrences(tokens: tuple[int, ...], sequence: Constraint) -> int:
    size = len(sequence)
    return sum(tokens[i : i + size] == sequence for i in range(len(tokens) - size + 1))


def _ranked(
    scores: npt.NDArray[np.float32],
    ids: npt.NDArray[np.int64],
    bias_ids: npt.NDArray[np.int64],
    bias_scores: npt.NDArray[np.float32],
    vocab: int,
) -> list[tuple[int, float]]:
    """Every distinct (row, token) candidate as (flat index, score), best first, ties to the lower flat index; a
    banned token's -inf score and the padding's duplicates drop out."""
    rows = np.arange(scores.shape[0], dtype=np.int64)[:, None]
    flat = np.concatenate([(rows * vocab + ids).reshape(-1), (rows * vocab + bias_ids).reshape(-1)])
    values = np.concatenate([scores.reshape(-1), bias_scores.reshape(-1)]).astype(np.float32)
    finite = np.isfinite(values)
    flat, values = flat[finite], values[finite]
    flat, first = np.unique(flat, return_index=True)  # sorted by flat index: the stable sort keeps ties in that order
    values = values[first]
    order = np.argsort(-values, kind="stable")
    return list(zip(flat[order].tolist(), values[order].tolist(), strict=True))


def _allocate(
    grown: list[tuple[int, int, float, Progress]], k: int, constraints: Constraints
) -> list[tuple[int, int, float, Progress]]:
    """The K live rows from the non-EOS candidates (best first), as Sockeye shares them out: each bank (count of
    constraint tokens met) gets K // banks places and the furthest bank the remainder; from the furthest down, the
    places a bank has no candidates for pass to the bank below, so progress keeps its places while it has
    candidates and plain hypotheses get the rest. Places still free go to the best candidates left. Best first."""
    banks = constraints.total_tokens + 1
    bank_of = [progress.met_tokens(constraints) for _, _, _, progress in grown]
    counts = Counter(bank_of)
    share = [k // banks] * banks
    share[-1] += k - share[-1] * banks
    for bank in reversed(range(banks)):
        over = share[bank] - counts[bank]
        if over > 0:
            share[bank] -= over
            if bank:
                share[bank - 1] += over
    chosen: list[int] = []  # indices into grown
    left: list[int] = []
    for index, bank in enumerate(bank_of):
        if share[bank] > 0:
            share[bank] -= 1
            chosen.append(index)
        else:
            left.append(index)
    chosen += left[: k - len(chosen)]
    return [grown[i] for i in sorted(chosen)]
