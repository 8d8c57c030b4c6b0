"""What the scheduler hands the runner each iteration (`Batch`), the scheduled requests and sentences its rows
belong to, and how a beam step's new rows take their sentence's slots (`reorder_slots`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from server.core.beam import BeamState
from server.core.events import Event, FailureReason
from server.core.observer import StepStats
from server.core.runner import EncodeItem, RowBias
from server.core.work import DecodeOptions


@dataclass
class ScheduledRequest:
    """A request the scheduler holds: its sentences, deadline and cancellation."""

    request_id: int
    options: DecodeOptions
    deadline: float | None  # time.monotonic() based
    pending: int  # sentences not yet done
    sentences: list[ScheduledSentence] = field(default_factory=list)
    cancelled: FailureReason | None = None  # CANCELLED, or DEADLINE_EXCEEDED when the caller's deadline cancelled it
    group: int | None = None  # after a shared runner call raised: shares calls only with its group (`isolate`)
    deadline_entry: int = 0  # its entry in the scheduler's deadline heap


@dataclass
class ScheduledSentence:
    """One source sentence of a request: its beam, its slots while it runs, and what its rows feed next."""

    request: ScheduledRequest
    index: int  # in its request
    source_ids: list[int]
    beam: BeamState
    enqueued_at: float
    waited: bool = False  # it got slots once: its queue wait was reported (a rerun after isolate() reports none)
    queue_wait_s: float = 0.0  # seconds from enqueued_at to its first slots
    encoded_s: tuple[float, float] = (0.0, 0.0)  # its last encoder call's start and end, seconds after enqueued_at
    slots: list[int] = field(default_factory=list)  # all K reserved slots; slots[i] holds live row i
    planned_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) before next step
    feed: list[int] = field(default_factory=list)  # token each live row feeds next
    running: bool = False
    running_group: int | None = None  # its request's isolation group when it got its slots
    done: bool = False  # its SentenceDone was sent

    @property
    def position(self) -> int:
        return self.beam.steps  # every live row of a sentence is at the same position


class RowGroup(NamedTuple):
    """The rows of one sentence in a step call: `Batch.slots[start:start + rows]` (a tuple: one is made per
    sentence and step)."""

    sentence: ScheduledSentence
    start: int
    rows: int


@dataclass
class Batch:
    """One iteration's work for the runner, in order: copy_slots, encode, step."""

    copy_sources: list[int] = field(default_factory=list)
    copy_destinations: list[int] = field(default_factory=list)
    encode: list[EncodeItem] = field(default_factory=list)
    encoding: list[ScheduledSentence] = field(default_factory=list)  # the sentence of each encode item
    slots: list[int] = field(default_factory=list)  # rows to step, grouped by sentence
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    row_scores: list[float] = field(default_factory=list)  # each row's hypothesis score, added to its log-probs
    top_k: int = 1  # candidates per row the step must rank: the most any sentence in the batch needs
    widest_beam: int = 0  # the widest beam among its sentences, whose needs set top_k
    groups: list[RowGroup] = field(default_factory=list)
    events: list[tuple[int, Event]] = field(default_factory=list)  # (request id, event) found while scheduling
    queue_waits: list[float] = field(default_factory=list)  # seconds each admitted sentence waited
    biases: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)  # row -> (ids, values) it biases
    bias: RowBias | None = None  # `biases` as the runner takes them; None where no row has any

    @property
    def empty(self) -> bool:
        return not self.slots

    def candidate_shape(self, vocab_size: int) -> tuple[int, int]:
        """(B, k) of the candidates the step must return: k is capped at the vocabulary."""
        return len(self.slots), min(self.top_k, vocab_size)

    def request_ids(self) -> set[int]:
        return {g.sentence.request.request_id for g in self.groups}

    def stats(self, step_s: float, encode_s: float) -> StepStats:
        """What the observer sees of this iteration, once its runner calls took `step_s` and `encode_s`."""
        sources = [len(item.source_ids) for item in self.encode]
        spans = [p + 1 for p in self.positions]
        return StepStats(
            duration_s=step_s,
            encode_duration_s=encode_s,
            active_slots=len(self.slots),
            encode_real_tokens=sum(sources),
            encode_padded_tokens=len(sources) * max(sources, default=0),
            step_real_tokens=sum(spans),
            step_padded_tokens=len(spans) * max(spans, default=0),
            queue_waits_s=tuple(self.queue_waits),
        )


def reorder_slots(slots: list[int], parents: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Assign new live rows to a sentence's slots after a beam step, copying as little as possible.

    `slots[i]` holds old row i (the tail past the old live rows is spare). New row j continues old
    row `parents[j]`: the first new row of each parent keeps the parent's slot in place; any other
    takes a slot no new row keeps and gets a copy of its parent's slot. Copy sources are kept slots
    and destinations are not, so the copies never read a slot they overwrite.
    Returns (new slot order: new row j in slot j, then spares; copies as (source, destination)).
    """
    if parents == [0]:  # greedy (and a beam down to one live row): the row keeps its slot, nothing moves
        return list(slots), []
    kept: dict[int, int] = {}  # parent row -> new row that keeps its slot
    for row, parent in enumerate(parents):
        kept.setdefault(parent, row)
    spare = [slot for old_row, slot in enumerate(slots) if old_row not in kept]
    spare.reverse()  # pop() then hands them out in order
    order: list[int] = []
    copies: list[tuple[int, int]] = []
    for row, parent in enumerate(parents):
        if kept[parent] == row:
            order.append(slots[parent])
        else:
            destination = spare.pop()
            copies.append((slots[parent], destination))
            order.append(destination)
    order.extend(reversed(spare))
    return order, copies


def row_bias(biases: dict[int, tuple[list[int], list[float]]], rows: int) -> RowBias | None:
    """The rows' biases as (rows, J) arrays, J the most any row has, padded with id 0 and value 0 (which changes
    no score); None where no row has any."""
    if not biases:
        return None
    width = max(1, max(len(ids) for ids, _ in biases.values()))
    ids = np.zeros((rows, width), dtype=np.int64)
    values = np.zeros((rows, width), dtype=np.float32)
    for row, (row_ids, row_values) in biases.items():
        ids[row, : len(row_ids)] = row_ids
        values[row, : len(row_values)] = row_values
    return RowBias(ids, values)
