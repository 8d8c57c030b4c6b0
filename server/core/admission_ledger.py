"""The queue places admitted calls hold before they submit: `Engine` and the server's side of an engine process
(`server.processes.engine_process`) both keep an `AdmissionLedger` and admit and accept work by its rules."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from server.core.events import ENGINE_FAILED_MESSAGE, DrainingError, EngineFailedError, QueueFullError


@dataclass
class Admission:
    """A call's place in the engine, taken by `Engine.admission` before its request is split and tokenized."""

    sentences: int  # queue places it holds until it submits (or ends without submitting)


class AdmissionLedger:
    """The queue places admitted calls hold before they submit, and the rules an engine admits and accepts
    work by: `Engine` and the server's side of an engine process (`server.processes.engine_process`) both keep
    one. Every method runs under its owner's lock; `queued` is the owner's count of sentences waiting."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # most sentences waiting or held
        self.reserved_sentences = 0  # places held by admitted calls that have not submitted yet
        self.admitted_calls = 0  # calls inside admission(): drain waits for them

    def reserve(self, sentences: int, queued: int, failed: bool, draining: bool) -> Admission:
        """Hold `sentences` places for a call, or refuse it (see `Engine.admission`)."""
        if failed:
            raise EngineFailedError(ENGINE_FAILED_MESSAGE)
        if draining:
            raise DrainingError("the engine is draining and admits no new requests")
        waiting = queued + self.reserved_sentences
        if waiting + sentences > self.limit:
            raise QueueFullError(f"{waiting} of {self.limit} queue places are taken or held")
        self.reserved_sentences += sentences
        self.admitted_calls += 1
        return Admission(sentences)

    def release(self, admission: Admission) -> None:
        """The call has ended: free what it still holds (nothing once it submitted)."""
        self.reserved_sentences -= admission.sentences
        self.admitted_calls -= 1

    @contextmanager
    def held(self, cond: threading.Condition, reserve: Callable[[], Admission]) -> Iterator[Admission]:
        """The owner's `admission()`: `reserve` runs under the owner's `cond`; the call's places are released
        under it when the call ends, waking a drain that waits for admitted calls."""
        with cond:
            admission = reserve()
        try:
            yield admission
        finally:
            with cond:
                self.release(admission)
                cond.notify_all()

    def accept(
        self, sentences: int, queued: int, failed: bool, stopping: bool, draining: bool, admitted: Admission | None
    ) -> None:
        """Accept a request of `sentences` for the queue, or refuse it; an admitted call's own places are free
        to it, and become its queued sentences."""
        if failed:
            raise EngineFailedError(ENGINE_FAILED_MESSAGE)
        if stopping or (draining and admitted is None):
            raise DrainingError("the engine is draining and admits no new requests")
        held = 0 if admitted is None else admitted.sentences
        if queued + self.reserved_sentences - held + sentences > self.limit:
            raise QueueFullError(f"the queue holds {queued} of {self.limit} sentences")
        if admitted is not None:
            self.reserved_sentences -= held
            admitted.sentences = 0
