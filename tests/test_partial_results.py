"""TranslateRequest.allow_partial: a text refused by a rule of its own (a limit, detection) comes back with its
TextResult.error while the others are translated; without it, one such text fails the whole call as before."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import grpc
import pytest

from server.proto.translation.v1 import translation_pb2 as pb
from tests.serving import RunningServer, fake_model, request, running_server, sample_value, status_of

GERMAN = ["Ich habe heute keine Zeit für dich.", "Wo ist der nächste Bahnhof?", "Das Haus ist sehr groß."]
SPANISH = "¿Dónde está la estación de tren?"  # detected as Spanish, which no served model reads
OVER_LONG = "Das Haus ist alt. " * 600  # 10,800 characters: over the 10,000 per text
TOO_MANY_SENTENCES = "Das Haus ist alt. " * 513  # within the characters, over the request's 512 sentences
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(fake_model(tiny_model_dir)) as server:
        yield server


def partial_request(texts: list[str], source: str = "auto", **options: object) -> pb.TranslateRequest:
    message = request(texts, source, "en", beam_size=2, **options)
    message.allow_partial = True
    return message


def refusal(served: RunningServer, texts: list[str], source: str = "auto", **options: object) -> str:
    """The status message the call fails with without allow_partial (it must fail with INVALID_ARGUMENT)."""
    failed = status_of(partial(served.stub.Translate, request(texts, source, "en", beam_size=2, **options)))
    assert failed.code == grpc.StatusCode.INVALID_ARGUMENT, failed
    return failed.details


def outcomes(results: list[pb.TextResult]) -> list[tuple[int, str, int, str]]:
    return [(r.index, r.translation, r.error.code, r.error.message) for r in sorted(results, key=lambda r: r.index)]


def test_a_foreign_and_an_over_long_text_are_refused_alone_and_the_others_translated(served: RunningServer) -> None:
    """Broken before: either text failed all four, and allow_partial did not exist."""
    texts = [GERMAN[0], SPANISH, OVER_LONG, GERMAN[1]]
    reply = served.stub.Translate(partial_request(texts)).results
    alone = served.stub.Translate(request([GERMAN[0], GERMAN[1]], "de", "en", beam_size=2)).results
    assert [r.index for r in reply] == [0, 1, 2, 3]
    assert [reply[0].translation, reply[3].translation] == [r.translation for r in alone]
    assert not reply[0].HasField("error") and not reply[3].HasField("error")
    assert [(r.translation, r.sentences, r.error.code) for r in reply[1:3]] == [("", 0, INVALID_ARGUMENT)] * 2
    # the same words the all-or-nothing call is refused with: the over-long text first, then the Spanish one
    assert reply[2].error.message == refusal(served, texts)
    assert reply[1].error.message == refusal(served, [GERMAN[0], SPANISH])
    assert "texts[1] detected as 'es'" in reply[1].error.message
    assert reply[2].error.message.startswith("texts[2] has 10800 characters, over the limit of 10000 per text")


def test_streaming_sends_one_message_per_refused_text(served: RunningServer) -> None:
    texts = [GERMAN[0], SPANISH, OVER_LONG, GERMAN[1]]
    streamed = [m.result for m in served.stub.TranslateStream(partial_request(texts)) if m.HasField("result")]
    unary = served.stub.Translate(partial_request(texts)).results
    assert len(streamed) == 4
    assert outcomes(streamed) == outcomes(list(unary))
    assert [code for _, _, code, _ in outcomes(streamed)] == [0, INVALID_ARGUMENT, INVALID_ARGUMENT, 0]
    with pytest.raises(grpc.RpcError) as failed:
        list(served.stub.TranslateStream(request(texts, "auto", "en", beam_size=2)))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_text_past_the_sentence_limit_is_refused_alone_where_the_source_is_named(served: RunningServer) -> None:
    """Refused in preparation (splitting), after routing: the texts after it still fit and are translated."""
    texts = [GERMAN[0], TOO_MANY_SENTENCES, GERMAN[2]]
    reply = served.stub.Translate(partial_request(texts, "de")).results
    alone = served.stub.Translate(request([GERMAN[0], GERMAN[2]], "de", "en", beam_size=2)).results
    assert [reply[0].translation, reply[2].translation] == [r.translation for r in alone]
    assert (reply[1].translation, reply[1].error.code) == ("", INVALID_ARGUMENT)
    assert reply[1].error.message == refusal(served, texts, "de")
    assert "limit reached at texts[1]" in reply[1].error.message


def test_a_document_over_the_markup_limits_is_refused_alone(served: RunningServer) -> None:
    """HTML: a document nested too deep, and one that takes the request past its units, each refused alone."""
    html = pb.TEXT_TYPE_HTML
    deep = "<div>" * 300 + "Das Haus ist groß." + "</div>" * 300
    many_units = "".join("<p>Das Haus.</p>" for _ in range(513))
    good = [f"<p>{text}</p>" for text in GERMAN]
    texts = [good[0], deep, good[1], many_units, good[2]]
    reply = served.stub.Translate(partial_request(texts, "de", text_type=html)).results
    alone = served.stub.Translate(request(good, "de", "en", beam_size=2, text_type=html)).results
    assert [reply[i].translation for i in (0, 2, 4)] == [r.translation for r in alone]
    assert [(reply[i].translation, reply[i].error.code) for i in (1, 3)] == [("", INVALID_ARGUMENT)] * 2
    assert reply[1].error.message == refusal(served, texts, "de", text_type=html)
    # the units of the documents up to the one refused, which the all-or-nothing call counts alike
    assert reply[3].error.message == refusal(served, [good[0], good[1], many_units], "de", text_type=html)
    assert reply[3].error.message.startswith("the request's markup has 515 units to translate")


def test_a_request_whose_every_text_is_refused_answers_each(served: RunningServer) -> None:
    reply = served.stub.Translate(partial_request([OVER_LONG, OVER_LONG], "de")).results
    assert [(r.index, r.error.code) for r in reply] == [(0, INVALID_ARGUMENT), (1, INVALID_ARGUMENT)]


def test_refused_texts_are_counted_by_code(served: RunningServer) -> None:
    before = sample_value(served.registry, "translation_text_errors_total", code="INVALID_ARGUMENT")
    served.stub.Translate(partial_request([GERMAN[0], SPANISH, OVER_LONG]))
    after = sample_value(served.registry, "translation_text_errors_total", code="INVALID_ARGUMENT")
    assert after - before == 2


def test_what_concerns_the_whole_request_still_fails_the_call(served: RunningServer) -> None:
    """Options out of range and a target no model writes are the request's, not a text's: the over-long text beside
    them does not turn the call into per-text results."""
    wide, nowhere = partial_request([GERMAN[0], OVER_LONG], "de"), partial_request([GERMAN[0], OVER_LONG])
    wide.options.beam_size, nowhere.options.target_language = 99, "xx"
    for message, words in ((wide, "beam_size"), (nowhere, "no served model translates into target_language 'xx'")):
        failed = status_of(partial(served.stub.Translate, message))
        assert failed.code == grpc.StatusCode.INVALID_ARGUMENT and words in failed.details, failed
