"""Lexically constrained beam search (`server.core.constraints`): each row's bias, the bank allocation, and decoding
through the scheduler with the fake runner, whose log-probabilities never favour a term on their own."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.core.constraints import Constraints, Progress, row_bias
from server.core.offline import translate_ids
from server.core.runner import MAX_BIAS_PER_ROW
from tests.fakes import FAKE_SPEC, FakeRunner

EOS = FAKE_SPEC.eos_id
SOURCE = [4, 7, 8, 9, 10, EOS]
WORDS = [w for w in range(6, FAKE_SPEC.vocab_size)]  # ids a term may hold: not PAD, BOS, EOS or a tag


def progress_of(tokens: tuple[int, ...], constraints: Constraints) -> Progress:
    progress = Progress.start(constraints)
    for end in range(1, len(tokens) + 1):
        progress = progress.after(tokens[:end], constraints)
    return progress


def occurrences(tokens: tuple[int, ...], term: tuple[int, ...]) -> int:
    return sum(tokens[i : i + len(term)] == term for i in range(len(tokens) - len(term) + 1))


def test_constraints_count_a_repeated_term_and_drop_empty_ones() -> None:
    constraints = Constraints.of(((7, 8), (9,), (7, 8), ()))
    assert constraints.sequences == ((7, 8), (9,))
    assert constraints.needed == (2, 1)
    assert constraints.total_tokens == 5


def test_a_row_bans_eos_until_every_term_stands_and_asks_for_the_next_term_token() -> None:
    constraints = Constraints.of(((7, 8),))
    ids, values = row_bias(progress_of((), constraints), constraints, EOS, MAX_BIAS_PER_ROW)
    assert dict(zip(ids, values, strict=True)) == {EOS: -math.inf, 7: 0.0}
    ids, values = row_bias(progress_of((12, 7), constraints), constraints, EOS, MAX_BIAS_PER_ROW)
    assert dict(zip(ids, values, strict=True)) == {EOS: -math.inf, 8: 0.0, 7: 0.0}  # go on, or start again
    ids, values = row_bias(progress_of((7, 8, 12), constraints), constraints, EOS, MAX_BIAS_PER_ROW)
    assert ids == [] and values == []  # met: EOS is free, nothing asked


def test_a_met_term_is_never_completed_again() -> None:
    constraints = Constraints.of(((7, 8),))
    ids, values = row_bias(progress_of((7, 8, 13, 7), constraints), constraints, EOS, MAX_BIAS_PER_ROW)
    assert dict(zip(ids, values, strict=True)) == {8: -math.inf}
    single = Constraints.of(((9,),))
    ids, values = row_bias(progress_of((9, 13), single), single, EOS, MAX_BIAS_PER_ROW)
    assert dict(zip(ids, values, strict=True)) == {9: -math.inf}


def test_a_row_asks_for_no_more_than_the_runner_takes() -> None:
    constraints = Constraints.of(tuple((w,) for w in WORDS))
    ids, values = row_bias(progress_of((), constraints), constraints, EOS, 5)
    assert ids == [EOS, *WORDS[:4]] and values[0] == -math.inf and values[1:] == [0.0] * 4


@pytest.mark.parametrize("beam_size", [1, 4])
def test_decoding_places_each_term_exactly_as_often_as_its_source_holds_it(beam_size: int) -> None:
    terms = ((11, 12), (15,), (15,))
    [[best]] = translate_ids(FakeRunner(), [SOURCE], beam_size, 1.0, None, terms=(terms,))
    assert occurrences(best.tokens, (11, 12)) == 1
    assert occurrences(best.tokens, (15,)) == 2


def test_a_sentence_without_terms_decodes_as_without_a_glossary() -> None:
    sources = [SOURCE, [5, 9, 9, 7, EOS]]
    plain = translate_ids(FakeRunner(), sources, 4, 1.0, None)
    mixed = translate_ids(FakeRunner(), sources, 4, 1.0, None, terms=((), ((13,),)))
    assert mixed[0] == plain[0]
    assert occurrences(mixed[1][0].tokens, (13,)) == 1


def test_scores_of_a_constrained_hypothesis_are_the_model_s_own() -> None:
    """The bias only asks and bans: a finished hypothesis's score is the sum of its tokens' log-probabilities."""
    from tests.fakes import fake_logprobs

    [[best]] = translate_ids(FakeRunner(), [SOURCE], 4, 1.0, None, terms=(((11, 12),),))
    fed = [FAKE_SPEC.bos_id]
    total = 0.0
    for token in (*best.tokens, EOS):
        total += float(fake_logprobs(SOURCE, fed)[token])
        fed.append(token)
    assert best.score == pytest.approx(total, abs=1e-4)


def test_an_output_limit_too_short_for_the_terms_still_answers() -> None:
    terms = tuple((w,) for w in WORDS[:6])
    [[best]] = translate_ids(FakeRunner(), [SOURCE], 4, 1.0, 3, terms=(terms,))
    assert len(best.tokens) <= 3


@settings(max_examples=60, deadline=None)
@given(
    terms=st.lists(st.lists(st.sampled_from(WORDS), min_size=1, max_size=3).map(tuple), min_size=1, max_size=3),
    beam_size=st.sampled_from([1, 2, 4]),
)
def test_every_term_stands_as_often_as_mentioned(terms: list[tuple[int, ...]], beam_size: int) -> None:
    """With room for them all (at most 9 term tokens in 12), every term stands at least as often as mentioned, and
    exactly as often where no two terms share a token (one inside or across another may be met by it)."""
    constraints = Constraints.of(tuple(terms))
    [[best]] = translate_ids(FakeRunner(), [SOURCE], beam_size, 1.0, 12, terms=(tuple(terms),))
    counts = [occurrences(best.tokens, s) for s in constraints.sequences]
    assert all(c >= n for c, n in zip(counts, constraints.needed, strict=True)), (constraints, best.tokens)
    tokens = [t for s in constraints.sequences for t in s]
    if len(set(tokens)) == len(tokens):
        assert counts == list(constraints.needed), (constraints, best.tokens)
