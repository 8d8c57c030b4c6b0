"""The scheduler state machine driven by hand with the fake runner: admission, continuous batching,
beams, limits, deadlines, cancellation and failures, with exact expected outputs."""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.core.batch import Batch, reorder_slots
from server.core.events import (
    Abandoned,
    EngineLimits,
    Event,
    FailureReason,
    QueueFullError,
    RequestDone,
    RequestFailed,
    SentenceDone,
    TokensEvent,
)
from server.core.offline import translate_ids
from server.core.scheduler import Scheduler, output_limit
from server.core.work import DecodeOptions, InvalidWorkError, check_options, check_sources
from tests.fakes import FAKE_SPEC, FakeRunner, execute, reference_decode

Events = dict[int, list[Event]]


def make(max_slots: int = 8, max_queue: int = 64, max_encode_tokens: int = 4096) -> tuple[Scheduler, FakeRunner]:
    limits = EngineLimits(max_slots=max_slots, max_queue_sentences=max_queue, max_encode_tokens=max_encode_tokens)
    return Scheduler(FAKE_SPEC, limits), FakeRunner(max_slots)


def iterate(scheduler: Scheduler, runner: FakeRunner, events: Events, now: float = 0.0) -> Batch:
    batch = scheduler.schedule(now)
    for request_id, event in batch.events:
        events[request_id].append(event)
    if not batch.empty:
        for request_id, event in scheduler.update(batch, execute(runner, batch)):
            events[request_id].append(event)
    return batch


def run_all(scheduler: Scheduler, runner: FakeRunner, events: Events | None = None) -> Events:
    events = events if events is not None else defaultdict(list)
    for _ in range(1000):
        if scheduler.idle:
            return events
        iterate(scheduler, runner, events)
    raise AssertionError("the scheduler did not become idle")


def source(seed: int, length: int | None = None) -> list[int]:
    rng = np.random.default_rng(seed)
    n = length if length is not None else int(rng.integers(2, 10))
    return [4, *rng.integers(6, FAKE_SPEC.vocab_size, n - 2).tolist(), FAKE_SPEC.eos_id]


def done_hypotheses(events: list[Event]) -> dict[int, list[tuple[tuple[int, ...], float]]]:
    return {
        e.sentence_index: [(h.tokens, h.score) for h in e.hypotheses] for e in events if isinstance(e, SentenceDone)
    }


def expected(src: list[int], options: DecodeOptions) -> list[tuple[tuple[int, ...], float]]:
    max_len = output_limit(options.max_output_len, len(src), FAKE_SPEC.max_target_len)
    hyps = reference_decode(src, options.beam_size, options.length_penalty, max_len)
    return [(h.tokens, h.score) for h in hyps[: options.num_hypotheses]]


def test_reorder_keeps_first_child_in_place_and_copies_the_rest() -> None:
    order, copies = reorder_slots([10, 11, 12, 13], [0, 0, 1])
    assert order == [10, 12, 11, 13]  # row 1 (second child of row 0) takes row 2's slot, the spare stays last
    assert copies == [(10, 12)]


@given(st.data())
def test_reorder_gives_every_row_its_parents_history(data: st.DataObject) -> None:
    k = data.draw(st.integers(1, 6))
    live = data.draw(st.integers(1, k))
    parents = data.draw(st.lists(st.integers(0, live - 1), min_size=1, max_size=k))
    slots = data.draw(st.permutations(list(range(20, 20 + k))))
    cache = {slot: f"row{row}" if row < live else "spare" for row, slot in enumerate(slots)}
    order, copies = reorder_slots(slots, parents)
    gathered = {d: cache[s] for s, d in copies}  # gather semantics: all reads before any write
    cache.update(gathered)
    assert sorted(order) == sorted(slots)  # the sentence keeps exactly its K slots
    assert [cache[order[j]] for j in range(len(parents))] == [f"row{p}" for p in parents]
    assert len(copies) == len(parents) - len(set(parents))  # one copy per extra child, none otherwise


@pytest.mark.parametrize("beam_size", [1, 2, 4])
def test_one_sentence_matches_the_reference(beam_size: int) -> None:
    scheduler, runner = make()
    options = DecodeOptions(beam_size=beam_size, num_hypotheses=beam_size)
    scheduler.add(1, [source(0)], options, None, now=0.0)
    events = run_all(scheduler, runner)
    assert done_hypotheses(events[1]) == {0: expected(source(0), options)}
    assert isinstance(events[1][-1], RequestDone)


def test_mixed_beams_sharing_few_slots_match_each_sentence_alone() -> None:
    scheduler, runner = make(max_slots=6)
    requests = {}
    for request_id in range(12):
        beam_size = [1, 2, 3, 4][request_id % 4]
        options = DecodeOptions(beam_size=beam_size, num_hypotheses=min(beam_size, 1 + request_id % 3))
        sentences = [source(100 * request_id + i) for i in range(1 + request_id % 3)]
        scheduler.add(request_id, sentences, options, None, now=0.0)
        requests[request_id] = (sentences, options)
    events = run_all(scheduler, runner)
    for request_id, (sentences, options) in requests.items():
        assert done_hypotheses(events[request_id]) == {i: expected(s, options) for i, s in enumerate(sentences)}
        assert isinstance(events[request_id][-1], RequestDone)
    assert max(runner.step_batch_sizes) == 6  # the pool was shared, not run one request at a time
    assert scheduler.active_slots == 0 and scheduler.queue_depth == 0


def test_finished_rows_free_their_slots_and_new_work_joins_the_next_step() -> None:
    scheduler, runner = make(max_slots=2)
    greedy = DecodeOptions(beam_size=1)
    scheduler.add(1, [source(1)], DecodeOptions(beam_size=1, max_output_len=2), None, now=0.0)
    scheduler.add(2, [source(2)], DecodeOptions(beam_size=1, max_output_len=9), None, now=0.0)
    scheduler.add(3, [source(3)], greedy, None, now=0.0)  # waits for a slot
    events: Events = defaultdict(list)
    iterate(scheduler, runner, events)
    assert scheduler.queue_depth == 1
    second = iterate(scheduler, runner, events)  # request 1 generates its 2nd token and leaves
    assert isinstance(events[1][-1], RequestDone)
    assert scheduler.active_slots == 1 and second.slots == [0, 1]
    third = iterate(scheduler, runner, events)
    assert [item.slots for item in third.encode] == [[0]]  # request 3 took the freed slot at once
    assert sorted(third.slots) == [0, 1] and scheduler.queue_depth == 0
    assert third.positions == [2, 0]  # request 2 mid-sentence beside request 3's first step


def test_admission_is_fifo_and_a_wide_beam_waits_for_enough_slots() -> None:
    scheduler, runner = make(max_slots=4)
    scheduler.add(1, [source(1)], DecodeOptions(beam_size=3), None, now=0.0)
    scheduler.add(2, [source(2)], DecodeOptions(beam_size=2), None, now=0.0)
    scheduler.add(3, [source(3)], DecodeOptions(beam_size=1), None, now=0.0)
    batch = iterate(scheduler, runner, defaultdict(list))
    # request 2 needs 2 slots and 1 is free: it blocks request 3 behind it rather than being overtaken
    assert [item.slots for item in batch.encode] == [[0, 1, 2]]
    assert scheduler.queue_depth == 2


def test_encode_token_budget_spreads_a_burst_over_iterations() -> None:
    scheduler, runner = make(max_slots=8, max_encode_tokens=10)
    scheduler.add(1, [source(i, length=6) for i in range(3)], DecodeOptions(beam_size=1), None, now=0.0)
    scheduler.add(2, [source(9, length=14)], DecodeOptions(beam_size=1), None, now=0.0)
    events: Events = defaultdict(list)
    admitted = [[len(i.source_ids) for i in iterate(scheduler, runner, events).encode] for _ in range(3)]
    assert admitted == [[6], [6], [6]]  # 6 + 6 > 10
    assert [len(i.source_ids) for i in iterate(scheduler, runner, events).encode] == [14]  # alone, over budget


def waiting(max_slots: int, wait_s: float, ratio: float = 0.5) -> tuple[Scheduler, FakeRunner]:
    limits = EngineLimits(max_slots=max_slots, max_queue_sentences=64, admission_wait_s=wait_s, admission_ratio=ratio)
    return Scheduler(FAKE_SPEC, limits), FakeRunner(max_slots)


def test_an_idle_engine_admits_at_once_whatever_the_admission_wait() -> None:
    scheduler, runner = waiting(max_slots=8, wait_s=10.0)
    scheduler.add(1, [source(1)], DecodeOptions(beam_size=1), None, now=0.0)
    assert len(iterate(scheduler, runner, defaultdict(list), now=0.0).encode) == 1


def test_arrivals_wait_to_share_an_encoder_call_until_they_bring_enough_rows() -> None:
    """While 4 rows decode, a ratio of 0.5 holds arrivals back until they bring 2 rows: two arrivals then share
    one encoder call instead of paying one each. (Broken once on purpose, `_defers_admission` returning False:
    the first arrival is encoded alone and this fails.)"""
    scheduler, runner = waiting(max_slots=8, wait_s=10.0)
    long = DecodeOptions(beam_size=1, max_output_len=20)
    scheduler.add(1, [source(i) for i in range(4)], long, None, now=0.0)
    events: Events = defaultdict(list)
    assert len(iterate(scheduler, runner, events, now=0.0).encode) == 4
    scheduler.add(2, [source(5)], long, None, now=0.1)
    first = iterate(scheduler, runner, events, now=0.2)
    assert first.encode == [] and scheduler.queue_depth == 1 and len(first.slots) == 4  # decoding went on
    scheduler.add(3, [source(6)], long, None, now=0.3)
    second = iterate(scheduler, runner, events, now=0.4)
    assert [len(item.slots) for item in second.encode] == [1, 1] and scheduler.queue_depth == 0


def test_arrivals_wait_no_longer_than_the_admission_wait_after_the_last_admission() -> None:
    """The wait runs from the last admission, not from a sentence's arrival: at saturation every queued sentence
    has waited long for slots, and counting from arrival would never batch anything. An arrival after a quiet
    spell joins at once."""
    scheduler, runner = waiting(max_slots=8, wait_s=0.05)
    long = DecodeOptions(beam_size=1, max_output_len=40)
    scheduler.add(1, [source(i) for i in range(4)], long, None, now=0.0)
    events: Events = defaultdict(list)
    iterate(scheduler, runner, events, now=0.0)
    scheduler.add(2, [source(5)], long, None, now=-5.0)  # queued long ago (e.g. behind a full pool)
    assert iterate(scheduler, runner, events, now=0.049).encode == []
    assert len(iterate(scheduler, runner, events, now=0.05).encode) == 1
    scheduler.add(3, [source(6)], long, None, now=1.0)
    assert len(iterate(scheduler, runner, events, now=1.0).encode) == 1  # nothing admitted since 0.05
    done = run_all(scheduler, runner, events)
    assert done_hypotheses(done[2])[0] == expected(source(5), long)  # a delayed admission decodes the same


def test_rows_that_cannot_fit_the_free_slots_do_not_count_toward_the_ratio() -> None:
    """Only what fits the free slots now could join: with 6 rows decoding (a ratio of 0.5 wants 3) and 2 slots
    free, two greedy arrivals bring 2 rows and the beam of 4 behind them brings none yet, so all wait. (Broken
    once on purpose, counting every queued row: the two greedy arrivals are admitted and this fails.)"""
    scheduler, runner = waiting(max_slots=8, wait_s=10.0)
    long = DecodeOptions(beam_size=1, max_output_len=20)
    scheduler.add(1, [source(i) for i in range(6)], long, None, now=0.0)
    events: Events = defaultdict(list)
    iterate(scheduler, runner, events, now=0.0)
    scheduler.add(2, [source(7), source(8)], long, None, now=0.1)
    scheduler.add(3, [source(9)], DecodeOptions(beam_size=4, max_output_len=5), None, now=0.1)
    assert iterate(scheduler, runner, events, now=0.2).encode == [] and scheduler.queue_depth == 3
    assert [len(item.slots) for item in iterate(scheduler, runner, events, now=10.1).encode] == [1, 1]  # waited enough


def test_admission_wait_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="admission_wait_s"):
        EngineLimits(admission_wait_s=float("nan"))
    with pytest.raises(ValueError, match="admission_ratio"):
        EngineLimits(admission_ratio=-1.0)


def test_queue_bound_refuses_a_request_whole() -> None:
    scheduler, _ = make(max_slots=1, max_queue=3)
    scheduler.add(1, [source(1), source(2)], DecodeOptions(beam_size=1), None, now=0.0)
    with pytest.raises(QueueFullError):
        scheduler.add(2, [source(3), source(4)], DecodeOptions(beam_size=1), None, now=0.0)
    assert scheduler.queue_depth == 2 and scheduler.request_ids() == [1]
    scheduler.add(3, [source(5)], DecodeOptions(beam_size=1), None, now=0.0)
    assert scheduler.queue_depth == 3


def test_deadline_fails_queued_and_decoding_work_and_frees_slots() -> None:
    scheduler, runner = make(max_slots=4)
    scheduler.add(1, [source(1)], DecodeOptions(beam_size=4), deadline=5.0, now=0.0)
    scheduler.add(2, [source(2)], DecodeOptions(beam_size=1), deadline=5.0, now=0.0)  # queued behind it
    scheduler.add(3, [source(3)], DecodeOptions(beam_size=1), deadline=None, now=0.0)
    events: Events = defaultdict(list)
    iterate(scheduler, runner, events, now=1.0)
    assert scheduler.active_slots == 4 and scheduler.queue_depth == 2
    batch = iterate(scheduler, runner, events, now=5.0)
    for request_id in (1, 2):
        [failed] = events[request_id]
        assert isinstance(failed, RequestFailed) and failed.reason is FailureReason.DEADLINE_EXCEEDED
    assert [item.source_ids for item in batch.encode] == [source(3)]  # the freed slots serve the next request
    run_all(scheduler, runner, events)
    assert done_hypotheses(events[3]) == {0: expected(source(3), DecodeOptions(beam_size=1))}


def test_a_finished_requests_deadline_never_fails_a_later_request_of_the_same_id() -> None:
    """The scheduler looks only at due deadlines and cancellations (not every request each iteration): a
    deadline left behind by a request that finished applies to nothing, even when its id comes back, and
    the deadlines of finished requests do not pile up."""
    scheduler, runner = make(max_slots=4, max_queue=4096)
    scheduler.add(1, [source(1)], DecodeOptions(beam_size=1), deadline=5.0, now=0.0)
    events = run_all(scheduler, runner)
    assert isinstance(events[1][-1], RequestDone)
    scheduler.add(1, [source(2)], DecodeOptions(beam_size=1), deadline=None, now=6.0)  # the id again
    scheduler.add(2, [source(3)], DecodeOptions(beam_size=1), deadline=7.0, now=6.0)
    later: Events = defaultdict(list)
    iterate(scheduler, runner, later, now=6.5)
    iterate(scheduler, runner, later, now=8.0)  # past the first request 1's deadline and request 2's
    assert not any(isinstance(e, RequestFailed) for e in later[1])
    [failed] = [e for e in later[2] if isinstance(e, RequestFailed)]
    assert failed.reason is FailureReason.DEADLINE_EXCEEDED
    run_all(scheduler, runner, later)
    assert done_hypotheses(later[1]) == {0: expected(source(2), DecodeOptions(beam_size=1))}
    for request_id in range(100, 3100):  # requests that finish long before their deadlines
        scheduler.add(request_id, [source(request_id % 7)], DecodeOptions(beam_size=1), deadline=1e9, now=9.0)
        if request_id % 100 == 0:
            run_all(scheduler, runner)
    run_all(scheduler, runner)
    assert scheduler.idle and len(scheduler._deadlines) <= 2 * 100 + 1024 + 1  # bounded by the live requests


def test_failures_report_how_far_each_unfinished_sentence_got() -> None:
    scheduler, runner = make(max_slots=2)
    scheduler.add(1, [source(1), source(2), source(3)], DecodeOptions(beam_size=1), deadline=5.0, now=0.0)
    scheduler.add(2, [source(4)], DecodeOptions(beam_size=1), deadline=None, now=0.0)
    events: Events = defaultdict(list)
    iterate(scheduler, runner, events, now=1.0)  # sentences 0 and 1 decode, 2 and request 2 wait
    assert scheduler.take_abandoned() == []
    iterate(scheduler, runner, events, now=5.0)
    assert scheduler.take_abandoned() == [Abandoned(1, FailureReason.DEADLINE_EXCEEDED, queued=1, decoding=2)]
    assert scheduler.take_abandoned() == [], "taking empties the list"
    scheduler.fail({2}, FailureReason.UNAVAILABLE, "shutting down")
    assert scheduler.take_abandoned() == [Abandoned(2, FailureReason.UNAVAILABLE, queued=0, decoding=1)]


def test_finished_sentences_of_a_failed_request_are_not_counted_as_abandoned() -> None:
    scheduler, runner = make(max_slots=1)
    short, long = source(1)[:2], source(2)
    scheduler.add(1, [short, long], DecodeOptions(beam_size=1), deadline=None, now=0.0)
    events: Events = defaultdict(list)
    while not any(isinstance(e, SentenceDone) for e in events[1]):
        iterate(scheduler, runner, events)
    scheduler.cancel(1)
    iterate(scheduler, runner, events)
    # the done sentence is not counted; the other never got the slot (expiry runs before admission)
    assert scheduler.take_abandoned() == [Abandoned(1, FailureReason.CANCELLED, queued=1, decoding=0)]


def test_cancel_while_queued_and_while_decoding() -> None:
    scheduler, runner = make(max_slots=2)
    scheduler.add(1, [source(1), source(2)], DecodeOptions(beam_size=2), None, now=0.0)
    events: Events = defaultdict(list)
    iterate(scheduler, runner, events)  # sentence 0 decoding, sentence 1 queued
    scheduler.cancel(1)
    scheduler.cancel(99)  # unknown or finished: ignored
    batch = iterate(scheduler, runner, events)
    assert batch.empty and events[1] == [RequestFailed(FailureReason.CANCELLED, "the request was cancelled")]
    assert scheduler.idle and scheduler.active_slots == 0 and scheduler.queue_depth == 0


def test_a_cancel_for_a_passed_deadline_fails_as_deadline_exceeded() -> None:
    """grpc cancels a call at its deadline before the engine's own check: the failure keeps the reason."""
    scheduler, runner = make(max_slots=1)
    scheduler.add(1, [source(1)], DecodeOptions(beam_size=1), None, now=0.0)
    scheduler.add(2, [source(2)], DecodeOptions(beam_size=1), None, now=0.0)
    scheduler.add(3, [source(3)], DecodeOptions(beam_size=1), deadline=5.0, now=0.0)
    events: Events = defaultdict(list)
    iterate(scheduler, runner, events)  # 1 decoding, 2 and 3 queued
    scheduler.cancel(1, FailureReason.DEADLINE_EXCEEDED)
    scheduler.cancel(2)
    scheduler.cancel(3)  # the client left after its deadline: the deadline is what failed it
    failures = dict(scheduler.schedule(now=6.0).events)
    deadline = RequestFailed(FailureReason.DEADLINE_EXCEEDED, "the deadline passed before the translation finished")
    cancel = RequestFailed(FailureReason.CANCELLED, "the request was cancelled")
    assert failures == {1: deadline, 2: cancel, 3: deadline}
    assert sorted(scheduler.take_abandoned(), key=lambda a: a.request_id) == [
        Abandoned(1, FailureReason.DEADLINE_EXCEEDED, queued=0, decoding=1),
        Abandoned(2, FailureReason.CANCELLED, queued=1, decoding=0),
        Abandoned(3, FailureReason.DEADLINE_EXCEEDED, queued=1, decoding=0),
    ]


def test_fail_drops_only_the_given_requests() -> None:
    scheduler, runner = make(max_slots=4)
    scheduler.add(1, [source(1)], DecodeOptions(beam_size=2), None, now=0.0)
    scheduler.add(2, [source(2)], DecodeOptions(beam_size=2), None, now=0.0)
    events: Events = defaultdict(list)
    iterate(scheduler, runner, events)
    failed = scheduler.fail({1}, FailureReason.INTERNAL, "internal error")
    assert failed == [(1, RequestFailed(FailureReason.INTERNAL, "internal error"))]
    assert scheduler.active_slots == 2
    scheduler.add(3, [source(3)], DecodeOptions(beam_size=2), None, now=0.0)  # reuses request 1's slots
    run_all(scheduler, runner, events)
    assert done_hypotheses(events[2]) == {0: expected(source(2), DecodeOptions(beam_size=2))}
    assert done_hypotheses(events[3]) == {0: expected(source(3), DecodeOptions(beam_size=2))}


def test_streaming_greedy_reports_every_token() -> None:
    scheduler, runner = make()
    scheduler.add(1, [source(4)], DecodeOptions(beam_size=1, stream_tokens=True), None, now=0.0)
    events = run_all(scheduler, runner)[1]
    partial = [e.token_ids for e in events if isinstance(e, TokensEvent)]
    final = done_hypotheses(events)[0][0][0]
    assert partial == [final[:n] for n in range(1, len(partial) + 1)]
    assert len(partial) >= len(final) - 1 and partial  # one event per step until the last


def test_output_length_is_capped_by_request_and_model() -> None:
    scheduler, runner = make()
    scheduler.add(1, [source(5)], DecodeOptions(beam_size=2, max_output_len=3, num_hypotheses=2), None, now=0.0)
    runs_long = source(1, 16)  # a source whose greedy decode would go on past the model's 12 tokens
    scheduler.add(2, [runs_long], DecodeOptions(beam_size=1, max_output_len=10_000), None, now=0.0)
    events = run_all(scheduler, runner)
    hyps = done_hypotheses(events[1])[0]
    assert len(hyps) == 2 and all(len(tokens) <= 3 for tokens, _ in hyps)
    ((tokens, _),) = done_hypotheses(events[2])[0]
    assert len(tokens) == FAKE_SPEC.max_target_len  # cut at the model's limit, not the request's
    assert done_hypotheses(events[2])[0] == expected(runs_long, DecodeOptions(beam_size=1))


@pytest.mark.parametrize(
    ("sentences", "options", "message"),
    [
        ([], DecodeOptions(), "at least one sentence"),
        ([[]], DecodeOptions(), "a source must hold 1 to 16 tokens, got 0"),
        ([[4] * 17], DecodeOptions(), "a source must hold 1 to 16 tokens, got 17"),
        ([[4, 99]], DecodeOptions(), "source token ids must be in"),
        ([[4, 3]], DecodeOptions(beam_size=9), "options.beam_size must be in 1..8, got 9"),
        ([[4, 3]], DecodeOptions(beam_size=0), "options.beam_size must be in 1..8, got 0"),
        ([[4, 3]], DecodeOptions(beam_size=2, num_hypotheses=3), "options.num_hypotheses must be in 1..beam_size (2)"),
        ([[4, 3]], DecodeOptions(max_output_len=-1), "options.max_output_len must be at most"),
        (
            [[4, 3]],
            DecodeOptions(max_output_len=FAKE_SPEC.max_target_len + 1),
            "options.max_output_len must be at most",
        ),
        ([[4, 3]], DecodeOptions(length_penalty=float("nan")), "options.length_penalty must be in 0..2.0"),
        ([[4, 3]], DecodeOptions(length_penalty=2.5), "options.length_penalty must be in 0..2.0"),
    ],
)
def test_each_rule_of_valid_work_lives_in_one_function(
    sentences: list[list[int]], options: DecodeOptions, message: str
) -> None:
    """server.core.work holds every rule; the edge and offline callers check with it, the scheduler trusts."""
    with pytest.raises(InvalidWorkError, match=re.escape(message)):
        check_options(options, max_beam_size=8, max_target_len=FAKE_SPEC.max_target_len)
        check_sources(sentences, FAKE_SPEC)


def test_offline_decoding_checks_its_work_with_the_same_rules() -> None:
    with pytest.raises(InvalidWorkError, match=re.escape("options.beam_size must be in 1..8")):
        translate_ids(FakeRunner(max_slots=8), [[4, 3]], beam_size=9, length_penalty=1.0, max_len=None)


def test_default_output_limit_is_relative_to_the_source_and_capped() -> None:
    """Broken once on purpose (the default without the model's cap), a 100-token source was given 310."""
    assert output_limit(0, 5, 256) == 3 * 5 + 10  # the default: 3 x source tokens + 10
    assert output_limit(0, 100, 256) == 256  # never over the model's limit
    assert output_limit(7, 100, 256) == 7  # a request's own limit wins
    assert output_limit(300, 5, 256) == 256


def test_scheduler_applies_the_default_limit_per_sentence() -> None:
    scheduler = Scheduler(FAKE_SPEC, EngineLimits(max_slots=4))
    short, long_ = source(1, length=3), source(2, length=9)
    scheduler.add(1, [short, long_], DecodeOptions(beam_size=1), deadline=None, now=0.0)
    limits = [s.beam.max_len for s in scheduler._requests[1].sentences]
    assert limits == [output_limit(0, 3, FAKE_SPEC.max_target_len), output_limit(0, 9, FAKE_SPEC.max_target_len)]


def test_a_finished_sentence_carries_its_queue_wait_and_the_encoder_call_that_admitted_it() -> None:
    scheduler, runner = make(max_slots=1)
    greedy = DecodeOptions(beam_size=1, max_output_len=2)
    scheduler.add(1, [source(1), source(2)], greedy, None, now=10.0)
    done: list[SentenceDone] = []
    for now, encoded in ((11.0, (11.5, 12.0)), (13.0, None), (14.0, (14.25, 14.75)), (15.0, None)):
        batch = scheduler.schedule(now)
        events = scheduler.update(batch, execute(runner, batch), encoded)
        done += [event for _, event in events if isinstance(event, SentenceDone)]
    assert [(d.sentence_index, d.queue_wait_s, d.encoded_s) for d in done] == [
        (0, 1.0, (1.5, 2.0)),  # got the slot at 11; encoded 1.5 to 2 s after it was queued
        (1, 4.0, (4.25, 4.75)),  # waited for sentence 0's slot
    ]
