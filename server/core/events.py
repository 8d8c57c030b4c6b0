"""What the engine, its scheduler and their clients share: an engine's limits, the events a request's owner
receives (in order; `RequestDone` and `RequestFailed` are final), why a request failed, and the errors a
submission is refused with. No logic: every layer above the decoding core imports these and nothing more."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from server.core.beam import Hypothesis

INTERNAL_MESSAGE = "internal error while translating"  # the real cause goes to the log, never to the client


class QueueFullError(Exception):
    """The queue bound would be exceeded; nothing was enqueued."""


class DrainingError(Exception):
    """The engine is draining or stopped and admits no new work."""


class FailureReason(enum.Enum):
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(frozen=True)
class EngineLimits:
    """Capacity limits of one engine."""

    max_slots: int = 64  # decoding rows stepped together; at most the runner's pool
    max_queue_sentences: int = 1024  # sentences waiting for slots; a request over the bound is refused whole
    max_encode_tokens: int = 4096  # source tokens encoded per iteration, so admitting a burst never stalls decoding
    # The encoder batched across arrivals: while rows decode, queued sentences join only once they bring at least
    # admission_ratio x the decoding rows, or admission_wait_s has passed since the last admission. Each encoder
    # call has a fixed cost (on a GPU about the same for one sentence as for dozens) and holds up the decoding
    # rows' next step. 0 = admitted at the first step with free slots.
    admission_wait_s: float = 0.0
    admission_ratio: float = 0.3

    def __post_init__(self) -> None:
        if not (0.0 <= self.admission_wait_s < float("inf") and 0.0 <= self.admission_ratio < float("inf")):
            raise ValueError(f"admission_wait_s and admission_ratio must be finite and >= 0, got {self}")


# Events delivered to a request's owner, in order; RequestDone and RequestFailed are final.
@dataclass(frozen=True)
class TokensEvent:
    sentence_index: int  # index of the sentence in the request
    token_ids: tuple[int, ...]  # output so far (greedy); grows by one token per event


@dataclass(frozen=True)
class SentenceDone:
    sentence_index: int
    hypotheses: list[Hypothesis]  # best first, num_hypotheses of them
    input_tokens: int  # source length, tag and EOS included
    queue_wait_s: float = 0.0  # seconds it waited in the queue before it first got slots
    encoded_s: tuple[float, float] = (0.0, 0.0)  # its encoder call's start and end, seconds after it was queued


@dataclass(frozen=True)
class RequestFailed:
    reason: FailureReason
    message: str  # safe to show to the client: never exception text


@dataclass(frozen=True)
class RequestDone:
    pass


@dataclass(frozen=True)
class Abandoned:
    """The unfinished sentences of a failed request, by how far they got: what the metrics count, so a
    queue that times requests out is told apart from decoding that does (queue waits only report
    sentences that got slots)."""

    request_id: int
    reason: FailureReason
    queued: int  # never got slots
    decoding: int  # got slots (a sentence restarted by `isolate` counts here too)


Event = TokensEvent | SentenceDone | RequestFailed | RequestDone


ENGINE_FAILED_MESSAGE = "the translation engine failed; retry on another replica"
SHUTDOWN_MESSAGE = "the server shut down before this request finished; retry on another replica"


class EngineFailedError(Exception):
    """The engine's loop has died; it admits no work until the process is restarted."""
