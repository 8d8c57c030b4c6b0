"""The beam state machine's candidate selection: fast top-k, and rows ranked apart then merged, must
equal the stable full sort."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from server.core.beam import (
    BeamState,
    Hypothesis,
    merge_candidates,
    merge_candidates_of,
    row_candidates,
    top_1,
    top_k_stable,
)


def reference_top_k(scores: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    flat = scores.reshape(-1)
    order = np.argsort(-flat, kind="stable")[:k]
    return order.tolist(), flat[order].tolist()


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 40),
    k=st.integers(1, 12),
    distinct=st.integers(1, 6),  # few distinct values: many ties, also across rows and at the cut
    seed=st.integers(0, 2**32 - 1),
)
def test_top_k_equals_the_stable_full_sort(rows: int, vocab: int, k: int, distinct: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    scores = rng.choice(np.linspace(-5, 0, distinct), size=(rows, vocab)).astype(np.float32)
    k = min(k, scores.size)
    order, values = top_k_stable(scores, k)
    assert (order.tolist(), values.tolist()) == reference_top_k(scores, k)


@settings(max_examples=100, deadline=None)
@given(vocab=st.integers(1, 40), distinct=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_greedy_top_1_equals_the_stable_full_sort(vocab: int, distinct: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    scores = rng.choice(np.linspace(-5, 0, distinct), size=(1, vocab)).astype(np.float32)
    order, values = top_1(scores)
    assert (order.tolist(), values.tolist()) == reference_top_k(scores, 1)


def test_top_k_on_real_sized_rows() -> None:
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((4, 8000)).astype(np.float32)
    scores[2, 17] = scores[0, 5] = scores.max() + 1  # a tie for first place across rows
    order, values = top_k_stable(scores, 8)
    assert (order.tolist(), values.tolist()) == reference_top_k(scores, 8)
    assert order[0] == 5 and order[1] == 2 * 8000 + 17


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(1, 30),
    needed=st.integers(1, 8),
    extra=st.integers(0, 3),  # runners may rank more than a sentence needs (the batch's widest beam)
    distinct=st.integers(1, 6),  # few distinct values: ties within rows, across rows and at every cut
    seed=st.integers(0, 2**32 - 1),
)
def test_rows_ranked_apart_then_merged_equal_the_full_stable_sort(
    rows: int, vocab: int, needed: int, extra: int, distinct: int, seed: int
) -> None:
    """What the server does (each row's k best, ranked by the runner, then merged) picks what `advance` picks."""
    rng = np.random.default_rng(seed)
    logprobs = rng.choice(np.linspace(-5, 0, distinct), size=(rows, vocab)).astype(np.float32)
    row_scores = rng.choice([-1.0, -2.0, -1.5], size=rows).astype(np.float32)
    scores, ids = row_candidates(logprobs, row_scores, needed + extra)
    order, values = merge_candidates(scores, ids, vocab, needed)
    assert (order.tolist(), values.tolist()) == reference_top_k(row_scores[:, None] + logprobs, needed)


@settings(max_examples=300, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 9)), min_size=1, max_size=6),  # (rows, needed)
    vocab=st.integers(1, 30),
    k=st.integers(1, 9),  # one k for the whole step: the batch's widest beam's, capped at V
    distinct=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
)
def test_sentences_merged_together_rank_as_each_merged_alone(
    shapes: list[tuple[int, int]], vocab: int, k: int, distinct: int, seed: int
) -> None:
    """`merge_candidates_of` (one sort for a step's beam sentences, rows padded) gives each sentence what
    `merge_candidates` gives it alone, ties and sentences with fewer candidates than they need included."""
    rng = np.random.default_rng(seed)
    total = sum(rows for rows, _ in shapes)
    logprobs = rng.choice(np.linspace(-5, 0, distinct), size=(total, vocab)).astype(np.float32)
    scores, ids = row_candidates(logprobs, rng.choice([-1.0, -2.0, -1.5], size=total), k)
    spans, start = [], 0
    for rows, needed in shapes:
        spans.append((start, rows, needed))
        start += rows
    for (begin, rows, needed), got in zip(spans, merge_candidates_of(scores, ids, vocab, spans), strict=True):
        order, values = merge_candidates(scores[begin : begin + rows], ids[begin : begin + rows], vocab, needed)
        assert got == (order.tolist(), values.tolist())
    assert merge_candidates_of(scores, ids, vocab, []) == []


def test_row_candidates_rank_best_first_with_ties_to_the_lower_id() -> None:
    logprobs = np.asarray([[-1.0, -0.5, -0.5, -3.0]], dtype=np.float32)
    scores, ids = row_candidates(logprobs, np.asarray([-1.0], dtype=np.float32), 3)
    assert ids.tolist() == [[1, 2, 0]] and scores.tolist() == [[-1.5, -1.5, -2.0]]
    assert row_candidates(logprobs, np.zeros(1, np.float32), 10)[1].shape == (1, 4), "k is capped at V"


@settings(max_examples=200, deadline=None)
@given(
    vocab=st.integers(2, 30),
    extra=st.integers(0, 3),  # runners rank as many candidates as the batch's widest beam needs
    distinct=st.integers(1, 4),  # ties at the top: the lower id wins
    max_len=st.integers(1, 6),
    forced_eos=st.booleans(),
    penalty=st.sampled_from([0.6, 1.0, 1.3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_greedy_from_the_best_candidate_equals_the_merged_ranking(
    vocab: int, extra: int, distinct: int, max_len: int, forced_eos: bool, penalty: float, seed: int
) -> None:
    """`advance_greedy` (the scheduler's path for K = 1, unrolled) moves a sentence exactly as `advance_ranked`
    does, EOS, the length limit, a forced EOS and length penalties included, step after step."""
    rng = np.random.default_rng(seed)
    ranked, greedy = (BeamState(1, max_len, penalty, eos_id=1, forced_eos=forced_eos) for _ in range(2))
    while ranked.live:
        logprobs = rng.choice(np.linspace(-4, 0, distinct), size=(1, vocab)).astype(np.float32)
        scores, ids = row_candidates(logprobs, ranked.live_scores(), 1 + extra)
        assert greedy.advance_greedy(float(scores[0, 0]), int(ids[0, 0]), vocab) == ranked.advance_ranked(
            scores, ids, vocab
        )
        assert (greedy.live, greedy.finished, greedy.steps) == (ranked.live, ranked.finished, ranked.steps)


def test_n_best_ranks_finished_hypotheses_by_their_length_normalized_score() -> None:
    """A short hypothesis that finished first with the better raw score ranks below a longer one whose score
    per token (length penalty 1) is better. Broken once on purpose (`best` sorting by the raw score), the
    short one came first: every served n-best test had passed, their hypotheses ranking alike either way."""
    beam = BeamState(beam_size=2, max_len=5, length_penalty=1.0, eos_id=3, forced_eos=False)
    low = -20.0

    def step(*rows: list[float]) -> None:
        assert not beam.advance(np.asarray(rows, dtype=np.float32)).done

    step([-6.0, -0.5, -5.0, -1.0])  # EOS at once: () finishes at -1.0; (1,) and (2,) stay live
    step([-9.0, -0.5, low, low], [low, low, low, low])  # (1, 1) at -1.0 and (1, 0) stay live
    assert beam.advance(np.asarray([[low, low, low, -0.5], [low, low, low, low]], dtype=np.float32)).done
    ranked = beam.best(2)
    assert [(h.tokens, h.score, h.normalized) for h in ranked] == [((1, 1), -1.5, -0.5), ((), -1.0, -1.0)]
    assert beam.best(1) == ranked[:1]


def test_a_forced_first_token_passes_over_the_first_steps_candidates() -> None:
    """The first step's only candidate is the forced token (an NLLB or M2M100 target's code), at score 0, greedy
    and beam alike; the search goes on from it as from any live row, and its length counts the token."""
    logprobs = np.log(np.asarray([[0.1, 0.6, 0.1, 0.1, 0.1, 0.0]], dtype=np.float32) + 1e-9)  # EOS (id 1) likeliest
    scores, ids = row_candidates(logprobs, np.zeros(1, np.float32), 6)
    for beam_size in (1, 3):
        beam = BeamState(beam_size, max_len=4, length_penalty=1.0, eos_id=1, forced_first=5)
        if beam_size == 1:  # the scheduler's paths: greedy from the best candidate, beams from the ranked rows
            first = beam.advance_greedy(float(scores[0, 0]), int(ids[0, 0]), 6)
        else:
            first = beam.advance_ranked(scores, ids, 6)
        assert (first.parents, first.tokens, first.done) == ([0], [5], False)
        assert (beam.live, beam.steps) == ([((5,), 0.0)], 1)
        assert beam.advance(logprobs).done == (beam_size == 1)  # greedy ends at its EOS, a beam of 3 goes on
        eos = float(logprobs[0, 1])
        assert beam.finished[0] == Hypothesis((5,), eos, eos / 2)
    alone = BeamState(2, max_len=1, length_penalty=1.0, eos_id=1, forced_first=5)
    assert alone.advance(logprobs).done and alone.best(2) == [Hypothesis((5,), 0.0, 0.0)]
    ended = BeamState(2, max_len=2, length_penalty=1.0, eos_id=1, forced_eos=True, forced_first=5)
    assert not ended.advance(logprobs).done and ended.advance(logprobs).done
    assert ended.best(2) == [Hypothesis((5,), 0.0, 0.0)]
