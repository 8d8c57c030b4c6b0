"""Iteration-level (continuous) batching with beam search, as a pure state machine.

Each iteration the engine calls `schedule` (expire deadlines and cancellations, admit queued
sentences into free slots, list the rows to step), runs the runner on the returned `Batch`, then
calls `update` with each row's ranked candidates (advance every sentence's beam, free the slots of finished
sentences at once, plan next iteration's beam reordering). Nothing here knows of threads, gRPC or
onnxruntime, so every rule is unit-tested with a fake runner.

One slot holds one beam row; a sentence with beam size K reserves K slots from admission to finish,
so a step never waits for memory. Each sentence has its own `BeamState` and its rows only ever read
their own slots, so a result does not depend on what else shares the batch.

Faults stay with the request that causes them where the batch allows telling it apart: rows whose
scores are NaN, or whose candidates their beam refuses, fail only their own request (`update`), and
when a runner call raises for a batch of several requests, `isolate` restarts them in two halves that
never share a call, halving again whichever fails again: the request at fault fails alone after about
log2(n) reruns, and the others keep running in batches instead of one at a time.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import deque

import numpy as np

from model.config import default_output_limit
from server.core.batch import Batch, RowGroup, ScheduledRequest, ScheduledSentence, reorder_slots, row_bias
from server.core.beam import Advance, BeamState, merge_candidates_of
from server.core.constraints import ConstrainedBeam, Constraints
from server.core.events import (
    INTERNAL_MESSAGE,
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
from server.core.runner import MAX_BIAS_PER_ROW, Candidates, EncodeItem, ModelSpec
from server.core.work import TERM_BEAM_SIZE, DecodeOptions

logger = logging.getLogger(__name__)


class Scheduler:
    """Queue, admission, slots and beams of every request in one engine."""

    def __init__(self, spec: ModelSpec, limits: EngineLimits) -> None:
        if limits.max_slots < 1 or limits.max_queue_sentences < 1 or limits.max_encode_tokens < 1:
            raise ValueError(f"every limit must be >= 1, got {limits}")
        self.spec = spec
        self.limits = limits
        # A heap: the lowest free slots go first, so the slots in use stay packed at the low end of the pool
        # (a runner that steps the first rows of its pool, as many as hold every stepped slot, steps fewer).
        self._free: list[int] = list(range(limits.max_slots))
        self._queue: deque[ScheduledSentence] = deque()
        # Running sentences in the order they got slots, by id(): adding and removing one is O(1) (a list's
        # remove() compared dataclasses field by field, quadratic in the rows); and how many run per
        # isolation group, so that admission asks "may this request join?" in O(groups), not O(rows).
        self._running: dict[int, ScheduledSentence] = {}
        self._running_groups: dict[int | None, int] = {}
        self._requests: dict[int, ScheduledRequest] = {}
        self._abandoned: list[Abandoned] = []
        self._groups = itertools.count(1)  # isolation groups' ids
        # What `_expire` must look at, so that an iteration with nothing to expire costs nothing per request:
        # a heap of (deadline, entry, request id), an entry valid while its request is the one that pushed it
        # (`ScheduledRequest.deadline_entry`: ids may come back), and the requests cancelled since the last schedule.
        self._deadlines: list[tuple[float, int, int]] = []
        self._entries = itertools.count(1)
        self._cancelled: list[ScheduledRequest] = []
        self._admitted_at = -math.inf  # when sentences last got slots (`_defers_admission`)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active_slots(self) -> int:
        return self.limits.max_slots - len(self._free)

    @property
    def idle(self) -> bool:
        return not self._requests

    def request_ids(self) -> list[int]:
        return list(self._requests)

    def take_abandoned(self) -> list[Abandoned]:
        """What every failure since the last call left unfinished; the list starts empty again."""
        taken, self._abandoned = self._abandoned, []
        return taken

    def add(
        self,
        request_id: int,
        sentences: list[list[int]],
        options: DecodeOptions,
        deadline: float | None,
        now: float,
        *,
        admitted: bool = False,
    ) -> None:
        """Queue every sentence of a request, or none (QueueFullError). The work is valid
        (`server.core.work`'s checks ran where it came in).

        `admitted`: the caller already counted these sentences against the bound (the engine does, at
        submit). They are then queued even over it: `isolate` may have refilled the queue with running
        sentences meanwhile, and refusing work already promised would leave its caller unanswered.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already scheduled")
        if not admitted and len(self._queue) + len(sentences) > self.limits.max_queue_sentences:
            raise QueueFullError(f"the queue holds {len(self._queue)} of {self.limits.max_queue_sentences} sentences")
        if options.terms and len(options.terms) != len(sentences):
            raise ValueError(f"terms for {len(options.terms)} sentences, {len(sentences)} sentences given")
        request = ScheduledRequest(request_id, options, deadline, pending=len(sentences))
        for index, ids in enumerate(sentences):
            max_len = output_limit(options.max_output_len, len(ids), self.spec.max_target_len)
            beam = self._beam(options, max_len, options.terms[index] if options.terms else ())
            request.sentences.append(ScheduledSentence(request, index, list(ids), beam, enqueued_at=now))
        self._requests[request_id] = request
        self._queue.extend(request.sentences)
        if deadline is not None:
            request.deadline_entry = next(self._entries)
            heapq.heappush(self._deadlines, (deadline, request.deadline_entry, request_id))
            if len(self._deadlines) > 2 * len(self._requests) + 1024:  # finished requests' entries: drop them
                self._deadlines = [entry for entry in self._deadlines if self._is_live_entry(entry)]
                heapq.heapify(self._deadlines)

    def _beam(self, options: DecodeOptions, max_len: int, terms: tuple[tuple[int, ...], ...]) -> BeamState:
        """A sentence's beam: constrained where its source holds glossary terms (then at least TERM_BEAM_SIZE wide) or
        the model bans words."""
        spec = self.spec
        if not any(terms) and not spec.banned_words:
            return BeamState(
                options.beam_size, max_len, options.length_penalty, spec.eos_id, spec.forced_eos,
                patient=spec.patient_beam, forced_first=options.forced_first,
            )  # fmt: skip
        width = max(options.beam_size, min(TERM_BEAM_SIZE, self.limits.max_slots)) if any(terms) else options.beam_size
        return ConstrainedBeam(
            width, max_len, options.length_penalty, spec.eos_id, spec.forced_eos, patient=spec.patient_beam,
            forced_first=options.forced_first, constraints=Constraints.of(terms), bias_limit=MAX_BIAS_PER_ROW,
            banned_words=spec.banned_words,
        )  # fmt: skip

    def cancel(self, request_id: int, reason: FailureReason = FailureReason.CANCELLED) -> None:
        """Mark a request cancelled; it fails with `reason` at the next `schedule` (a no-op for finished requests)."""
        request = self._requests.get(request_id)
        if request is not None:
            request.cancelled = reason
            self._cancelled.append(request)

    def schedule(self, now: float) -> Batch:
        """Expire, admit, and list this iteration's rows."""
        batch = Batch()
        self._expire(now, batch)
        self._admit(now, batch)
        for sentence in self._running.values():
            self._add_rows(sentence, batch)
        batch.bias = row_bias(batch.biases, len(batch.slots))
        return batch

    def update(
        self, batch: Batch, candidates: Candidates, encode_window: tuple[float, float] | None = None
    ) -> list[tuple[int, Event]]:
        """Advance every stepped sentence with its rows' ranked candidates (B, k); return the events.

        `encode_window`: when the batch's encoder call began and ended, on the clock of `add`'s `now`.
        """
        expected = batch.candidate_shape(self.spec.vocab_size)
        if candidates.scores.shape != expected or candidates.ids.shape != expected:
            raise ValueError(
                f"expected candidates of shape {expected}, got scores {candidates.scores.shape}"
                f" and ids {candidates.ids.shape}"
            )
        if encode_window is not None:
            start, end = encode_window
            for sentence in batch.encoding:
                sentence.encoded_s = (start - sentence.enqueued_at, end - sentence.enqueued_at)
        events: list[tuple[int, Event]] = []
        # A numeric fault of one input (an fp16 overflow) spoils only that input's rows. LogSoftmax turns
        # one NaN logit into a whole NaN row, so a faulty row's best candidate is NaN whatever TopK's NaN order.
        # An id outside the vocabulary (a runner bug) is checked here too: the beam's flat (row, token)
        # index would read it as another row's token, or a negative parent, and decode on silently.
        ids = np.asarray(candidates.ids)
        out_of_vocab = (ids < 0) | (ids >= self.spec.vocab_size)
        bad_rows: list[bool] = np.asarray(np.isnan(candidates.scores).any(axis=1) | out_of_vocab.any(axis=1)).tolist()
        # Greedy sentences advance from their row's best candidate in plain Python, beams from their rows'
        # candidates merged for all of them in one sort: no numpy call per sentence.
        best_scores, best_ids = candidates.scores[:, 0].tolist(), ids[:, 0].tolist()
        beams = [
            g
            for g in batch.groups
            if g.sentence.beam.beam_size > 1 and not isinstance(g.sentence.beam, ConstrainedBeam)
        ]
        spans = [(g.start, g.rows, g.sentence.beam.candidates_needed) for g in beams]
        ranked = merge_candidates_of(candidates.scores, ids, self.spec.vocab_size, spans)
        merged = dict(zip(map(id, beams), ranked, strict=True))
        requests, vocab = self._requests, self.spec.vocab_size
        for group in batch.groups:
            request, start = group.sentence.request, group.start
            if request.request_id not in requests:  # failed by bad rows of another of its sentences
                continue
            if bad_rows[start] if group.rows == 1 else any(bad_rows[start : start + group.rows]):
                logger.error(
                    "the runner returned NaN scores or ids outside the vocabulary for request %d; failing it",
                    request.request_id,
                )
                events += self.fail({request.request_id}, FailureReason.INTERNAL, INTERNAL_MESSAGE)
                continue
            try:
                beam = group.sentence.beam
                if isinstance(beam, ConstrainedBeam):
                    move = _advance_constrained(beam, group, batch, candidates, vocab)
                elif beam.beam_size == 1:
                    move = beam.advance_greedy(best_scores[start], best_ids[start], vocab)
                else:
                    move = beam.advance_merged(*merged[id(group)], vocab)
            except Exception:  # a bug seen through one request's rows (a bad id): it fails that request alone
                logger.exception("advancing request %d's beam failed; failing it", request.request_id)
                events += self.fail({request.request_id}, FailureReason.INTERNAL, INTERNAL_MESSAGE)
                continue
            self._advance(group.sentence, move, events)
        return events

    def fail(self, request_ids: set[int], reason: FailureReason, message: str) -> list[tuple[int, Event]]:
        """Fail whole requests now (a runner error, shutdown): free their slots, drop their queued sentences."""
        events: list[tuple[int, Event]] = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                self._abandoned.append(_unfinished_of(request, reason))
                self._abort(request)
                events.append((request_id, RequestFailed(reason, message)))
        return events

    def isolate(self, request_ids: set[int], reason: FailureReason, message: str) -> list[tuple[int, Event]]:
        """A runner call raised for these requests: find the one at fault instead of failing them all.

        One request alone in the call is the cause: it fails. Several: each restarts its unfinished
        sentences from scratch (slots freed, beams reset; greedy streams resend their tokens) at the
        head of the queue, split into two groups that never share a runner call (with each other or
        anyone else). A group whose call raises again is split again, so the request at fault is
        found in about log2(n) reruns while the others go on in batches, not one at a time.
        """
        requests = [self._requests[r] for r in sorted(request_ids) if r in self._requests]
        if len(requests) <= 1:
            return self.fail(request_ids, reason, message)
        restarted: list[ScheduledSentence] = []
        half = len(requests) // 2
        for members in (requests[:half], requests[half:]):
            group = next(self._groups)
            for request in members:
                request.group = group
                restarted += [self._restart(s) for s in request.sentences if not s.done]
        ids = {r.request_id for r in requests}
        others = [s for s in self._queue if s.request.request_id not in ids]
        self._queue = deque([*restarted, *others])  # may exceed the bound by these sentences, once
        return []

    def _restart(self, sentence: ScheduledSentence) -> ScheduledSentence:
        self._release(sentence)
        sentence.beam = sentence.beam.fresh()
        sentence.feed = []
        return sentence

    def _is_live_entry(self, entry: tuple[float, int, int]) -> bool:
        """Whether a deadline entry is still its request's (not one left by a request that has finished)."""
        request = self._requests.get(entry[2])
        return request is not None and request.deadline_entry == entry[1]

    def _expire(self, now: float, batch: Batch) -> None:
        due = {r.request_id for r in self._cancelled if self._requests.get(r.request_id) is r}
        self._cancelled = []
        while self._deadlines and self._deadlines[0][0] <= now:
            entry = heapq.heappop(self._deadlines)
            if self._is_live_entry(entry):
                due.add(entry[2])
        if not due:
            return
        for request in [r for i, r in self._requests.items() if i in due]:  # in the order they came
            passed = request.deadline is not None and now >= request.deadline
            if passed or request.cancelled is FailureReason.DEADLINE_EXCEEDED:
                message = "the deadline passed before the translation finished"
                batch.events += self.fail({request.request_id}, FailureReason.DEADLINE_EXCEEDED, message)
            elif request.cancelled is not None:
                batch.events += self.fail({request.request_id}, request.cancelled, "the request was cancelled")

    def _admit(self, now: float, batch: Batch) -> None:
        """Strict FIFO: the head waits for K free slots, so wide beams are never starved by narrow ones."""
        if self._defers_admission(now):
            return
        budget = self.limits.max_encode_tokens
        while self._queue:
            head = self._queue[0]
            k = head.beam.beam_size
            over_budget = len(head.source_ids) > budget and batch.encode  # one source always fits an empty batch
            if k > len(self._free) or over_budget or not self._may_join(head.request):
                break
            self._queue.popleft()
            head.slots = [heapq.heappop(self._free) for _ in range(k)]
            head.feed = [self.spec.bos_id]
            head.running = True
            head.running_group = head.request.group
            self._running[id(head)] = head
            self._running_groups[head.running_group] = self._running_groups.get(head.running_group, 0) + 1
            batch.encode.append(EncodeItem(head.source_ids, list(head.slots)))
            batch.encoding.append(head)
            if not head.waited:
                head.queue_wait_s = now - head.enqueued_at
                batch.queue_waits.append(head.queue_wait_s)
                head.waited = True
            budget -= len(head.source_ids)
            self._admitted_at = now

    def _defers_admission(self, now: float) -> bool:
        """Whether the queue waits a step so that its sentences share one encoder call with later arrivals
        (`EngineLimits.admission_wait_s`): only while rows decode (an idle engine admits at once), within the
        wait since the last admission (so an engine admits at least that often, and a lone arrival to an engine
        that admitted nobody lately joins at once), and while the rows the queue could bring now, in order into
        the free slots, are fewer than admission_ratio x the decoding rows. text-generation-inference's router
        holds prefills back by the same rule, counted in decoder steps since the last prefill: its
        waiting_served_ratio and max_waiting_tokens."""
        limits = self.limits
        if not limits.admission_wait_s or not self._queue or not self._running:
            return False
        if now - self._admitted_at >= limits.admission_wait_s:
            return False
        free = len(self._free)
        wanted = limits.admission_ratio * (limits.max_slots - free)
        rows = 0
        for sentence in self._queue:
            rows += sentence.beam.beam_size
            if rows > free:
                return True
            if rows >= wanted:
                return False
        return True

    def _may_join(self, request: ScheduledRequest) -> bool:
        """Requests of an isolation group share runner calls only with each other, so that a failure
        of their call is theirs; the others (group None) share with any but a group's."""
        # The request's own running sentences are in its group, so counting them changes nothing.
        return all(group == request.group for group in self._running_groups)

    def _add_rows(self, sentence: ScheduledSentence, batch: Batch) -> None:
        if sentence.planned_copies:
            for source, destination in sentence.planned_copies:
                batch.copy_sources.append(source)
                batch.copy_destinations.append(destination)
            sentence.planned_copies = []
        beam, feed = sentence.beam, sentence.feed
        rows = len(feed)
        if isinstance(beam, ConstrainedBeam):
            for offset, bias in enumerate(beam.row_biases()):
                batch.biases[len(batch.slots) + offset] = bias
        batch.groups.append(RowGroup(sentence, len(batch.slots), rows))
        if rows == 1:  # greedy, and every sentence's first step
            batch.slots.append(sentence.slots[0])
            batch.tokens.append(feed[0])
            batch.positions.append(beam.steps)
            batch.row_scores.append(beam.live[0][1])
        else:
            batch.slots += sentence.slots[:rows]
            batch.tokens += feed
            batch.positions += [beam.steps] * rows  # every live row is at the sentence's position
            batch.row_scores += [score for _, score in beam.live]
        if beam.beam_size > batch.widest_beam:
            batch.widest_beam = beam.beam_size
            batch.top_k = max(batch.top_k, beam.candidates_needed)

    def _advance(self, sentence: ScheduledSentence, move: Advance, events: list[tuple[int, Event]]) -> None:
        request = sentence.request
        if move.done:
            self._release(sentence)
            sentence.done = True
            hypotheses = sentence.beam.best(request.options.num_hypotheses)
            done = SentenceDone(
                sentence.index, hypotheses, len(sentence.source_ids), sentence.queue_wait_s, sentence.encoded_s
            )
            events.append((request.request_id, done))
            request.pending -= 1
            if request.pending == 0:
                del self._requests[request.request_id]
                events.append((request.request_id, RequestDone()))
            return
        if move.parents != [0]:  # one row continuing itself (greedy) keeps its slot: nothing to reorder
            sentence.slots, sentence.planned_copies = reorder_slots(sentence.slots, move.parents)
        sentence.feed = move.tokens
        if request.options.stream_tokens and sentence.beam.beam_size == 1:
            events.append((request.request_id, TokensEvent(sentence.index, sentence.beam.live[0][0])))

    def _release(self, sentence: ScheduledSentence) -> None:
        if sentence.running:
            del self._running[id(sentence)]
            left = self._running_groups[sentence.running_group] - 1
            if left:
                self._running_groups[sentence.running_group] = left
            else:
                del self._running_groups[sentence.running_group]
            for slot in sentence.slots:
                heapq.heappush(self._free, slot)
            sentence.running = False
        sentence.slots, sentence.planned_copies = [], []

    def _abort(self, request: ScheduledRequest) -> None:
        for sentence in request.sentences:
            self._release(sentence)
        self._queue = deque(s for s in self._queue if s.request is not request)
        del self._requests[request.request_id]


def _advance_constrained(
    beam: ConstrainedBeam, group: RowGroup, batch: Batch, candidates: Candidates, vocab: int
) -> Advance:
    """A constrained sentence's move from its rows' candidates and the scores of the ids they asked for."""
    if batch.bias is None or candidates.bias_scores is None:
        raise RuntimeError("a constrained sentence's step returned no bias scores")
    rows = slice(group.start, group.start + group.rows)
    return beam.advance_constrained(
        candidates.scores[rows], candidates.ids[rows], batch.bias.ids[rows], candidates.bias_scores[rows], vocab
    )


def _unfinished_of(request: ScheduledRequest, reason: FailureReason) -> Abandoned:
    unfinished = [s for s in request.sentences if not s.done]
    queued = sum(not s.waited for s in unfinished)
    return Abandoned(request.request_id, reason, queued=queued, decoding=len(unfinished) - queued)


def output_limit(requested: int, source_len: int, max_target_len: int) -> int:
    """Most tokens a sentence may generate: the request's `max_output_len`, or when that is 0 the
    source-relative default (`model.config.default_output_limit`); never over the model's limit."""
    return min(requested, max_target_len) if requested else default_output_limit(source_len, max_target_len)
