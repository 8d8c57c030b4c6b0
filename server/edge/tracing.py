"""OpenTelemetry traces of calls, off unless `--otlp-endpoint` names a collector (the `[tracing]` extra).

Each Translator call is a SERVER span named after its gRPC method, child of the client's span when its
metadata carries a W3C `traceparent`; it records the request id, model, language pair, beam width and
status. Each sentence adds three child spans when it finishes: `queue_wait` (from submission until it
got slots), `encode` (its encoder call, which it shares with the sentences admitted in the same
iteration) and `decode` (from the end of that call until its translation came back), with its index
and token counts. The engine measures; the spans are written here, after the fact, from what its
events carry: the decoding core never imports OpenTelemetry. A sentence the response cache answered
has empty `queue_wait` and `encode` spans at the start of the call.

The standard OTEL_* variables configure what the flag does not (OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER,
OTEL_EXPORTER_OTLP_HEADERS, ...); they are read by the SDK when `open_tracing` builds it, never at import.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

try:  # the API, which the SDK brings: without the [tracing] extra, open_tracing refuses to start
    from opentelemetry import trace as otel
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:
    otel = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from server.core.events import SentenceDone

SERVICE_NAME = "translate-server"  # the service.name spans carry unless OTEL_SERVICE_NAME says otherwise
SERVICE = "translation.v1.Translator"
INSTALL_HINT = "tracing needs the OpenTelemetry SDK: pip install 'translate-service[tracing]'"
EXPORT_TIMEOUT_S = 3.0  # one export's wait for the collector (the SDK's own default is 10 s)
EXPORT_TIMEOUT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
FLUSH_TIMEOUT_S = 3.0  # the last spans' flush at the exit


class CallTrace:
    """A call's trace; this base records nothing (tracing off)."""

    @property
    def trace_id(self) -> str:
        """The W3C trace id the call's spans carry (32 hex digits), for its access record; '' without tracing."""
        return ""

    def describe(self, model: str, pair: str, beam_size: int) -> None:
        """The call was routed and validated."""

    def sentence(self, submitted: float, done: SentenceDone) -> None:
        """`done` came back now, for sentences submitted at `submitted` (time.monotonic())."""

    def end(self, code: str) -> None:
        """The call ended with gRPC status `code` (its name)."""


NO_TRACE = CallTrace()


class Tracing:
    """Starts a span per call on `provider` (the OTLP exporter's, or a test's in-memory one)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("server.edge.tracing")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None, request_id: str) -> CallTrace:
        carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
        span = self._tracer.start_span(
            f"{SERVICE}/{method}",
            context=self._propagator.extract(carrier),
            kind=otel.SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": SERVICE,
                "rpc.method": method,
                "translation.request_id": request_id,
            },
        )
        return _SpanTrace(self._tracer, span)

    def shutdown(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Send what is buffered and stop exporting, waiting at most `timeout_s`: a collector that is down, or
        takes a connection and never answers, must not hold the exit past the pod's grace period (the flush goes
        on in a daemon thread, which the exit ends)."""
        flush = threading.Thread(target=self.provider.shutdown, name="trace-flush", daemon=True)
        flush.start()
        flush.join(timeout_s)


class _SpanTrace(CallTrace):
    def __init__(self, tracer: otel.Tracer, span: otel.Span) -> None:
        self._tracer, self._span = tracer, span

    @property
    def trace_id(self) -> str:
        context = self._span.get_span_context()  # a trace the sampler dropped has nothing to lead to
        return f"{context.trace_id:032x}" if context.is_valid and context.trace_flags.sampled else ""

    def describe(self, model: str, pair: str, beam_size: int) -> None:
        self._span.set_attribute("translation.model", model)
        self._span.set_attribute("translation.pair", pair)
        self._span.set_attribute("translation.beam_size", beam_size)

    def sentence(self, submitted: float, done: SentenceDone) -> None:
        now_ns, now = time.time_ns(), time.monotonic()
        start_ns = now_ns - round((now - submitted) * 1e9)
        slots_ns = start_ns + round(done.queue_wait_s * 1e9)
        encode_ns = [max(slots_ns, start_ns + round(at * 1e9)) for at in done.encoded_s]
        output_tokens = len(done.hypotheses[0].tokens) if done.hypotheses else 0
        attributes = {"translation.sentence_index": done.sentence_index}
        tokens = {
            **attributes,
            "translation.input_tokens": done.input_tokens,
            "translation.output_tokens": output_tokens,
        }
        self._child("queue_wait", start_ns, slots_ns, attributes)
        self._child("encode", encode_ns[0], encode_ns[1], attributes)
        self._child("decode", encode_ns[1], now_ns, tokens)

    def _child(self, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, int]) -> None:
        span = self._tracer.start_span(
            name, context=otel.set_span_in_context(self._span), start_time=start_ns, attributes=attributes
        )
        span.end(end_time=end_ns)

    def end(self, code: str) -> None:
        self._span.set_attribute("rpc.grpc.status_code", code)
        if code != "OK":
            self._span.set_status(otel.Status(otel.StatusCode.ERROR, code))
        self._span.end()


def open_tracing(endpoint: str) -> Tracing | None:
    """Tracing that exports to the OTLP/gRPC collector at `endpoint`; None when `endpoint` is empty.

    Raises RuntimeError naming the extra to install when the SDK is missing.
    """
    if not endpoint:
        return None
    if otel is None:
        raise RuntimeError(INSTALL_HINT)
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as err:
        raise RuntimeError(INSTALL_HINT) from err
    resource = Resource.create()  # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=resource)  # OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG
    # OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT where set; else a short one, for an export waits on a collector that is down
    timeout = None if any(name in os.environ for name in EXPORT_TIMEOUT_VARIABLES) else EXPORT_TIMEOUT_S
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=timeout)))
    return Tracing(provider)
