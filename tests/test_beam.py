"""The beam state machine's candidate selection: a fast top-k that must equal the stable full sort."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from server.beam import top_1, top_k_stable


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
