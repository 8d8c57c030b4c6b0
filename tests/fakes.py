"""A deterministic numpy runner for scheduler and engine tests, and a collector of engine events.

The log-probabilities of a row depend only on its slot's source ids and the tokens that slot has
fed, never on the other rows of the call: so any result that changes with batch composition, or
any wrong beam reordering (a row reading another hypothesis's history), changes the output and
is caught by comparing against `reference_decode`, which recomputes every hypothesis from its own
history without slots. Every slot invariant is checked and violated ones raise `SlotError`.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from model.directions import Directions
from server.core.batch import Batch
from server.core.beam import BeamState, Hypothesis, row_candidates
from server.core.events import Event, RequestDone, RequestFailed, SentenceDone
from server.core.offline import execute as run_batch
from server.core.runner import Candidates, EncodeItem, ModelSpec, RowBias

FAKE_SPEC = ModelSpec(
    vocab_size=24,
    max_source_len=16,
    max_target_len=12,
    bos_id=2,
    eos_id=3,
    pad_id=0,
    tag_ids={"en": 4, "de": 5},
    directions=Directions.of_pairs((("de", "en"), ("en", "de"))),
    source_vocab_size=24,
)


class SlotError(AssertionError):
    """The engine broke a runner contract (stepped an empty slot, skipped a position, ...)."""


class InjectedFailure(RuntimeError):
    """Raised by FakeRunner on request, to test how the engine survives a runner error."""


def fake_logprobs(source: Sequence[int], fed: Sequence[int], spec: ModelSpec = FAKE_SPEC) -> npt.NDArray[np.float32]:
    """Log-probabilities (V,) after feeding `fed` (BOS first) for `source`: a pure function of both.

    EOS grows likelier with length so hypotheses end at varied lengths; PAD is never produced.
    """
    key = zlib.crc32(np.asarray([*source, -1, *fed], dtype=np.int64).tobytes())
    logits = np.random.default_rng(key).normal(0.0, 2.0, spec.vocab_size)
    logits[spec.pad_id] = -1e4
    logits[spec.bos_id] = -1e4
    logits[spec.eos_id] += 0.8 * (len(fed) - len(source) / 2)
    shifted = logits - logits.max()
    return (shifted - np.log(np.exp(shifted).sum())).astype(np.float32)


def ranked(logprobs: npt.NDArray[np.float32], row_scores: Sequence[float], k: int, bias: RowBias | None) -> Candidates:
    """A step's candidates from its (B, V) log-probabilities, as a runner returns them (`row_candidates`)."""
    if bias is None:
        return Candidates(*row_candidates(logprobs, np.asarray(row_scores, np.float32), k))
    return Candidates(*row_candidates(logprobs, np.asarray(row_scores, np.float32), k, bias))


def reference_decode(
    source: Sequence[int], beam_size: int, length_penalty: float, max_len: int, spec: ModelSpec = FAKE_SPEC
) -> list[Hypothesis]:
    """One sentence alone, each hypothesis's log-probs computed from its own tokens: the expected output."""
    beam = BeamState(beam_size, min(max_len, spec.max_target_len), length_penalty, spec.eos_id)
    while True:
        rows = np.stack([fake_logprobs(source, (spec.bos_id, *tokens), spec) for tokens, _ in beam.live])
        if beam.advance(rows).done:
            return beam.best(beam_size)


@dataclass
class _Slot:
    source: tuple[int, ...] | None = None  # None: never encoded, or freed by a reset
    fed: list[int] = field(default_factory=list)


class FakeRunner:
    """Implements server.core.runner.Runner over `max_slots` slots of plain Python state."""

    def __init__(self, max_slots: int = 8, spec: ModelSpec = FAKE_SPEC) -> None:
        self.spec = spec
        self.max_slots = max_slots
        self.slots = [_Slot() for _ in range(max_slots)]
        self.fail_on_step: int | None = None  # raise InjectedFailure on this step call (0-based)
        self.step_calls = 0
        self.step_batch_sizes: list[int] = []
        self.encode_calls: list[list[EncodeItem]] = []
        self.copies = 0  # slot copies made, to check beams copy little

    def encode(self, items: list[EncodeItem]) -> None:
        taken = [s for item in items for s in item.slots]
        self._check_slots(taken)
        if len(set(taken)) != len(taken):
            raise SlotError(f"encode writes a slot twice: {taken}")
        for item in items:
            if not 1 <= len(item.source_ids) <= self.spec.max_source_len:
                raise SlotError(f"source length {len(item.source_ids)} is out of range")
            for s in item.slots:
                self.slots[s] = _Slot(tuple(item.source_ids))
        self.encode_calls.append(list(items))

    def step(
        self, slots: list[int], tokens: list[int], positions: list[int], row_scores: list[float], k: int,
        bias: RowBias | None = None,
    ) -> Candidates:  # fmt: skip
        """Ranked as the runner contract says (`server.core.beam.row_candidates`), from `step_log_probs`."""
        return ranked(self.step_log_probs(slots, tokens, positions), row_scores, k, bias)

    def step_log_probs(self, slots: list[int], tokens: list[int], positions: list[int]) -> npt.NDArray[np.float32]:
        call = self.step_calls
        self.step_calls += 1
        if self.fail_on_step == call:
            raise InjectedFailure(f"injected failure on step call {call}")
        self._check_step(slots, tokens, positions)
        rows = []
        for s, token in zip(slots, tokens, strict=True):
            slot = self.slots[s]
            slot.fed.append(token)
            assert slot.source is not None  # checked above
            rows.append(fake_logprobs(slot.source, slot.fed, self.spec))
        self.step_batch_sizes.append(len(slots))
        return np.stack(rows)

    def copy_slots(self, sources: list[int], destinations: list[int]) -> None:
        self._check_slots([*sources, *destinations])
        if len(sources) != len(destinations) or len(set(destinations)) != len(destinations):
            raise SlotError(f"bad copy: {sources} -> {destinations}")
        snapshot = [_Slot(self.slots[s].source, list(self.slots[s].fed)) for s in sources]
        for destination, slot in zip(destinations, snapshot, strict=True):
            self.slots[destination] = slot
        self.copies += len(sources)

    def _check_slots(self, slots: list[int]) -> None:
        bad = [s for s in slots if not 0 <= s < self.max_slots]
        if bad:
            raise SlotError(f"slots {bad} are outside 0 .. {self.max_slots - 1}")

    def _check_step(self, slots: list[int], tokens: list[int], positions: list[int]) -> None:
        self._check_slots(slots)
        if not len(slots) == len(tokens) == len(positions) or not slots:
            raise SlotError(f"step needs equal non-empty lists, got {len(slots)}, {len(tokens)}, {len(positions)}")
        if len(set(slots)) != len(slots):
            raise SlotError(f"a slot is stepped twice in one call: {slots}")
        for s, token, position in zip(slots, tokens, positions, strict=True):
            slot = self.slots[s]
            if slot.source is None:
                raise SlotError(f"slot {s} is stepped but was never encoded")
            if position != len(slot.fed):
                raise SlotError(f"slot {s} fed {len(slot.fed)} tokens but is stepped at position {position}")
            if position >= self.spec.max_target_len:
                raise SlotError(f"slot {s} is stepped past max_target_len at position {position}")
            if (position == 0) != (token == self.spec.bos_id):
                raise SlotError(f"slot {s} feeds token {token} at position {position}: BOS must come first, once")
            if not 0 <= token < self.spec.vocab_size or token == self.spec.eos_id:
                raise SlotError(f"slot {s} feeds invalid token {token}")


WAIT_S = 30.0  # how long a test waits for the engine before it calls the engine stuck


class Collector:
    """Gathers one request's events; `wait` blocks until the final one."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.finished = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, RequestDone | RequestFailed):
            self.finished.set()

    def wait(self) -> Event:
        assert self.finished.wait(WAIT_S), f"no final event after {WAIT_S} s: {self.events}"
        return self.events[-1]

    def hypotheses(self) -> dict[int, list[tuple[tuple[int, ...], float]]]:
        return {
            e.sentence_index: [(h.tokens, h.score) for h in e.hypotheses]
            for e in self.events
            if isinstance(e, SentenceDone)
        }


def execute(runner: FakeRunner, batch: Batch) -> Candidates:
    """What the engine does with a scheduled batch (server.core.offline.execute), candidates only."""
    return run_batch(runner, batch)[0]
