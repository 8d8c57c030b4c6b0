"""The decode loop: schedule -> runner (copy_slots, encode, step) -> scheduler.update -> deliver events.

One engine thread owns the runner and the scheduler. Other threads only `submit` and `cancel`: they
validate, drop the work in an inbox under a lock held for microseconds, and wake the loop, which
sleeps on a condition variable while there is no work. So a submitter (the servicer's event loop)
never waits behind a decoder step or a beam update. Callbacks run on the engine thread and must be
cheap (the servicer hands events to its asyncio loop).

Faults: a runner error fails only the request that causes it (`Scheduler.isolate`); a bug in an
iteration fails the requests in flight and the loop carries on; should the loop itself die, every
waiting request is failed UNAVAILABLE, new ones are refused, and `on_failure` tells the server
(which turns NOT_SERVING), so no client waits on a thread that is gone. A loop stuck in a runner
call (a wedged GPU kernel, a deadlock) cannot be interrupted, only left behind: `abandon_if_stalled`
answers everything it held the same way, and should the call ever return, the thread leaves at
once without touching what it no longer owns.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from server.core.admission_ledger import Admission, AdmissionLedger
from server.core.batch import Batch
from server.core.deliveries import Owner, Owners, notify
from server.core.events import (
    ENGINE_FAILED_MESSAGE,
    INTERNAL_MESSAGE,
    SHUTDOWN_MESSAGE,
    EngineLimits,
    Event,
    FailureReason,
    RequestDone,
    RequestFailed,
)
from server.core.observer import EngineObserver
from server.core.offline import RunnerTimes, execute
from server.core.runner import Candidates, Runner
from server.core.scheduler import Scheduler
from server.core.work import DecodeOptions

logger = logging.getLogger(__name__)

WARMUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class _Submission:
    """A request waiting in the inbox for the engine thread to hand it to the scheduler."""

    request_id: int
    sentences: list[list[int]]
    options: DecodeOptions
    deadline: float | None
    submitted_at: float  # queue wait counts from here
    owner: Owner


class RequestHandle:
    """The submitter's grip on a request."""

    def __init__(self, engine: Engine, request_id: int) -> None:
        self._engine = engine
        self.request_id = request_id

    def cancel(self, deadline_passed: bool = False) -> None:
        """Fail the request at the next iteration, queued or decoding; its slots are freed.

        It fails CANCELLED, or DEADLINE_EXCEEDED when the caller cancels because its deadline passed
        (grpc cancels a call at its deadline, usually before the engine's own check sees it).
        """
        reason = FailureReason.DEADLINE_EXCEEDED if deadline_passed else FailureReason.CANCELLED
        self._engine._cancel(self.request_id, reason)


class _Abandoned(BaseException):  # a control-flow signal, not an error
    """Raised on the engine thread when its runner call returns after the engine gave up on it: past
    every `except Exception`, so the loop leaves without delivering or publishing anything."""


class Engine:
    """Continuous batching over one runner."""

    def __init__(
        self,
        runner: Runner,
        limits: EngineLimits | None = None,
        metrics: EngineObserver | None = None,
        on_failure: Callable[[], None] | None = None,  # called once if the loop dies or is abandoned, on that thread
    ) -> None:
        limits = limits or EngineLimits(max_slots=runner.max_slots)
        if limits.max_slots > runner.max_slots:
            raise ValueError(f"max_slots={limits.max_slots} exceeds the runner's {runner.max_slots} slots")
        self._runner = runner
        self._scheduler = Scheduler(runner.spec, limits)  # engine thread only (any thread once stopped)
        self._owners = Owners()  # engine thread only
        self._moved_sentences = 0  # engine thread only: taken from the inbox, not yet published
        self._metrics = metrics
        self._on_failure = on_failure
        self._ids = itertools.count(1)
        # Guarded by _cond: the hand-over from submitters and the load they may read.
        self._cond = threading.Condition()
        self._inbox: list[_Submission] = []
        self._cancels: dict[int, FailureReason] = {}
        self._inbox_sentences = 0
        self._scheduled_queue = 0  # scheduler's queue depth as of the last iteration
        self._active_slots = 0
        self._idle = True  # nothing in the inbox or the scheduler
        self._draining = False
        self._stopping = False
        self._ledger = AdmissionLedger(limits.max_queue_sentences)
        self._failed = False  # the loop died: nothing is admitted any more
        # When the runner call in progress began (None outside runner calls; the engine thread sets it
        # unlocked, a lone attribute write, and clears it under _cond), and whether the loop was given
        # up while stuck in one (under _cond; its thread must then never be joined).
        self._runner_call_started: float | None = None
        self._abandoned = False
        self._thread: threading.Thread | None = None
        if metrics is not None:
            metrics.set_capacity(limits.max_slots)
            metrics.set_load(0, 0)

    @property
    def queue_depth(self) -> int:
        """Sentences waiting for slots (an overestimate for at most one iteration, never an underestimate)."""
        with self._cond:
            return self._scheduled_queue + self._inbox_sentences

    @property
    def active_slots(self) -> int:
        with self._cond:
            return self._active_slots

    @property
    def load(self) -> int:
        """Work held: sentences queued or reserved by calls still being prepared, plus the slots in use."""
        with self._cond:
            return self._scheduled_queue + self._inbox_sentences + self._ledger.reserved_sentences + self._active_slots

    @property
    def draining(self) -> bool:
        """True once `drain` (or `stop`) began: only calls admitted before it may still submit."""
        with self._cond:
            return self._draining or self._stopping

    @property
    def failed(self) -> bool:
        """True once the decode loop has died (see the module docstring)."""
        with self._cond:
            return self._failed

    def abandon_if_stalled(self, limit_s: float, now: float) -> float | None:
        """If the runner call in progress began over `limit_s` before `now`, give up on the loop: answer
        everything it holds UNAVAILABLE and refuse new work, as if it had died, and return how long the
        call has run; else None. The daemon thread cannot be interrupted: it ends with the process, or
        leaves on its own should the call return (see `_run_runner`)."""
        with self._cond:
            started = self._runner_call_started
            if self._failed or started is None or now - started <= limit_s:
                return None
            self._abandoned = True  # decided under the lock the engine thread takes when the call returns
        self._die()
        return now - started

    def start(self) -> None:
        """Run the decode loop in its own daemon thread."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._thread = threading.Thread(target=self._loop, name="translation-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        sentences: list[list[int]],
        options: DecodeOptions,
        on_event: Callable[[Event], None],
        deadline: float | None = None,
        lang_pair: str = "",
        *,
        admitted: Admission | None = None,
    ) -> RequestHandle:
        """Queue a request (all its sentences or none); events arrive on `on_event` from the engine thread.

        The work is valid (`server.core.work`'s checks ran at the edge). Raises QueueFullError when the
        queue bound would be exceeded (counting the places other admitted calls hold), DrainingError once
        draining (unless `admitted`: the call's `admission()`, whose places it takes over) or stopped,
        EngineFailedError once the loop has died. `deadline` is `time.monotonic()` based.
        """
        return self._submit(sentences, options, Owner(on_event, lang_pair), deadline, admitted)

    def admission(self, sentences: int = 0) -> AbstractContextManager[Admission]:
        """Admit a call before its request is ready to submit (splitting and tokenizing take time),
        holding `sentences` queue places for it (what it will queue at least) until it submits or ends.

        Admission is decided before any work: a burst the queue cannot take is refused in the time it
        takes to count, and the calls being prepared at once are bounded by the queue, not the burst.
        A call admitted before a drain began may still submit during it, and the drain waits for it:
        a request that arrived before SIGTERM is translated, not refused. Raises QueueFullError when the
        places are not free, DrainingError once draining, EngineFailedError once the loop has died.
        """

        def reserve() -> Admission:  # under the lock
            queued = self._scheduled_queue + self._inbox_sentences
            return self._ledger.reserve(sentences, queued, self._failed, self._draining)

        return self._ledger.held(self._cond, reserve)

    def warmup(self) -> None:
        """Decode a tiny sentence with a beam through the running loop, so every kernel is built before serving.

        Its iterations are not observed: the metrics describe traffic, and a first step that builds
        kernels (or initialises CUDA) would sit in the step histogram of a server nobody has called.
        Call it before any traffic: the metrics are detached while it runs.
        """
        if self._thread is None:
            raise RuntimeError("start() the engine before warmup()")
        metrics, self._metrics = self._metrics, None
        try:
            self._warmup()
        finally:
            self._metrics = metrics

    def _warmup(self) -> None:
        spec = self._runner.spec
        source = [*list(spec.tag_ids.values())[:1], spec.eos_id]
        options = DecodeOptions(beam_size=min(2, self._scheduler.limits.max_slots), max_output_len=4)
        finished = threading.Event()
        outcome: list[Event] = []

        def on_event(event: Event) -> None:
            if isinstance(event, RequestDone | RequestFailed):
                outcome.append(event)
                finished.set()

        self._submit([source], options, Owner(on_event, None), deadline=None)
        if not finished.wait(WARMUP_TIMEOUT_S) or not isinstance(outcome[0], RequestDone):
            raise RuntimeError(f"warmup did not finish: {outcome or 'timed out'}")

    def drain(self, timeout: float) -> bool:
        """Admit nothing new; wait up to `timeout` s for in-flight work; True if all of it finished."""
        with self._cond:
            self._draining = True
            return self._cond.wait_for(lambda: self._idle and not self._ledger.admitted_calls, timeout)

    def stop(self, join_timeout_s: float | None = None) -> None:
        """End the loop after its current iteration and fail what is left with UNAVAILABLE.

        With `join_timeout_s`, a loop still inside a runner call after that long is abandoned (as by
        `abandon_if_stalled`) rather than waited for without end.
        """
        with self._cond:
            self._draining = self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and not self._abandoned:
            self._thread.join(join_timeout_s)
            if self._thread.is_alive():  # the loop did not end within the timeout
                if self.abandon_if_stalled(0.0, time.monotonic()) is not None:  # inside a runner call
                    logger.critical("a runner call outlasted the stop timeout (%.1f s)", join_timeout_s)
                    return
                self._thread.join()  # not in a runner call: it is about to see _stopping
        if self.failed:
            return  # the dying loop answered everything; its scheduler is not to be trusted
        self._take_inbox()  # the loop is gone: this thread owns the scheduler now
        self._fail_all(FailureReason.UNAVAILABLE, SHUTDOWN_MESSAGE)

    def step(self) -> None:
        """One iteration: take new work, schedule, run, update, deliver."""
        self._take_inbox()
        batch = self._scheduler.schedule(time.monotonic())
        self._deliver(batch.events)
        if batch.empty:
            self._publish()
            return
        try:
            candidates, times = self._run_runner(batch)
        except Exception:
            count = len(batch.request_ids())
            logger.exception("runner failed on a batch of %d request(s); a lone request fails, more run apart", count)
            # Not observed as a step (a failed iteration is none; its requests' INTERNAL codes count it),
            # but the queue waits it admitted are: a rerun after isolate() reports none of its own.
            if self._metrics is not None:
                self._metrics.observe_queue_waits(batch.queue_waits)
            events = self._scheduler.isolate(batch.request_ids(), FailureReason.INTERNAL, INTERNAL_MESSAGE)
        else:
            events = self._scheduler.update(batch, candidates, times.encode_window)
            self._observe(batch, times)
        self._deliver(events)
        self._publish()

    def _submit(
        self,
        sentences: list[list[int]],
        options: DecodeOptions,
        owner: Owner,
        deadline: float | None,
        admitted: Admission | None = None,
    ) -> RequestHandle:
        with self._cond:
            queued = self._scheduled_queue + self._inbox_sentences
            self._ledger.accept(len(sentences), queued, self._failed, self._stopping, self._draining, admitted)
            request_id = next(self._ids)
            self._inbox.append(_Submission(request_id, sentences, options, deadline, time.monotonic(), owner))
            self._inbox_sentences += len(sentences)
            self._idle = False
            if self._metrics is not None:
                self._metrics.set_load(queued + len(sentences), self._active_slots)
            self._cond.notify_all()
        return RequestHandle(self, request_id)

    def _cancel(self, request_id: int, reason: FailureReason) -> None:
        with self._cond:
            self._cancels[request_id] = reason
            self._cond.notify_all()

    def _loop(self) -> None:
        try:
            self._iterate_until_stopped()
        except _Abandoned:  # everything was answered by abandon_if_stalled; nothing here is ours any more
            logger.warning("a runner call the engine gave up on has returned; its thread ends")
        except BaseException:  # the recovery below failed too, or worse: no request may wait on a dead thread
            logger.critical("the engine loop died; failing every waiting request UNAVAILABLE", exc_info=True)
            self._die()

    def _iterate_until_stopped(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._inbox or self._cancels or not self._idle)
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a bug, not a runner error: fail loudly but keep serving, losing no request
                logger.exception("engine iteration failed; failing every request in flight")
                self._fail_all(FailureReason.INTERNAL, INTERNAL_MESSAGE)

    def _die(self) -> None:
        """Refuse new work and answer every request the dead (or abandoned) loop held, without its scheduler."""
        with self._cond:
            if self._failed:
                return  # answered once already
            self._failed = self._draining = self._idle = True
            inbox, self._inbox = self._inbox, []
            self._inbox_sentences = self._scheduled_queue = self._active_slots = 0
            # every owner retires: the loop's thread is dead, or will leave without touching them
            owners = [*self._owners.take_all(), *(sub.owner for sub in inbox)]
            self._cond.notify_all()  # wakes drain()
        notify(owners, RequestFailed(FailureReason.UNAVAILABLE, ENGINE_FAILED_MESSAGE))
        if self._metrics is not None:
            self._metrics.set_load(0, 0)
        if self._on_failure is not None:
            try:
                self._on_failure()
            except Exception:
                logger.exception("the engine failure callback raised")

    def _fail_all(self, reason: FailureReason, message: str) -> None:
        """Fail every request still owed an answer: those the scheduler holds, and any it already
        retired in an iteration that raised before delivering its events (a request that finished
        in the same step as another's bug)."""
        events = self._scheduler.fail(set(self._scheduler.request_ids()), reason, message)
        answered = {request_id for request_id, _ in events}
        events += [(rid, RequestFailed(reason, message)) for rid in self._owners.request_ids() if rid not in answered]
        self._deliver(events)
        self._publish()

    def _take_inbox(self) -> None:
        """Hand submitted requests and cancellations to the scheduler (engine thread)."""
        with self._cond:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, {}
        self._moved_sentences = sum(len(sub.sentences) for sub in inbox)
        # Owners first: if an add below raises, the iteration's failure path answers every owner,
        # including the submissions the scheduler never got; none is left waiting on no one.
        for sub in inbox:
            self._owners.add(sub.request_id, sub.owner)
        for sub in inbox:  # admitted at submit: queued even if isolate() has since refilled the queue
            self._scheduler.add(
                sub.request_id, sub.sentences, sub.options, sub.deadline, sub.submitted_at, admitted=True
            )  # fmt: skip
        for request_id, reason in cancels.items():
            self._scheduler.cancel(request_id, reason)

    def _publish(self) -> None:
        """Make the scheduler's load visible to other threads; wake drain() once all work is done."""
        with self._cond:
            self._inbox_sentences -= self._moved_sentences
            self._moved_sentences = 0
            self._scheduled_queue = self._scheduler.queue_depth
            self._active_slots = self._scheduler.active_slots
            self._idle = self._scheduler.idle and not self._inbox
            if self._idle:
                self._cond.notify_all()
            if self._metrics is not None:
                self._metrics.set_load(self._scheduled_queue + self._inbox_sentences, self._active_slots)

    def _run_runner(self, batch: Batch) -> tuple[Candidates, RunnerTimes]:
        """`_execute`, timed for `abandon_if_stalled`; leaves the loop (`_Abandoned`) if it was given up meanwhile."""
        self._runner_call_started = time.monotonic()  # a reader sees None or this: no lock needed to start
        try:
            return self._execute(batch)
        finally:
            with self._cond:
                self._runner_call_started = None
                if self._abandoned:
                    raise _Abandoned  # replaces the call's own outcome: nobody waits for it

    def _execute(self, batch: Batch) -> tuple[Candidates, RunnerTimes]:
        """The runner calls of one iteration (`server.core.offline.execute`, which offline decoding shares),
        timed: the beam update that follows is the engine's own work, not the runner's."""
        return execute(self._runner, batch)

    def _deliver(self, events: list[tuple[int, Event]]) -> None:
        self._owners.deliver(events, self._scheduler.take_abandoned(), self._metrics)

    def _observe(self, batch: Batch, times: RunnerTimes) -> None:
        if self._metrics is not None:
            self._metrics.observe_step(batch.stats(times.step_s, times.encode_s))
