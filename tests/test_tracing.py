"""OpenTelemetry traces (server/edge/tracing.py), recorded by the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from server.edge.config import ModelsConfig, ServerConfig
from server.edge.loading import LoadedModel, load_model
from server.edge.logs import ACCESS_LOGGER
from server.edge.server import create_server
from server.edge.tracing import SERVICE_NAME, Tracing, open_tracing
from server.processes.engine_process import ModelProcess
from server.proto.translation.v1 import translation_pb2 as pb
from tests.serving import FAKE_DESCRIPTION, FP32_ON_CPU, RunningServer, fake_model, request, server_config, server_loop

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
METADATA = (("traceparent", TRACEPARENT), ("x-request-id", "r-7"))
TEXTS = ["Das Haus ist groß. Er wartete.", "Geheimpolizei"]


def traced_server(model: LoadedModel, config: ServerConfig) -> Iterator[tuple[RunningServer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with server_loop() as loop:
        created = create_server(config, model, CollectorRegistry(), Tracing(provider))
        server, port = asyncio.run_coroutine_threadsafe(created, loop).result(120)
        running = RunningServer(server, port, loop)
        try:
            yield running, exporter
        finally:
            running.channel.close()
            running.run(server.shutdown(0.0))


@pytest.fixture()
def traced(tiny_model_dir: Path) -> Iterator[tuple[RunningServer, InMemorySpanExporter]]:
    yield from traced_server(fake_model(tiny_model_dir), server_config())


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def of_sentence(spans: list[ReadableSpan], index: object) -> ReadableSpan:
    (span,) = [s for s in spans if (s.attributes or {})["translation.sentence_index"] == index]
    return span


def assert_traced(reply: pb.TranslateResponse, spans: tuple[ReadableSpan, ...], model: str) -> None:
    """One SERVER span under the client's traceparent; per sentence, `queue_wait`, `encode` and `decode`
    children in that order, none overlapping the next."""
    (call,) = by_name(spans, "translation.v1.Translator/Translate")
    assert call.kind == SpanKind.SERVER and call.status.status_code != StatusCode.ERROR
    assert format(call.context.trace_id, "032x") == TRACE_ID and call.parent is not None
    assert format(call.parent.span_id, "016x") == PARENT_ID
    attributes = dict(call.attributes or {})
    assert attributes["translation.model"] == model and attributes["translation.pair"] == "de-en"
    assert (attributes["translation.beam_size"], attributes["translation.request_id"]) == (2, "r-7")
    assert attributes["rpc.grpc.status_code"] == "OK"
    queued, encoded, decoded = by_name(spans, "queue_wait"), by_name(spans, "encode"), by_name(spans, "decode")
    assert len(queued) == len(encoded) == len(decoded) == sum(r.sentences for r in reply.results) == 3
    for span in queued + encoded + decoded:
        assert span.parent is not None and span.parent.span_id == call.context.span_id
        assert span.context.trace_id == call.context.trace_id
    for wait in queued:
        index = (wait.attributes or {})["translation.sentence_index"]
        encode, decode = of_sentence(encoded, index), of_sentence(decoded, index)
        times = [call.start_time, wait.start_time, wait.end_time, encode.start_time, encode.end_time]
        times += [decode.start_time, decode.end_time, call.end_time]
        assert None not in times and times == sorted(times)  # type: ignore[type-var]
        assert encode.end_time == decode.start_time and encode.start_time < encode.end_time  # type: ignore[operator]
    output_tokens = [(d.attributes or {})["translation.output_tokens"] for d in decoded]
    assert sum(output_tokens) == sum(r.output_tokens for r in reply.results)  # type: ignore[arg-type]


def test_a_call_is_a_server_span_under_the_clients_traceparent_with_queue_encode_and_decode_spans_per_sentence(
    traced: tuple[RunningServer, InMemorySpanExporter], caplog: pytest.LogCaptureFixture
) -> None:
    """The access record carries the trace id too, so that a log line leads to its trace. (Broken once on purpose,
    the record without it: only the span's request id attribute joined the two.)"""
    from tests.test_logs import access_records

    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    served, exporter = traced
    reply = served.stub.Translate(request(TEXTS, beam_size=2), metadata=METADATA)
    assert_traced(reply, exporter.get_finished_spans(), FAKE_DESCRIPTION.name)
    (record,) = access_records(caplog)
    assert record["trace_id"] == TRACE_ID and record["request_id"] == "r-7"


def test_an_engine_process_times_the_encoder_call_the_call_span_contains(tiny_exported_dir: Path) -> None:
    config = server_config(models=ModelsConfig(model_dirs=(tiny_exported_dir,)), engines=FP32_ON_CPU)
    model = load_model(config, tiny_exported_dir)
    assert isinstance(model.runner, ModelProcess)
    for served, exporter in traced_server(model, config):
        reply = served.stub.Translate(request(TEXTS, beam_size=2), metadata=METADATA, timeout=60)
        assert_traced(reply, exporter.get_finished_spans(), model.description.name)


def test_a_refused_call_is_an_error_span_of_its_status_and_without_traceparent_a_trace_of_its_own(
    traced: tuple[RunningServer, InMemorySpanExporter],
) -> None:
    served, exporter = traced
    with pytest.raises(grpc.RpcError):
        served.stub.Translate(request(["Das Haus ist groß."], target="fr"))
    (call,) = exporter.get_finished_spans()
    assert call.parent is None and call.status.status_code == StatusCode.ERROR
    assert dict(call.attributes or {})["rpc.grpc.status_code"] == "INVALID_ARGUMENT"


def test_tracing_is_off_without_an_endpoint_and_names_its_service_from_otel_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert open_tracing("") is None
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    tracing = open_tracing("http://localhost:4317")
    assert tracing is not None
    assert tracing.provider.resource.attributes["service.name"] == SERVICE_NAME
    tracing.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "translate-eu-1")
    tracing = open_tracing("http://localhost:4317")
    assert tracing is not None and tracing.provider.resource.attributes["service.name"] == "translate-eu-1"
    tracing.shutdown()


def test_a_collector_that_never_answers_holds_neither_the_exit_nor_an_export_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A collector that takes the connection and never answers: the last flush gives up after its bound, so the
    drain and the exit stay inside the pod's grace period. (Broken once on purpose, the SDK's flush awaited: the
    exit took 11-15 s past the drain with the collector down or silent.)"""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "30")  # an export that waits 30 s: only the bound ends the flush
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", raising=False)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts at the kernel and never reads: an export waits for its timeout
        tracing = open_tracing(f"http://127.0.0.1:{silent.getsockname()[1]}")
        assert tracing is not None
        tracing.start("Translate", (), "r-1").end("OK")
        flush = threading.Thread(target=tracing.shutdown, kwargs={"timeout_s": 0.5}, daemon=True)
        flush.start()
        flush.join(10)  # a third of the export's own 30 s: a flush that waited for the collector is still running
        assert not flush.is_alive(), "the flush waited for the collector"
