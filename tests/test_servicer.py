"""The Translator service over real gRPC on a loopback port: results, streaming, statuses, health, drain, metrics."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model.tokenizer import TOKENIZER_FILE, Tokenizer
from server.core.events import SHUTDOWN_MESSAGE, RequestDone, SentenceDone, TokensEvent
from server.edge import interceptors, preparation
from server.edge.config import EnginesConfig, LimitsConfig, ServerConfig
from server.edge.errors import DRAINING_MESSAGE, QUEUE_FULL_MESSAGE, deadline_passed
from server.edge.loading import LoadedModel, StartupError
from server.edge.server import SERVICE_NAME, TranslationServer
from server.edge.servicer import CallInbox
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc
from server.text.documents import RequestLimits
from server.text.splitter import join, split
from tests.fakes import FakeRunner, reference_decode
from tests.serving import (
    START_TIMEOUT_S,
    GatedRunner,
    RunningServer,
    Status,
    export_tiny_onnx,
    fake_model,
    health_status,
    loopback,
    onnx_model,
    request,
    runner_of,
    running_server,
    sample_value,
    server_config,
    server_loop,
    server_process,
    status_of,
    wait_until,
)

T = TypeVar("T")
TEXTS = [
    "Das Haus ist groß.",
    "Ich verstehe ihre Gedankengänge nicht. Es hörte auf zu regnen.\nEr wartete.",
    "",
    "Geheimpolizei",
    "  \n ",
    "Sie schrieben gemeinsam ein Buch.",
]


def config(**groups: object) -> ServerConfig:
    """A test server on one loopback address: `localhost` resolves to two, and the ephemeral port grpc takes on the
    first may be another process's on the second, which the client then reaches."""
    return server_config(**groups)


@pytest.fixture()
def model(tiny_model_dir: Path) -> LoadedModel:
    return fake_model(tiny_model_dir)


@pytest.fixture()
def served(model: LoadedModel) -> Iterator[RunningServer]:
    with running_server(model, config()) as running:
        yield running


def rejections(served: RunningServer) -> dict[str, float]:
    """translation_requests_rejected_total of Translate calls by reason."""
    name = "translation_requests_rejected_total"
    return {
        reason: sample_value(served.registry, name, method="Translate", reason=reason)
        for reason in ("queue_full", "response_too_large")
    }


def expected_hypotheses(model: LoadedModel, text: str, beam: int = 4, penalty: float = 1.0) -> list[tuple[str, float]]:
    """The whole text decoded offline, sentence by sentence, without the server: what it must answer."""
    spec, tokenizer = model.runner.spec, model.tokenizer
    parts = split(text, "de")
    if not parts.pieces:
        return [(text, 0.0)]
    per_sentence = [
        reference_decode(tokenizer.encode_source(p, "en"), beam, penalty, spec.max_target_len, spec)
        for p in parts.pieces
    ]
    ranked = []
    for rank in range(beam):
        chosen = [hyps[min(rank, len(hyps) - 1)] for hyps in per_sentence]
        pieces = [tokenizer.decode(list(h.tokens)) for h in chosen]
        ranked.append((join(pieces, parts.separators), sum(h.normalized for h in chosen)))
    return ranked


def test_translate_answers_every_text_in_order_like_the_offline_decoder(
    served: RunningServer, model: LoadedModel
) -> None:
    reply = served.stub.Translate(request(TEXTS, beam_size=2))
    assert [r.index for r in reply.results] == list(range(len(TEXTS)))
    assert [r.translation for r in reply.results] == [expected_hypotheses(model, t, beam=2)[0][0] for t in TEXTS]
    assert [r.sentences for r in reply.results] == [1, 3, 0, 1, 0, 1]
    assert reply.results[1].translation.count("\n") == 1  # the line break survives translation
    assert not reply.results[0].hypotheses  # n-best only when asked for


def test_short_requests_are_prepared_on_the_loop_and_long_ones_in_a_worker_thread(
    served: RunningServer, model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    hops: list[int] = []
    run = preparation.PreparationPool.run

    async def counted(pool: preparation.PreparationPool, func: Callable[[], object], deadline: float | None) -> object:
        hops.append(1)
        return await run(pool, func, deadline)

    monkeypatch.setattr(preparation.PreparationPool, "run", counted)
    short = "Das Haus ist groß."
    long = " ".join([short] * (preparation.INLINE_PREPARE_CHARS // len(short) + 1))
    assert len(short) <= preparation.INLINE_PREPARE_CHARS < len(long)
    assert served.stub.Translate(request([short])).results[0].translation == expected_hypotheses(model, short)[0][0]
    assert not hops
    assert served.stub.Translate(request([long])).results[0].translation == expected_hypotheses(model, long)[0][0]
    assert hops == [1]


def test_blank_texts_come_back_unchanged_without_running_the_model(served: RunningServer, model: LoadedModel) -> None:
    runner = model.runner
    assert isinstance(runner, FakeRunner)
    steps = runner.step_calls
    reply = served.stub.Translate(request(["", "  \n\t ", "\n"]))
    assert [r.translation for r in reply.results] == ["", "  \n\t ", "\n"]
    assert [r.input_tokens for r in reply.results] == [0, 0, 0]
    assert runner.step_calls == steps


def test_n_best_with_scores(served: RunningServer, model: LoadedModel) -> None:
    text = "Ich verstehe ihre Gedankengänge nicht. Es hörte auf zu regnen."
    reply = served.stub.Translate(request([text], beam_size=4, num_hypotheses=3, return_scores=True))
    result = reply.results[0]
    want = expected_hypotheses(model, text)[:3]
    assert [h.text for h in result.hypotheses] == [t for t, _ in want]
    assert [h.score for h in result.hypotheses] == pytest.approx([s for _, s in want], abs=1e-5)
    assert result.hypotheses[0].text == result.translation
    assert all(h.HasField("score") for h in result.hypotheses)
    no_scores = served.stub.Translate(request([text], beam_size=4, num_hypotheses=2)).results[0]
    assert [h.HasField("score") for h in no_scores.hypotheses] == [False, False]


def test_stream_sends_each_text_once_and_partials_before_their_result(
    served: RunningServer, model: LoadedModel
) -> None:
    messages = list(served.stub.TranslateStream(request(TEXTS, beam_size=1, stream_tokens=True)))
    results = [m.result for m in messages if m.WhichOneof("event") == "result"]
    assert sorted(r.index for r in results) == list(range(len(TEXTS)))
    assert {r.index: r.translation for r in results} == {
        i: expected_hypotheses(model, t, beam=1)[0][0] for i, t in enumerate(TEXTS)
    }
    done_at = {m.result.index: n for n, m in enumerate(messages) if m.WhichOneof("event") == "result"}
    partials = [(n, m.partial) for n, m in enumerate(messages) if m.WhichOneof("event") == "partial"]
    assert partials, "greedy token streaming sends partial output"
    for n, partial in partials:
        assert n < done_at[partial.text_index], "a partial arrives before its text's result"
    finals = [p for _, p in partials if p.finished]
    assert len(finals) == sum(r.sentences for r in results)  # one final partial per sentence
    assert len(finals) < len(partials), "greedy streams unfinished partials too"


def test_stream_with_beams_reports_finished_sentences_only(served: RunningServer) -> None:
    messages = list(served.stub.TranslateStream(request(TEXTS[:2], beam_size=3, stream_tokens=True)))
    partials = [m.partial for m in messages if m.WhichOneof("event") == "partial"]
    assert len(partials) == 4 and all(p.finished for p in partials)
    assert not [m for m in served.stub.TranslateStream(request(TEXTS[:2])) if m.WhichOneof("event") == "partial"]


def test_concurrent_clients_get_exactly_their_own_translations(served: RunningServer, model: LoadedModel) -> None:
    from tests.tiny import TINY_PAIRS

    sources = [de for de, _ in TINY_PAIRS]

    def one_client(k: int) -> tuple[list[str], list[str]]:
        texts = [sources[(k + j) % len(sources)] for j in range(1 + k % 3)]
        reply = served.stub.Translate(request(texts, beam_size=1 + k % 3))
        return texts, [r.translation for r in reply.results]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one_client, range(16)))
    for k, (texts, got) in enumerate(answers):
        assert got == [expected_hypotheses(model, t, beam=1 + k % 3)[0][0] for t in texts]


def test_list_models_reports_languages_pairs_limits_and_runtime(served: RunningServer, model: LoadedModel) -> None:
    (info,) = served.stub.ListModels(pb.ListModelsRequest()).models
    assert list(info.languages) == ["de", "en"]
    assert {(p.source, p.target) for p in info.pairs} == {("de", "en"), ("en", "de")}
    assert info.limits.max_texts_per_request == 256
    assert info.limits.max_chars_per_text == 10_000
    assert info.limits.max_sentences_per_request == 512
    assert info.limits.max_source_tokens == model.runner.spec.max_source_len
    assert info.limits.max_output_len == model.runner.spec.max_target_len
    assert info.limits.max_beam_size == 8
    assert info.limits.max_message_bytes == LimitsConfig().max_message_bytes
    assert (info.variant, info.provider, info.opset) == ("fp32", "fake", 18)


def test_a_request_without_length_penalty_gets_the_models_default_for_its_direction(model: LoadedModel) -> None:
    tuned = replace(model, description=replace(model.description, default_length_penalty={"de-en": 0.5}))
    text = "Ich verstehe ihre Gedankengänge nicht. Es hörte auf zu regnen."
    with running_server(tuned, config()) as served:
        (info,) = served.stub.ListModels(pb.ListModelsRequest()).models
        default = served.stub.Translate(request([text], return_scores=True, num_hypotheses=2)).results[0]
        explicit = served.stub.Translate(request([text], return_scores=True, num_hypotheses=2, length_penalty=1.0))
    assert dict(info.default_length_penalty) == {"de-en": 0.5, "en-de": 1.0}  # untuned directions: 1.0
    for got, penalty in ((default, 0.5), (explicit.results[0], 1.0)):
        want = expected_hypotheses(model, text, penalty=penalty)[:2]
        assert [(h.text, h.score) for h in got.hypotheses] == [(t, pytest.approx(s, abs=1e-4)) for t, s in want]


class _InProcessContext:
    """What the servicer's call wrappers ask of grpc's context, for a call made without a channel."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, metadata: object) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str, metadata: object = ()) -> None:
        raise AssertionError(f"{code.name}: {details}")


@pytest.mark.parametrize("source", [" DE ", "auto", "und-Latn"])
def test_the_servicer_never_changes_the_clients_message(served: RunningServer, source: str) -> None:
    """The request is typed once; its codes are trimmed and `auto` cleared in that type, never written back into
    the message (grpc hands the servicer its own copy, so only a call in process can see a write). Broken before:
    `normalize_codes` set the message's trimmed codes, and cleared an `auto` source, in place."""
    sent = pb.TranslateRequest(
        texts=["Das Haus ist groß."],
        options=pb.TranslationOptions(source_language=source, target_language=" en\t", model=" fake ", beam_size=1),
        allow_partial=True,
    )
    before = pb.TranslateRequest()
    before.CopyFrom(sent)
    servicer = served.server.servicer
    reply = served.run(servicer.Translate(sent, _InProcessContext()))  # type: ignore[arg-type]
    assert not reply.results[0].HasField("error") and reply.results[0].translation
    streamed = served.run(_collected(servicer.TranslateStream(sent, _InProcessContext())))  # type: ignore[arg-type]
    assert streamed[-1].result.translation == reply.results[0].translation
    assert sent == before


async def _collected(stream: AsyncIterator[T]) -> list[T]:
    return [item async for item in stream]


INVALID = {
    "empty request": (request([]), "no texts"),
    "no languages": (pb.TranslateRequest(texts=["Hallo"]), "target_language is required"),
    "unknown pair": (request(["Hallo"], "de", "fr"), "unsupported language pair 'de' -> 'fr'"),
    "same language": (request(["Hallo"], "de", "de"), "'de' and target_language 'de' are the same language"),
    "too many texts": (request(["Hallo"] * 257), "over the limit of 256"),
    "text too long": (request(["ok", "a" * 10_001]), "texts[1] has 10001 characters"),
    "too many sentences": (request(["Ja. " * 300, "Nein. " * 300]), "more than 512 sentences"),
    "beam zero": (request(["Hallo"], beam_size=0), "beam_size must be in 1..8"),
    "beam too wide": (request(["Hallo"], beam_size=9), "beam_size must be in 1..8"),
    "n-best over beam": (request(["Hallo"], beam_size=2, num_hypotheses=3), "num_hypotheses"),
    "negative penalty": (request(["Hallo"], length_penalty=-1.0), "length_penalty"),
    "nan penalty": (request(["Hallo"], length_penalty=float("nan")), "length_penalty"),
    "output too long": (request(["Hallo"], max_output_len=13), "max_output_len must be at most"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(INVALID))
def test_bad_requests_are_invalid_argument_with_a_helpful_message(served: RunningServer, case: str) -> None:
    bad, message = INVALID[case]
    for call in (served.stub.Translate, lambda r: list(served.stub.TranslateStream(r))):
        error = status_of(lambda: call(bad))  # noqa: B023
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.details


def test_queue_full_is_resource_exhausted_and_loses_nothing(tiny_model_dir: Path) -> None:
    max_queue = 3
    base = fake_model(tiny_model_dir, max_slots=1)
    gated = GatedRunner(runner_of(base))
    with running_server(
        LoadedModel(gated, base.tokenizer, base.description),
        config(engines=EnginesConfig(max_slots=1, max_queue=max_queue)),
    ) as served:
        engine = served.server.engine
        assert engine is not None
        gated.close_gate()
        accepted = [served.stub.Translate.future(request(["Das Haus ist groß."], beam_size=1))]
        gated.wait_for_step()  # the engine is stuck mid-iteration: every later sentence waits in the queue
        refused = None
        for _ in range(max_queue + 2):
            depth = engine.queue_depth
            future = served.stub.Translate.future(request(["Geheimpolizei"], beam_size=1))
            wait_until(lambda: future.done() or engine.queue_depth == depth + 1)  # noqa: B023
            if future.done():
                refused = future
                break
            accepted.append(future)
        assert refused is not None, "the queue bound was never enforced"
        assert engine.queue_depth == max_queue
        error = status_of(refused.result)
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in error.details
        assert in_flight(served, "Translate") == len(accepted)  # the refused call is answered, the rest held
        gated.gate.set()
        assert [f.result(30).results[0].sentences for f in accepted] == [1] * len(accepted)
        wait_until(lambda: engine.queue_depth == 0 and engine.active_slots == 0)
        wait_until(lambda: in_flight(served, "Translate") == 0)
        assert (
            sample_value(
                served.registry,
                "translation_requests_total",
                method="Translate",
                code="RESOURCE_EXHAUSTED",
                lang_pair="de-en",
            )
            == 1
        )
        reasons = rejections(served)
        assert reasons == {"queue_full": 1, "response_too_large": 0}  # what the queue-full alert counts


@pytest.mark.parametrize("where", ["decoding", "queued"])
def test_deadline_exceeded_frees_the_work(tiny_model_dir: Path, where: str) -> None:
    base = fake_model(tiny_model_dir, max_slots=1)
    gated = GatedRunner(runner_of(base))
    with running_server(
        LoadedModel(gated, base.tokenizer, base.description), config(engines=EnginesConfig(max_slots=1))
    ) as served:
        engine = served.server.engine
        assert engine is not None
        gated.close_gate()
        blocker = None
        if where == "queued":
            blocker = served.stub.Translate.future(request(["Das Haus ist groß."], beam_size=1))
            gated.wait_for_step()
        # The gate is shut, so the deadline expires whatever its length; 2 s (not less) so that on a loaded
        # machine the request surely reaches the server first, and the server's count can be checked.
        error = status_of(lambda: served.stub.Translate(request(["Geheimpolizei"], beam_size=1), timeout=2.0))
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED

        def counted(code: str) -> float:
            labels = {"method": "Translate", "code": code, "lang_pair": "de-en"}
            return sample_value(served.registry, "translation_requests_total", **labels)

        # Counted once, as DEADLINE_EXCEEDED and never CANCELLED: the client's copy of the deadline fires
        # first and cancels the call with the request's transit (milliseconds on loopback) of the server's
        # copy left, well within the slack `deadline_passed` allows a 2 s deadline. Waited for with the
        # gate still shut: an open gate would let the work finish OK first.
        # Deliberate break: a cancellation by grpc counted CANCELLED whatever `cancelled_by_deadline` says fails it.
        wait_until(lambda: counted("DEADLINE_EXCEEDED") + counted("CANCELLED") == 1)
        gated.gate.set()
        if blocker is not None:
            assert blocker.result(30).results[0].sentences == 1
        wait_until(lambda: engine.queue_depth == 0 and engine.active_slots == 0)
        assert (counted("DEADLINE_EXCEEDED"), counted("CANCELLED")) == (1, 0)
        assert served.stub.Translate(request(["Steuerpult"], beam_size=1)).results[0].sentences == 1


@pytest.mark.parametrize(
    ("remaining", "elapsed", "passed"),
    [
        (0.0, 0.3, True),
        (0.0101, 0.99, True),  # measured at a 1 s deadline: the header rounds up, the client fires first
        (0.9997, 149.0, True),  # at 150 s
        (10.0, 2990.0, True),  # at 3000 s
        (100.0, 86300.0, True),  # at a day
        (0.15, 0.05, False),  # an early cancel of a 0.2 s call
        (1.0, 4.0, False),  # a cancel a second before a 5 s deadline
        (None, 3.0, False),  # no deadline
    ],
)
def test_a_cancellation_at_the_deadline_is_the_deadline(remaining: float | None, elapsed: float, passed: bool) -> None:
    assert deadline_passed(remaining, elapsed) is passed


@pytest.mark.parametrize("timeout", [None, 1.0])
def test_client_cancel_is_counted_and_frees_the_slots(tiny_model_dir: Path, timeout: float | None) -> None:
    base = fake_model(tiny_model_dir, max_slots=4)
    gated = GatedRunner(runner_of(base))
    with running_server(
        LoadedModel(gated, base.tokenizer, base.description), config(engines=EnginesConfig(max_slots=4))
    ) as served:
        engine = served.server.engine
        assert engine is not None
        gated.close_gate()
        stream = served.stub.TranslateStream(request(["Das Haus ist groß."], beam_size=4), timeout=timeout)
        gated.wait_for_step()
        assert in_flight(served, "TranslateStream") == 1
        stream.cancel()  # well before any deadline: a cancel, not a deadline
        # the cancel travels to the engine asynchronously: let it arrive before the held step ends,
        # or the sentence may finish first and rightly count as translated
        wait_until(lambda: bool(engine._cancels))
        gated.gate.set()
        wait_until(lambda: engine.queue_depth == 0 and engine.active_slots == 0)
        wait_until(
            lambda: (
                sample_value(
                    served.registry,
                    "translation_requests_total",
                    method="TranslateStream",
                    code="CANCELLED",
                    lang_pair="de-en",
                )
                == 1
            )
        )
        assert sample_value(served.registry, "translation_sentences_total", lang_pair="de-en") == 0
        assert in_flight(served, "TranslateStream") == 0


def in_flight(served: RunningServer, method: str) -> float:
    return sample_value(served.registry, "translation_requests_in_flight", method=method)


def test_a_failing_batch_is_internal_without_details_and_the_server_carries_on(tiny_model_dir: Path) -> None:
    model = fake_model(tiny_model_dir)
    runner = model.runner
    assert isinstance(runner, FakeRunner)
    with running_server(model, config()) as served:
        runner.fail_on_step = runner.step_calls
        error = status_of(lambda: served.stub.Translate(request(["Das Haus ist groß."])))
        assert error.code == grpc.StatusCode.INTERNAL
        assert "injected" not in error.details
        assert served.stub.Translate(request(["Das Haus ist groß."])).results[0].sentences == 1


class ExplodingTokenizer(Tokenizer):
    def decode(self, ids: list[int]) -> str:
        raise RuntimeError("secret stack detail")


def test_an_unexpected_error_is_internal_without_exception_text(tiny_model_dir: Path) -> None:
    base = fake_model(tiny_model_dir)
    tokenizer = ExplodingTokenizer(tiny_model_dir / "tokenizer.model")
    with running_server(LoadedModel(base.runner, tokenizer, base.description), config()) as served:
        error = status_of(lambda: served.stub.Translate(request(["Das Haus ist groß."])))
        assert error.code == grpc.StatusCode.INTERNAL
        assert error.details == "internal error"
        engine = served.server.engine
        assert engine is not None
        wait_until(lambda: engine.queue_depth == 0 and engine.active_slots == 0)


def test_metrics_move_by_exactly_what_the_requests_did(served: RunningServer) -> None:
    registry = served.registry
    reply = served.stub.Translate(request(TEXTS, beam_size=2))
    status_of(lambda: served.stub.Translate(request(["Hallo"], "de", "fr")))
    list(served.stub.TranslateStream(request(TEXTS[:2], "en", "de")))

    def value(name: str, **labels: str) -> float:
        return sample_value(registry, name, **labels)

    assert value("translation_requests_total", method="Translate", code="OK", lang_pair="de-en") == 1
    assert value("translation_requests_total", method="Translate", code="INVALID_ARGUMENT", lang_pair="") == 1
    assert value("translation_requests_total", method="TranslateStream", code="OK", lang_pair="en-de") == 1
    assert value("translation_sentences_total", lang_pair="de-en") == sum(r.sentences for r in reply.results)
    assert value("translation_input_tokens_total", lang_pair="de-en") == sum(r.input_tokens for r in reply.results)
    assert value("translation_output_tokens_total", lang_pair="de-en") == sum(r.output_tokens for r in reply.results)
    assert value("translation_sentences_total", lang_pair="en-de") == 4
    assert value("translation_request_duration_seconds_count", method="Translate", lang_pair="de-en") == 1
    assert value("translation_time_to_first_result_seconds_count", method="TranslateStream") == 1
    assert value("translation_model_info", model="fake", variant="fp32", provider="fake", opset="18") == 1


def test_health_is_not_serving_until_loaded_then_serving(model: LoadedModel) -> None:
    async def unloaded() -> tuple[TranslationServer, int]:
        server = TranslationServer(config())  # on the loop: grpc.aio binds the server to the running loop
        return server, await server.start()

    with server_loop() as loop:
        server, port = asyncio.run_coroutine_threadsafe(unloaded(), loop).result(60)
        running = RunningServer(server, port, loop)
        channel = running.channel
        assert [health_status(channel, s) for s in ("", SERVICE_NAME)] == ["NOT_SERVING"] * 2
        error = status_of(lambda: running.stub.Translate(request(["Hallo"])))
        assert error.code == grpc.StatusCode.UNAVAILABLE
        assert "loading" in error.details
        running.run(server.load(model))
        assert [health_status(channel, s) for s in ("", SERVICE_NAME)] == ["SERVING"] * 2
        channel.close()
        running.run(server.shutdown(0.0))


def test_a_call_the_queue_cannot_take_is_refused_before_it_is_split_or_tokenized(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(preparation, "INLINE_PREPARE_CHARS", 0)  # every preparation in a worker, as a long one
    base = fake_model(tiny_model_dir)
    held = HeldTokenizer(tiny_model_dir / TOKENIZER_FILE)
    with running_server(
        LoadedModel(base.runner, held, base.description), config(engines=EnginesConfig(max_queue=2))
    ) as served:
        first = served.stub.Translate.future(request(["Das Haus ist groß.", "Er wartete."]))  # holds both places
        assert held.entered.wait(30)  # admitted, and held while its texts are tokenized
        # Were the next call split and tokenized, it would wait at the held tokenizer, past the timeout.
        refused = status_of(lambda: served.stub.Translate(request(["Geheimpolizei"]), timeout=10))
        held.release.set()
        assert [r.sentences for r in first.result(30).results] == [1, 1]
        assert rejections(served)["queue_full"] == 1
    assert refused == Status(grpc.StatusCode.RESOURCE_EXHAUSTED, QUEUE_FULL_MESSAGE)


def test_drain_finishes_in_flight_work_and_refuses_new_work(tiny_model_dir: Path) -> None:
    base = fake_model(tiny_model_dir)
    gated = GatedRunner(runner_of(base))
    with running_server(LoadedModel(gated, base.tokenizer, base.description), config()) as served:
        gated.close_gate()
        in_flight = served.stub.Translate.future(request(["Das Haus ist groß.", "Geheimpolizei"]))
        gated.wait_for_step()
        drained = served.start(served.server.shutdown(30.0))
        wait_until(lambda: engine_draining(served))
        translate = refused_while_draining(lambda: served.stub.Translate(request(["Steuerpult"])))
        list_models = refused_while_draining(lambda: served.stub.ListModels(pb.ListModelsRequest()))
        for refusal in (translate, list_models):  # by the service, which says where to go: the port is still open
            assert refusal.code() == grpc.StatusCode.UNAVAILABLE and refusal.details() == DRAINING_MESSAGE
            assert ("grpc-retry-pushback-ms", "50") in (refusal.trailing_metadata() or ())  # retry soon, elsewhere
        gated.gate.set()
        assert [r.sentences for r in in_flight.result(30).results] == [1, 1]
        assert drained.result(30) is True


def test_calls_past_the_concurrency_limit_are_refused_before_they_are_read(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parse spy (on the deserializer the server's ParseInterceptor calls) sees the call in progress and
    never the refused one.

    Deliberate break: `maximum_concurrent_rpcs=None` in `server/edge/server.py` fails it: the second call is
    parsed (the spy sees "Steuerpult")."""
    parsed: list[list[str]] = []
    parsing = interceptors.ParseInterceptor._parsing

    def spying(self: interceptors.ParseInterceptor, handler: grpc.RpcMethodHandler, path: str) -> object:
        parse = handler.request_deserializer

        def spy(raw: bytes) -> object:
            assert parse is not None, "every method here parses its request"
            message = parse(raw)
            parsed.append(list(getattr(message, "texts", [])))
            return message

        return parsing(self, handler._replace(request_deserializer=spy), path)  # type: ignore[attr-defined]

    monkeypatch.setattr(interceptors.ParseInterceptor, "_parsing", spying)
    base = fake_model(tiny_model_dir)
    gated = GatedRunner(runner_of(base))
    with running_server(
        LoadedModel(gated, base.tokenizer, base.description), config(limits=LimitsConfig(max_concurrent_rpcs=1))
    ) as served:
        gated.close_gate()
        in_flight = served.stub.Translate.future(request(["Das Haus ist groß."]))
        gated.wait_for_step()
        refused = status_of(lambda: served.stub.Translate(request(["Steuerpult"]), timeout=10))
        assert parsed == [["Das Haus ist groß."]], "the refused call was read"
        gated.gate.set()
        assert in_flight.result(30).results[0].sentences == 1
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED  # retryable: the same call succeeds later


def engine_draining(served: RunningServer) -> bool:
    """The drain has begun (health turned NOT_SERVING before it): the service refuses every new call."""
    engine = served.server.engine
    return engine is not None and engine.draining


def refused_while_draining(call: Callable[[], object]) -> grpc.Call:
    """The failed call, with its status and trailing metadata."""
    try:
        call()
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call), "stub errors carry their status"
        return error
    raise AssertionError("the call succeeded while the server was draining")


class HeldTokenizer(Tokenizer):
    """Holds every encode until `release` is set: a request provably still being prepared."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.entered, self.release = threading.Event(), threading.Event()

    def encode_source(self, text: str, target_lang: str, source_lang: str | None = None) -> list[int]:
        self.entered.set()
        if not self.release.wait(START_TIMEOUT_S):
            raise TimeoutError("the test never released the tokenizer")
        return super().encode_source(text, target_lang, source_lang)


def test_a_request_still_being_prepared_when_the_drain_begins_is_translated(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call admitted before the drain began is translated, however long its preparation takes.

    Deliberate break: `AdmissionLedger.accept` refusing every submit once draining (`if stopping or draining`)
    fails it: the admitted call was answered UNAVAILABLE. The SIGTERM test cannot tell such a call from one
    that arrived after the signal, and passed with the break."""
    monkeypatch.setattr(preparation, "INLINE_PREPARE_CHARS", 0)  # every preparation in a worker, as a long one
    base = fake_model(tiny_model_dir)
    held = HeldTokenizer(tiny_model_dir / TOKENIZER_FILE)
    with running_server(LoadedModel(base.runner, held, base.description), config()) as served:
        in_flight = served.stub.Translate.future(request(["Das Haus ist groß. Er wartete."]))
        assert held.entered.wait(30)
        drained = served.start(served.server.shutdown(30.0))
        wait_until(lambda: engine_draining(served))
        refused = status_of(lambda: served.stub.Translate(request(["Steuerpult"])))
        held.release.set()
        assert in_flight.result(30).results[0].sentences == 2
        assert drained.result(30) is True
    assert refused.code == grpc.StatusCode.UNAVAILABLE  # a call that arrives after the drain began


def test_when_the_drain_grace_runs_out_the_rest_fails_unavailable_and_is_counted_so(tiny_model_dir: Path) -> None:
    base = fake_model(tiny_model_dir)
    slow = GatedRunner(runner_of(base), delay=1.0)  # every step 1 s: the request outlasts the grace
    with running_server(LoadedModel(slow, base.tokenizer, base.description), config()) as served:
        slow.close_gate()  # forget the warmup's steps
        in_flight = served.stub.Translate.future(request(["Das Haus ist groß.", "Geheimpolizei", "Steuerpult"]))
        slow.wait_for_step()
        slow.gate.set()
        drained = served.start(served.server.shutdown(0.3))
        error = status_of(lambda: in_flight.result(30))
        assert drained.result(30) is False
        counted = sample_value(
            served.registry, "translation_requests_total", method="Translate", code="UNAVAILABLE", lang_pair="de-en"
        )
    assert (error.code, error.details) == (grpc.StatusCode.UNAVAILABLE, SHUTDOWN_MESSAGE)
    assert counted == 1


def test_a_response_over_the_send_limit_is_refused_with_advice_and_counted_so(model: LoadedModel) -> None:
    text = "Ja." + "\n" * 1500 + "Nein."  # every hypothesis repeats the whitespace between the sentences
    with running_server(model, config(limits=LimitsConfig(max_message_bytes=4096))) as served:
        error = status_of(lambda: served.stub.Translate(request([text], num_hypotheses=4)))
        streamed = list(served.stub.TranslateStream(request([text, text], num_hypotheses=1)))
        counted = sample_value(
            served.registry,
            "translation_requests_total",
            method="Translate",
            code="RESOURCE_EXHAUSTED",
            lang_pair="de-en",
        )
        reasons = rejections(served)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "over the server's limit of 4,096" in error.details and "TranslateStream" in error.details
    assert counted == 1
    assert reasons == {"queue_full": 0, "response_too_large": 1}  # not an overload: the queue-full alert stays quiet
    assert [m.result.translation.count("\n") for m in streamed] == [1500, 1500]  # one text per message fits
    with running_server(model, config(limits=LimitsConfig(max_message_bytes=4096))) as served:
        too_big = status_of(lambda: list(served.stub.TranslateStream(request([text], num_hypotheses=4))))
    assert too_big.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "TranslateStream" not in too_big.details
    assert "split the text across requests or ask for fewer hypotheses" in too_big.details  # advice that can work


def test_reflection_lists_the_service_and_can_be_turned_off(model: LoadedModel) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with running_server(model, config()) as served:
        services = ProtoReflectionDescriptorDatabase(served.channel).get_services()
        assert SERVICE_NAME in services and "grpc.health.v1.Health" in services
    with running_server(model, config(serving=loopback(reflection=False))) as served:
        with pytest.raises(grpc.RpcError) as info:
            ProtoReflectionDescriptorDatabase(served.channel).get_services()
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_messages_over_the_size_limit_are_refused(model: LoadedModel) -> None:
    with running_server(model, config(limits=LimitsConfig(max_message_bytes=4096))) as served:
        error = status_of(lambda: served.stub.Translate(request(["Hallo. " * 1000])))
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert served.stub.Translate(request(["Hallo."])).results[0].sentences == 1
        (info,) = served.stub.ListModels(pb.ListModelsRequest()).models
    assert info.limits.max_message_bytes == 4096  # what a client checks before sending, not after a refusal


def test_a_queue_smaller_than_a_request_limits_the_request_not_retries_it(model: LoadedModel) -> None:
    """Broken once on purpose (the sentence limit left at 512 over a queue of 4), ListModels reported 512."""
    with running_server(model, config(engines=EnginesConfig(max_queue=4))) as served:
        (info,) = served.stub.ListModels(pb.ListModelsRequest()).models
        error = status_of(lambda: served.stub.Translate(request(["Ja. Nein. Gut. Schön. Aus."], beam_size=1)))
        four = served.stub.Translate(request(["Ja. Nein. Gut. Schön."], beam_size=1))
    assert info.limits.max_sentences_per_request == 4
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "more than 4 sentences" in error.details
    assert four.results[0].sentences == 4


@pytest.mark.parametrize(("runner_slots", "flag_slots"), [(2, 8), (8, 2)])
def test_a_server_with_fewer_slots_than_the_default_beam_decodes_unset_beams_narrower(
    tiny_model_dir: Path, runner_slots: int, flag_slots: int
) -> None:
    """Fewer slots (the runner's or the flag's) than the default beam of 4: a request that sets no beam
    is served with the widest beam that fits, and ListModels reports the slots the engine really has."""
    model = fake_model(tiny_model_dir, max_slots=runner_slots)
    with running_server(model, config(engines=EnginesConfig(max_slots=flag_slots))) as served:
        (info,) = served.stub.ListModels(pb.ListModelsRequest()).models
        unset = served.stub.Translate(request([TEXTS[0]], num_hypotheses=2))
        error = status_of(lambda: served.stub.Translate(request([TEXTS[0]], beam_size=4)))
    assert info.limits.max_beam_size == 2
    assert [h.text for h in unset.results[0].hypotheses] == [t for t, _ in expected_hypotheses(model, TEXTS[0], 2)]
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "beam_size must be in 1..2, got 4" in error.details


def test_request_limits_match_the_proto_documentation() -> None:
    limits = RequestLimits()
    proto = (Path(__file__).resolve().parent.parent / "protos/translation/v1/translation.proto").read_text()
    assert f"at most {limits.max_texts} texts per request" in proto
    assert f"at most {limits.max_chars_per_text:,} characters per text" in proto
    assert f"at most {limits.max_markup_chars_per_text:,} characters per document" in proto
    assert f"at most {limits.max_sentences} sentences per request" in proto
    assert f"beam_size 1..{limits.max_beam_size}" in proto


@pytest.mark.process
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_in_flight_requests_then_exits(tiny_model_dir: Path, sig: signal.Signals) -> None:
    """The signal comes after the call's first partial output and before its first result: it is provably
    decoding (ordering, not a sleep), and it still gets every result."""
    with server_process(tiny_model_dir) as (process, address), grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TranslatorStub(channel)
        assert stub.Translate(request(["Hallo."], beam_size=1), timeout=30).results[0].sentences == 1
        texts = ["Das Haus ist groß.", "Er wartete.", "Geheimpolizei"]
        in_flight = stub.TranslateStream(request(texts, stream_tokens=True), timeout=60)
        assert next(iter(in_flight)).HasField("partial")  # decoding, no text done yet
        process.send_signal(sig)
        results = [m.result for m in in_flight if m.HasField("result")]
        assert sorted((r.index, r.sentences) for r in results) == [(0, 1), (1, 1), (2, 1)]
        assert process.wait(60) == 0


@pytest.mark.process
def test_an_open_health_watch_does_not_hold_the_exit_for_the_drain_grace(tiny_model_dir: Path) -> None:
    """Client-side health checking keeps a `Health.Watch` stream open on every connection; a stream that never
    ends on its own must not keep an idle server's shutdown waiting out the whole drain grace (30 s here)."""
    with server_process(tiny_model_dir) as (process, address), grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert process.wait(15) == 0  # half the test server's 30 s drain grace: the open watch held nothing
        with pytest.raises(grpc.RpcError):
            next(watch)  # ended by the server's stop


@pytest.mark.process
def test_a_dead_engine_stops_the_process_non_zero_so_its_supervisor_restarts_it(tiny_model_dir: Path) -> None:
    with server_process(tiny_model_dir) as (process, address), grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TranslatorStub(channel)
        assert stub.Translate(request(["Hallo."], beam_size=1), timeout=30).results[0].sentences == 1
        process.send_signal(signal.SIGUSR1)  # tests.serving: the next step raises past the engine's recovery
        error = status_of(lambda: stub.Translate(request(["Das Haus ist groß."], beam_size=1), timeout=30))
        assert error.code == grpc.StatusCode.UNAVAILABLE and "engine failed" in error.details
        assert process.wait(60) == 1
        assert process.stderr is not None
        last_line = process.stderr.read().strip().splitlines()[-1]
        assert last_line.startswith("translate-server: a decoding engine died or hung"), last_line


@pytest.mark.process
def test_healthcheck_command_exits_zero_only_when_serving(served: RunningServer) -> None:
    def healthcheck(address: str) -> int:
        command = [sys.executable, "-m", "server.edge.healthcheck", "--address", address, "--timeout", "5"]
        return subprocess.run(command, capture_output=True, timeout=60, check=False).returncode

    assert healthcheck(served.address) == 0
    assert healthcheck("localhost:1") == 1


def test_stream_sends_a_text_as_soon_as_it_is_done_not_in_request_order(
    served: RunningServer, model: LoadedModel
) -> None:
    from tests.tiny import TINY_PAIRS

    spec, tokenizer = model.runner.spec, model.tokenizer

    def output_len(text: str) -> int:
        return len(reference_decode(tokenizer.encode_source(text, "en"), 1, 1.0, spec.max_target_len, spec)[0].tokens)

    by_length = sorted((de for de, _ in TINY_PAIRS), key=output_len)
    short, long = by_length[0], by_length[-1]
    assert output_len(short) < output_len(long), "the fixture needs two outputs of different lengths"
    messages = list(served.stub.TranslateStream(request([long, short], beam_size=1)))
    assert [m.result.index for m in messages] == [1, 0]  # both start together; the short one finishes first


@pytest.fixture(scope="module")
def onnx_served(tiny_model_dir: Path) -> Iterator[tuple[RunningServer, LoadedModel]]:
    """The real runtime: the tiny model exported to ONNX (fp32) on CPU, its caches where the default puts them
    (the working batch)."""
    export_tiny_onnx(tiny_model_dir)
    model = onnx_model(tiny_model_dir)
    with running_server(model, config()) as running:
        yield running, model


@pytest.mark.parametrize(("beam", "n_best"), [(1, 1), (3, 2)])
def test_served_output_equals_the_offline_onnx_decoder(
    onnx_served: tuple[RunningServer, LoadedModel], tiny_model_dir: Path, beam: int, n_best: int
) -> None:
    from server.backend.working_batch import WorkingBatchRunner
    from server.core.offline import translate_ids

    served, model = onnx_served
    texts = ["Das Haus ist groß. Er wartete.", "Geheimpolizei", "", "Sie schrieben gemeinsam ein Buch."]
    reply = served.stub.Translate(request(texts, beam_size=beam, num_hypotheses=n_best, return_scores=True))
    runner = WorkingBatchRunner(tiny_model_dir / "onnx" / "fp32", max_slots=8)  # a runner of its own: no shared state
    tokenizer = model.tokenizer
    for text, result in zip(texts, reply.results, strict=True):
        parts = split(text, "de")
        if not parts.pieces:
            assert result.translation == text
            continue
        sources = [tokenizer.encode_source(p, "en") for p in parts.pieces]
        offline = translate_ids(runner, sources, beam, 1.0, None, n_best)  # None: the server's default limit
        want = []
        for rank in range(n_best):
            chosen = [hyps[min(rank, len(hyps) - 1)] for hyps in offline]
            pieces = [tokenizer.decode(list(h.tokens)) for h in chosen]
            want.append((join(pieces, parts.separators), sum(h.normalized for h in chosen)))
        assert [h.text for h in result.hypotheses] == [t for t, _ in want]
        assert [h.score for h in result.hypotheses] == pytest.approx([s for _, s in want], abs=1e-4)
        assert result.translation == want[0][0]


def test_list_models_describes_the_onnx_runtime(
    onnx_served: tuple[RunningServer, LoadedModel], tiny_model_dir: Path
) -> None:
    from model.files import weights_sha256

    served, _ = onnx_served
    (info,) = served.stub.ListModels(pb.ListModelsRequest()).models
    assert (info.variant, info.provider, info.dtype) == ("fp32", "CPUExecutionProvider", "float32")
    assert info.model_sha256 == weights_sha256(tiny_model_dir)
    assert info.opset >= 17 and list(info.available_variants) == ["fp32"]


def exported_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model, exported, copied where a test may change its files."""
    export_tiny_onnx(tiny_model_dir)
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    return tmp_path / "model"


def test_the_models_tuned_length_penalties_load_and_stale_ones_stop_startup(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from model.files import weights_sha256

    model_dir = exported_copy(tiny_model_dir, tmp_path)
    tuned = {"length_penalty": {"en-de": 1.5}, "weights_sha256": weights_sha256(model_dir)}
    (model_dir / "decoding.json").write_text(json.dumps(tuned))
    assert onnx_model(model_dir).description.default_length_penalty == {"de-en": 1.0, "en-de": 1.5}
    (model_dir / "decoding.json").write_text(json.dumps(tuned | {"weights_sha256": "0" * 64}))
    with pytest.raises(StartupError, match="tuned on other weights"):
        onnx_model(model_dir)


def test_a_tokenizer_other_than_the_one_the_graphs_were_trained_with_stops_startup(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = exported_copy(tiny_model_dir, tmp_path)
    metadata = model_dir / "onnx" / "fp32" / "metadata.json"
    data = json.loads(metadata.read_text())
    assert data["model_config"]["tokenizer_sha256"]  # recorded in the export, from the artifact's config
    data["model_config"]["tokenizer_sha256"] = "0" * 64
    metadata.write_text(json.dumps(data))
    with pytest.raises(StartupError, match="is not the tokenizer the model was trained with"):
        onnx_model(model_dir)


def test_cuda_asked_for_but_fallen_back_to_cpu_stops_startup_and_auto_serves_on_cpu(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPU pod whose CUDA libraries do not load must not report SERVING while computing on the CPU."""
    import onnxruntime

    from server.backend.working_batch import WorkingBatchRunner
    from server.edge.loading import load_model

    export_tiny_onnx(tiny_model_dir)
    cuda = ServerConfig(engines=EnginesConfig(variant="fp32", provider="cuda", threads=1))
    with pytest.raises(StartupError, match=r"fell back to CPUExecutionProvider.*--provider cpu"):
        load_model(cuda, tiny_model_dir, in_process=True)
    # This onnxruntime has no CUDA provider; one that lists it but cannot load it falls back the same way.
    available = onnxruntime.get_available_providers()
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", *available])
    auto = ServerConfig(engines=EnginesConfig(variant="fp32", provider="auto", threads=1))
    runner = load_model(auto, tiny_model_dir, in_process=True).runner
    assert type(runner) is WorkingBatchRunner  # host caches, not the device's
    assert runner.provider == "CPUExecutionProvider"
    assert "serving on the CPU" in caplog.text


def test_the_metrics_server_binds_the_configured_host() -> None:
    from server.edge.transport import metrics_address

    assert [metrics_address(h) for h in ("[::]", "[::1]", "127.0.0.1", "")] == ["::", "::1", "127.0.0.1", "0.0.0.0"]


class _RecordingEngine:
    """Takes one submit and records how its handle is cancelled."""

    def __init__(self) -> None:
        self.cancelled_with: list[bool] = []
        self.submitted = False

    def submit(self, *args: object, **kwargs: object) -> _RecordingEngine:
        self.submitted = True
        return self

    def cancel(self, deadline_passed: bool = False) -> None:
        self.cancelled_with.append(deadline_passed)


class _Remaining:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def time_remaining(self) -> float:
        return self.seconds


@pytest.mark.parametrize(("remaining", "deadline"), [(0.0, True), (0.005, True), (5.0, False)])
def test_grpc_ending_a_call_cancels_its_request_with_the_right_reason(remaining: float, deadline: bool) -> None:
    """grpc cancels the handler's task at the deadline (or when the client leaves); the request's
    sentences must then fail as DEADLINE_EXCEEDED, or CANCELLED, in the failed-sentences series."""
    from server.core.admission_ledger import Admission
    from server.core.work import DecodeOptions
    from server.edge.convert import TranslateJob
    from server.edge.errors import CallRecord
    from server.edge.servicer import _engine_events

    engine = _RecordingEngine()
    job = TranslateJob(["Hallo."], "de", "en", "de", DecodeOptions(), return_scores=False)
    call = CallRecord(started=time.monotonic() - 1.0)  # a 1 s deadline, `remaining` of it left

    async def handler_cancelled_by_grpc() -> None:
        events = _engine_events(engine, Admission(1), [[5, 3]], job, _Remaining(remaining), call)  # type: ignore[arg-type]
        waiting = asyncio.ensure_future(events.__anext__())
        for _ in range(100):  # the task runs to its submit, then waits for the engine's first event
            if engine.submitted:
                break
            await asyncio.sleep(0)
        assert engine.submitted
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(handler_cancelled_by_grpc())
    assert engine.cancelled_with == [deadline]


def test_a_slow_reader_holds_one_partial_output_per_sentence_not_every_prefix() -> None:
    """The engine keeps producing while the client does not read: newer partial outputs replace the
    unread ones, every other event stays, in order, and a sentence's partial comes before its end."""

    async def scenario() -> list[object]:
        inbox = CallInbox(asyncio.get_running_loop())
        done = SentenceDone(0, [], 4)

        def engine_thread() -> None:
            for n in range(1, 200):
                inbox.deliver(TokensEvent(0, tuple(range(n))))
                inbox.deliver(TokensEvent(1, tuple(range(n // 2))))
            inbox.deliver(TokensEvent(0, tuple(range(300))))
            inbox.deliver(done)
            inbox.deliver(RequestDone())

        await asyncio.to_thread(engine_thread)
        await asyncio.sleep(0)  # the scheduled puts run
        assert inbox._events.qsize() == 4  # two partials, the sentence's end and the request's
        return [await inbox.get() for _ in range(4)]

    events = asyncio.run(scenario())
    assert events == [TokensEvent(0, tuple(range(300))), TokensEvent(1, tuple(range(99))), SentenceDone(0, [], 4),
                      RequestDone()]  # fmt: skip


def test_the_drain_is_not_queued_behind_request_preparation(tiny_model_dir: Path) -> None:
    """asyncio's default pool splits and tokenizes requests; a drain waiting behind a full pool would
    start late, and grpc's grace could cancel the calls it should have let finish."""
    with running_server(fake_model(tiny_model_dir), config()) as served:
        blocked = threading.Event()
        release = threading.Event()

        def preparing() -> None:
            blocked.set()
            release.wait(START_TIMEOUT_S)

        async def fill_default_pool() -> None:
            loop = asyncio.get_running_loop()
            loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
            loop.run_in_executor(None, preparing)

        served.run(fill_default_pool())
        assert blocked.wait(30)
        try:
            assert served.run(served.server.shutdown(5.0), timeout=30) is True
        finally:
            release.set()


def test_what_is_alive_once_serving_is_frozen_out_of_the_collectors_sight(model: LoadedModel) -> None:
    """`serve` freezes the objects startup left (server.core.gc_pauses.freeze_startup_objects) once it serves: a full
    collection during a burst then walks only what the calls allocated."""
    import gc
    import os

    from server.edge.server import serve

    def on_serving() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # serve's own handler: drain and return

    gc.unfreeze()
    before = gc.get_freeze_count()
    config = server_config(serving=loopback(drain_seconds=1.0, shutdown_delay_seconds=0.0))
    try:
        asyncio.run(serve(config, model, on_serving))
        frozen = gc.get_freeze_count()
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
    assert before == 0 and frozen > 10_000, (before, frozen)
