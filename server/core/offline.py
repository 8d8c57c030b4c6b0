"""Offline decoding over the server's own Scheduler (no engine thread, no grpc): what the BLEU gate, parity
and the benchmark's ONNX engine run, so that they measure the code that serves."""

from __future__ import annotations

import time
from dataclasses import dataclass

from server.core.batch import Batch
from server.core.beam import Hypothesis
from server.core.events import EngineLimits, RequestFailed, SentenceDone
from server.core.runner import Candidates, Runner
from server.core.scheduler import Scheduler
from server.core.work import DecodeOptions, check_options, check_sources


class OfflineDecodingError(RuntimeError):
    """The scheduler failed the sources (a runner fault seen in its output)."""


@dataclass(frozen=True)
class RunnerTimes:
    """Wall times of one iteration's runner calls."""

    step_s: float  # beam-row copies and the decoder step together
    encode_window: tuple[float, float] | None  # time.monotonic() start and end of the encoder call; None: no call

    @property
    def encode_s(self) -> float:
        return 0.0 if self.encode_window is None else self.encode_window[1] - self.encode_window[0]


def execute(runner: Runner, batch: Batch) -> tuple[Candidates, RunnerTimes]:
    """One iteration's runner calls in the order the batch requires: beam-row copies, encoding, the decoder
    step; with their wall times. The engine runs this too."""
    # Durations by perf_counter; the encoder's window also on the clock submissions are stamped with (monotonic).
    started = time.perf_counter()
    if batch.copy_sources:
        runner.copy_slots(batch.copy_sources, batch.copy_destinations)
    encode_window, encode_s = None, 0.0
    if batch.encode:
        encode_started, encode_at = time.perf_counter(), time.monotonic()
        runner.encode(batch.encode)
        encode_s = time.perf_counter() - encode_started
        encode_window = (encode_at, encode_at + encode_s)
    candidates = runner.step(batch.slots, batch.tokens, batch.positions, batch.row_scores, batch.top_k, batch.bias)
    times = RunnerTimes(time.perf_counter() - started - encode_s, encode_window)
    expected = batch.candidate_shape(runner.spec.vocab_size)
    if candidates.scores.shape != expected or candidates.ids.shape != expected:
        raise RuntimeError(
            f"runner returned candidates of shapes {candidates.scores.shape} and {candidates.ids.shape},"
            f" expected {expected}"
        )
    return candidates, times


def translate_ids(
    runner: Runner,
    sources: list[list[int]],
    beam_size: int,
    length_penalty: float,
    max_len: int | None,
    num_hypotheses: int = 1,
    forced_first: int | None = None,
    terms: tuple[tuple[tuple[int, ...], ...], ...] = (),
) -> list[list[Hypothesis]]:
    """Each source's `num_hypotheses` best hypotheses, decoded as the server decodes them: one request
    through a Scheduler over the runner's slots, continuously batched.

    `max_len` caps generated tokens; None gives each source the server's default (`output_limit`).
    `forced_first`: the first generated token of every source (DecodeOptions'); `terms`: per source, the target
    ids its output must contain (DecodeOptions').
    """
    if not sources:
        return []
    limits = EngineLimits(max_slots=runner.max_slots, max_queue_sentences=len(sources))
    scheduler = Scheduler(runner.spec, limits)
    options = DecodeOptions(
        beam_size=beam_size, length_penalty=length_penalty, max_output_len=max_len or 0, num_hypotheses=num_hypotheses,
        forced_first=forced_first, terms=terms,
    )  # fmt: skip
    check_options(options, runner.max_slots, runner.spec.max_target_len)  # the rules the edge applies
    check_sources(sources, runner.spec)
    scheduler.add(0, sources, options, deadline=None, now=0.0)
    results: dict[int, list[Hypothesis]] = {}
    while not scheduler.idle:
        batch = scheduler.schedule(now=0.0)
        events = list(batch.events)
        if not batch.empty:
            events += scheduler.update(batch, execute(runner, batch)[0])
        for _, event in events:
            if isinstance(event, SentenceDone):
                results[event.sentence_index] = event.hypotheses
            elif isinstance(event, RequestFailed):
                raise OfflineDecodingError(event.message)
    return [results[index] for index in range(len(sources))]
