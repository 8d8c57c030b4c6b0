"""The one place where exceptions become gRPC statuses, and where every call is counted.

Servicer methods raise; the `unary_call` / `stream_call` wrappers turn what they raise into a
status with a message safe for clients (never exception text for unexpected faults: those are
logged with their traceback and answered INTERNAL) and record the call's status code, language
pair and duration in the metrics and its access log record. Each call has a request id (the
client's `x-request-id` metadata, or a new one) that its access record, its error log lines and its
trailing metadata carry.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import grpc
import grpc.aio

from server.core.events import (
    ENGINE_FAILED_MESSAGE,
    DrainingError,
    EngineFailedError,
    FailureReason,
    QueueFullError,
    RequestFailed,
)
from server.core.work import InvalidWorkError
from server.edge.logs import REQUEST_ID_KEY, log_call, request_id
from server.edge.metrics import Metrics
from server.edge.tracing import NO_TRACE, CallTrace, Tracing
from server.text.checkpoints import CallEnded
from server.text.documents import TextLimitError

logger = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal error"
QUEUE_FULL_MESSAGE = "the server's queue is full; retry with backoff or on another replica"
DRAINING_MESSAGE = "the server is shutting down; retry on another replica"
# gRFC A6 retry pushback on a draining refusal: a client whose retry policy covers UNAVAILABLE retries
# after it, and its round_robin balancer sends the retry to the next replica. 50 ms, not 0: gRPC's C core
# (grpcio 1.85) can hang a retried call until its deadline when the retry timer is near zero (grpc/grpc#41036):
# at 0, the first call after SIGTERM hung in 3 of 4 runs of two replicas, at 50 in none.
DRAINING_PUSHBACK = (("grpc-retry-pushback-ms", "50"),)
MAX_DETAIL_CHARS = 300  # of a refusal's message in its access record
MALFORMED_MESSAGE = "the request is not a valid serialized message of its type (bad wire format or UTF-8)"
UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token in the `authorization` metadata"
DEADLINE_SLACK_S = 0.25  # network transit allowed between a client's deadline and the server's copy


class ServiceError(Exception):
    """An error with a status and a message meant for the client."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResponseTooLarge(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class _Failed(ServiceError):
    """A request the engine failed; carries the engine's client-safe message and mapped status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


_FAILURE_CODES = {
    FailureReason.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    FailureReason.CANCELLED: grpc.StatusCode.CANCELLED,
    FailureReason.INTERNAL: grpc.StatusCode.INTERNAL,
    FailureReason.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


def request_failed(event: RequestFailed) -> ServiceError:
    """The exception for an engine's RequestFailed event (its message is client-safe by contract)."""
    return _Failed(_FAILURE_CODES[event.reason], event.message)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Status code and client-safe message for an exception a servicer method raised."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, InvalidWorkError | TextLimitError):  # validation whose messages name the limit, never internals
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, QUEUE_FULL_MESSAGE
    if isinstance(exc, CallEnded):  # its preparation stopped before grpc cancelled the handler
        return (grpc.StatusCode.DEADLINE_EXCEEDED if exc.deadline_passed else grpc.StatusCode.CANCELLED), str(exc)
    if isinstance(exc, DrainingError):
        return grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE
    if isinstance(exc, EngineFailedError):
        return grpc.StatusCode.UNAVAILABLE, ENGINE_FAILED_MESSAGE
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE


def trailing_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """What a refusal adds to its status: the retry pushback when the server is draining."""
    return DRAINING_PUSHBACK if isinstance(exc, DrainingError) else ()


def rejection_reason(exc: BaseException) -> str | None:
    """Why a RESOURCE_EXHAUSTED answer was given, for the metric that tells overload from client mistakes."""
    if isinstance(exc, QueueFullError):
        return "queue_full"
    if isinstance(exc, ResponseTooLarge):
        return "response_too_large"
    return None


@dataclass
class CallRecord:
    """What a servicer method learns about its call that the metrics and its access record need."""

    request_id: str = ""  # the client's x-request-id, or one made for the call
    lang_pair: str = ""  # set once the request's languages are validated
    model: str = ""  # the model routed to, set with lang_pair
    first_result_s: float | None = None  # seconds from the call's start to its first result
    started: float = field(default_factory=time.monotonic)  # when the servicer got the call
    texts: int = 0  # texts in the request, once it is validated
    sentences: int = 0  # sentences of the texts answered so far
    input_tokens: int = 0  # of those sentences
    output_tokens: int = 0  # of their best hypotheses
    queue_wait_s: float = 0.0  # the longest any of its sentences waited for slots
    submitted: float = 0.0  # time.monotonic() when its sentences went to the engine
    trace: CallTrace = NO_TRACE  # its span, when tracing is on (server.edge.tracing)

    def access_record(self, method: str, code: grpc.StatusCode, seconds: float, detail: str = "") -> dict[str, object]:
        """The call's access log fields (server.edge.logs): counts and timings, never text; a refusal's status
        message too (what the client was told: limits, codes and positions; no refusal quotes a text)."""
        return {
            "request_id": self.request_id,
            "method": method,
            "model": self.model,
            "pair": self.lang_pair,
            "status": code.name,
            "duration_ms": round(seconds * 1000, 2),
            "texts": self.texts,
            "sentences": self.sentences,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "queue_wait_ms": round(self.queue_wait_s * 1000, 2),
            **({"trace_id": trace_id} if (trace_id := self.trace.trace_id) else {}),  # the call's spans, where traced
            **({"detail": detail[:MAX_DETAIL_CHARS]} if detail else {}),
        }


def _new_call(context: grpc.aio.ServicerContext[Req, Resp], tracing: Tracing | None, method: str) -> CallRecord:
    metadata = context.invocation_metadata()
    call = CallRecord(request_id=request_id(metadata))
    if tracing is not None:
        call.trace = tracing.start(method, metadata, call.request_id)
    return call


def request_id_metadata(call: CallRecord) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that tells the client its call's request id."""
    return ((REQUEST_ID_KEY, call.request_id),)


def cancelled_by_deadline(context: grpc.aio.ServicerContext[Req, Resp], call: CallRecord) -> bool:
    """Whether grpc cancelled this call because its deadline passed, not because the client left."""
    return deadline_passed(context.time_remaining(), time.monotonic() - call.started)


class Observed(Protocol):
    metrics: Metrics | None
    tracing: Tracing | None


S = TypeVar("S", bound=Observed)
Req = TypeVar("Req")
Resp = TypeVar("Resp")
UnaryMethod = Callable[[S, Req, grpc.aio.ServicerContext[Req, Resp], CallRecord], Awaitable[Resp]]
StreamMethod = Callable[[S, Req, grpc.aio.ServicerContext[Req, Resp], CallRecord], AsyncGenerator[Resp, None]]


def unary_call(
    method: str,
) -> Callable[[UnaryMethod[S, Req, Resp]], Callable[[S, Req, grpc.aio.ServicerContext[Req, Resp]], Awaitable[Resp]]]:
    """Wrap a unary servicer method: statuses from exceptions, metrics for every outcome."""

    def decorate(
        fn: UnaryMethod[S, Req, Resp],
    ) -> Callable[[S, Req, grpc.aio.ServicerContext[Req, Resp]], Awaitable[Resp]]:
        @functools.wraps(fn)
        async def wrapper(self: S, request: Req, context: grpc.aio.ServicerContext[Req, Resp]) -> Resp:
            call = _new_call(context, self.tracing, method)
            _count_in_flight(self.metrics, method, +1)
            try:
                response = await fn(self, request, context, call)
            except BaseException as exc:
                await _fail(self.metrics, method, call, context, exc)
                raise  # unreachable for Exception: _fail aborts the call
            finally:
                _count_in_flight(self.metrics, method, -1)
            call.first_result_s = time.monotonic() - call.started
            context.set_trailing_metadata(request_id_metadata(call))
            _observe(self.metrics, method, call, grpc.StatusCode.OK)
            return response

        return wrapper

    return decorate


def stream_call(
    method: str,
) -> Callable[
    [StreamMethod[S, Req, Resp]], Callable[[S, Req, grpc.aio.ServicerContext[Req, Resp]], AsyncIterator[Resp]]
]:
    """Wrap a server-streaming servicer method (an async generator) like `unary_call`."""

    def decorate(
        fn: StreamMethod[S, Req, Resp],
    ) -> Callable[[S, Req, grpc.aio.ServicerContext[Req, Resp]], AsyncIterator[Resp]]:
        @functools.wraps(fn)
        async def wrapper(self: S, request: Req, context: grpc.aio.ServicerContext[Req, Resp]) -> AsyncIterator[Resp]:
            call = _new_call(context, self.tracing, method)
            _count_in_flight(self.metrics, method, +1)
            try:
                # aclosing: when the client goes away, the inner generators' cleanup (freeing slots) runs now
                async with contextlib.aclosing(fn(self, request, context, call)) as responses:
                    async for response in responses:
                        if call.first_result_s is None:
                            call.first_result_s = time.monotonic() - call.started
                        yield response
            except BaseException as exc:
                await _fail(self.metrics, method, call, context, exc)
                raise
            finally:
                _count_in_flight(self.metrics, method, -1)
            context.set_trailing_metadata(request_id_metadata(call))
            _observe(self.metrics, method, call, grpc.StatusCode.OK)

        return wrapper

    return decorate


async def _fail(
    metrics: Metrics | None,
    method: str,
    call: CallRecord,
    context: grpc.aio.ServicerContext[Req, Resp],
    exc: BaseException,
) -> None:
    """Record the failed call; abort it with its status unless the client is already gone."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        # grpc cancels the handler when the client cancels or its deadline passes
        code = grpc.StatusCode.DEADLINE_EXCEEDED if cancelled_by_deadline(context, call) else grpc.StatusCode.CANCELLED
        _observe(metrics, method, call, code)
        return
    if not isinstance(exc, Exception):
        return  # KeyboardInterrupt, SystemExit: not a request outcome
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, ServiceError):
        logger.error("%s failed (request id %s)", method, call.request_id, exc_info=exc)
    _observe(metrics, method, call, code, message)
    if metrics is not None and (reason := rejection_reason(exc)) is not None:
        metrics.observe_rejected(method, reason, call.model)
    await context.abort(code, message, trailing_metadata(exc) + request_id_metadata(call))


def deadline_passed(remaining: float | None, elapsed: float) -> bool:
    """Whether a call cancelled with `remaining` seconds of the server's deadline left was cancelled by its deadline.

    The client's copy of a deadline fires first, and cancels the call with some of the server's left:
    the request's transit, and the `grpc-timeout` header, which rounds the timeout up to a few
    significant digits (so the more the longer the deadline). A cancellation
    within that of the deadline is the deadline; the transit share is capped at a tenth of short
    deadlines so that an early cancel of a 0.2 s call still counts as a cancel.
    """
    if remaining is None:
        return False
    timeout = remaining + elapsed  # the deadline as the server first saw it
    return remaining <= min(DEADLINE_SLACK_S, timeout / 10) + timeout / 90


def _count_in_flight(metrics: Metrics | None, method: str, change: int) -> None:
    if metrics is not None:
        metrics.count_in_flight(method, change)


def _observe(metrics: Metrics | None, method: str, call: CallRecord, code: grpc.StatusCode, detail: str = "") -> None:
    seconds = time.monotonic() - call.started
    log_call(call.access_record(method, code, seconds, detail))
    call.trace.end(code.name)
    if metrics is None:
        return
    metrics.observe_request(method, code.name, call.lang_pair, seconds, call.model)
    if call.first_result_s is not None:
        metrics.observe_first_result(method, call.first_result_s, call.model)
