"""Hostile and odd input over real gRPC: every request gets its documented status or a translation,
one result per text, and the server stays up.

The named invalid requests (empty, too many texts, text over the limit, unknown pair, same
language, bad options) and an over-size message followed by a small one are proven in
test_servicer.py; this file adds odd characters, raw bytes that do not parse, a property test over
texts and options, and a fuzz pass over serialized requests.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from model.directory import DEFAULT_LENGTH_PENALTY, MAX_LENGTH_PENALTY
from model.tokenizer import TOKENIZER_FILE, Tokenizer
from server.core.offline import translate_ids
from server.core.work import InvalidWorkError, check_sources
from server.edge.errors import MALFORMED_MESSAGE, status_for
from server.edge.loading import LoadedModel
from server.proto.translation.v1 import translation_pb2 as pb
from server.text.documents import RequestLimits, TextLimitError, model_text, prepare_texts
from server.text.splitter import join, translatable
from tests.fakes import FAKE_SPEC, FakeRunner, reference_decode
from tests.serving import (
    RunningServer,
    fake_model,
    health_status,
    request,
    running_server,
    sample_value,
    server_config,
    status_of,
)
from tests.tiny import TINY_PAIRS

MAX_TARGET_LEN = 12  # fake_model's default
TRANSLATE = "/translation.v1.Translator/Translate"
STREAM = "/translation.v1.Translator/TranslateStream"
LIST_MODELS = "/translation.v1.Translator/ListModels"


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(fake_model(tiny_model_dir), server_config()) as running:
        yield running


def raw_unary(served: RunningServer, method: str) -> Callable[..., bytes]:
    """A call that sends bytes as they are, without serializing (nor checking) them on the client."""
    return served.channel.unary_unary(method, request_serializer=None, response_deserializer=None)


def raw_stream(served: RunningServer, method: str) -> Callable[..., Iterable[bytes]]:
    return served.channel.unary_stream(method, request_serializer=None, response_deserializer=None)


def assert_still_serving(served: RunningServer) -> None:
    assert health_status(served.channel, "") == "SERVING"
    assert served.stub.Translate(request(["Das Haus ist groß."], beam_size=1), timeout=30).results[0].sentences == 1


ODD_TEXTS = {
    "nul": "Das\x00Haus ist\x00 groß.",
    "control characters": "Das \x01\x02\x07\x1b[31mHaus\x1b[0m\x7f ist groß.",
    "bidi marks": "\u202eDas Haus ist groß.\u202c \u200fEr wartete.\u200e \u2066Geheimpolizei\u2069",
    "zero width": "Das\u200b Haus\u200d ist\ufeff groß.",
    "emoji": "Das Haus 🏠 ist groß 👍🏽. 👨‍👩‍👧‍👦",
    "mixed scripts": "Das Haus Москва 東京 ist groß. مرحبا Ελλάδα.",
    "combining marks": "Das Hau\u0308s ist gro\u00dfe\u0301\u0301\u0301.",
    "unpaired brackets": "Das (Haus [ist {groß.",
    "only punctuation": "?!... --- ;;;",
    "odd line breaks": "Das Haus.\r\nEr wartete.\u2028Geheimpolizei\u2029Steuerpult\x0b\x0c",
    "whitespace only": " \t\u00a0\u3000\n",
    "private use and noncharacters": "Das \ue000 Haus \ufdd0 ist \U0010fffd groß.",
    "language tags typed in the text": "Das Haus <2de> ist <2en> groß.",
}


def expected_translation(text: str, beam: int, model: LoadedModel) -> str:
    """`text` translated without the server: its sentences (as the server splits and cleans them) decoded
    one by one by the fake model's reference decoder, detokenized and put back between their separators."""
    spec, tokenizer = model.runner.spec, model.tokenizer
    (prepared,) = prepare_texts([text], "de", "en", tokenizer, RequestLimits(), spec.max_source_len)
    best = [reference_decode(ids, beam, DEFAULT_LENGTH_PENALTY, MAX_TARGET_LEN, spec)[0] for ids in prepared.sources]
    return join([tokenizer.decode(list(h.tokens)) for h in best], prepared.split.separators)


def test_odd_characters_are_translated_one_result_per_text(served: RunningServer, tiny_model_dir: Path) -> None:
    """Each odd text's answer is its own translation, in Translate and TranslateStream alike.

    Deliberate break: an empty translation for every text that was translated (`text_result_to_pb` in
    `server/edge/convert.py`) fails this test on the first text; the former index-and-count checks passed."""
    model = fake_model(tiny_model_dir)
    texts = list(ODD_TEXTS.values())
    reply = served.stub.Translate(request(texts, beam_size=2), timeout=30)
    streamed = served.stub.TranslateStream(request(texts, beam_size=1, stream_tokens=True), timeout=30)
    by_index = {m.result.index: m.result for m in streamed if m.HasField("result")}
    assert [r.index for r in reply.results] == list(range(len(texts))) == sorted(by_index)
    for index, text in enumerate(texts):
        assert reply.results[index].translation == expected_translation(text, 2, model), text
        assert by_index[index].translation == expected_translation(text, 1, model), text
    assert_still_serving(served)


@pytest.mark.parametrize("name", list(ODD_TEXTS))
def test_each_odd_text_alone_is_translated(served: RunningServer, tiny_model_dir: Path, name: str) -> None:
    text = ODD_TEXTS[name]
    (result,) = served.stub.Translate(request([text], beam_size=1), timeout=30).results
    assert result.index == 0
    assert (result.sentences == 0) == (not translatable(text)), "only texts with nothing to translate skip the model"
    assert result.translation == expected_translation(text, 1, fake_model(tiny_model_dir))
    if not translatable(text):
        assert result.translation == text


NOTHING_TO_TRANSLATE = [
    "\x00" * 5,
    "?!... --- ;;;",
    "\u200b\u200d\ufeff",
    " \x07 \x1b \x7f\x9b ",
    "👍🏽 👨\u200d👩\u200d👧",
    "« — » …",
    "\t \u00a0\n",
    "",
]


def test_texts_with_nothing_to_translate_come_back_verbatim_without_running_the_model(tiny_model_dir: Path) -> None:
    """No letter or digit: Translate and TranslateStream give the text itself, one hypothesis scored 0, zero counts."""
    model = fake_model(tiny_model_dir)
    runner = model.runner
    assert isinstance(runner, FakeRunner)
    texts = NOTHING_TO_TRANSLATE
    message = request(texts, beam_size=2, num_hypotheses=2, return_scores=True, stream_tokens=True)
    with running_server(model, server_config()) as served:
        before = (len(runner.encode_calls), runner.step_calls)  # after warmup
        unary = list(served.stub.Translate(message, timeout=30).results)
        streamed = list(served.stub.TranslateStream(message, timeout=30))
        assert all(m.HasField("result") for m in streamed), "nothing decoded, so no partial output"
        for results in (unary, sorted((m.result for m in streamed), key=lambda r: r.index)):
            assert [r.index for r in results] == list(range(len(texts)))
            assert [r.translation for r in results] == texts
            assert [[(h.text, h.score) for h in r.hypotheses] for r in results] == [[(t, 0.0)] for t in texts]
            assert {(r.sentences, r.input_tokens, r.output_tokens) for r in results} == {(0, 0, 0)}
        assert (len(runner.encode_calls), runner.step_calls) == before, "the model ran"
        assert sample_value(served.registry, "translation_input_tokens_total", lang_pair="de-en") == 0


def test_a_sentence_with_nothing_to_translate_stays_verbatim_inside_a_translated_text(served: RunningServer) -> None:
    first, second = served.stub.Translate(request(["Er kam.", "Dann ging er."], beam_size=1), timeout=30).results
    message = request(["Er kam. ... Dann ging er.\n---"], beam_size=1)
    (result,) = served.stub.Translate(message, timeout=30).results
    (streamed,) = [m.result for m in served.stub.TranslateStream(message, timeout=30) if m.HasField("result")]
    expected = f"{first.translation} ... {second.translation}\n---"
    assert (result.translation, streamed.translation) == (expected, expected)
    assert (result.sentences, result.input_tokens) == (2, first.input_tokens + second.input_tokens)


def test_control_and_format_characters_are_removed_before_tokenization(
    served: RunningServer, tiny_model_dir: Path
) -> None:
    dirty = "\u202eDas\x00 Haus\x1b ist\u200b gro\u00adß."  # bidi override, NUL, ESC, zero-width space, soft hyphen
    clean = "Das Haus ist groß."
    assert model_text(dirty) == clean and model_text("Das\tHaus") == "Das\tHaus"  # whitespace controls stay
    tokenizer = Tokenizer(tiny_model_dir / TOKENIZER_FILE)
    assert tokenizer.encode_source(dirty, "en") != tokenizer.encode_source(clean, "en"), "the test must mean something"
    (prepared,) = prepare_texts([dirty], "de", "en", tokenizer, RequestLimits(), 48)
    assert prepared.sources == [tokenizer.encode_source(clean, "en")]
    message = request([dirty, clean], beam_size=2)
    streamed = sorted(
        (m.result for m in served.stub.TranslateStream(message, timeout=30) if m.HasField("result")),
        key=lambda r: r.index,
    )
    for pair in (list(served.stub.Translate(message, timeout=30).results), streamed):
        # the same sentence to the model; the bidi override before it is no part of it and stays before it
        assert (pair[0].translation, pair[0].input_tokens) == ("\u202e" + pair[1].translation, pair[1].input_tokens)


MALFORMED = {
    "invalid UTF-8 in a text": b"\x0a\x04\xff\xfe\xc0\xaf",  # texts[0] = 4 bytes that are not UTF-8
    "invalid UTF-8 in a language": b"\x0a\x02ok\x12\x04\x0a\x02\xc3\x28",  # options.source_language
    "truncated field": b"\x0a\x10Das Haus",
    "bad wire type": b"\x0f\xff\xff\xff",
    "runaway varint": b"\x18" + b"\xff" * 11,
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_bytes_that_do_not_parse_are_invalid_argument(served: RunningServer, case: str) -> None:
    payload = MALFORMED[case]
    for call in (raw_unary(served, TRANSLATE), lambda p, **kw: list(raw_stream(served, STREAM)(p, **kw))):
        error = status_of(lambda: call(payload, timeout=10))  # noqa: B023
        assert (error.code, error.details) == (grpc.StatusCode.INVALID_ARGUMENT, MALFORMED_MESSAGE)
    assert_still_serving(served)


@pytest.mark.parametrize(
    ("field", "value"),
    [("source_language", "de" * 5_000), ("target_language", "x" * 1_000_000), ("model", "m" * 300)],
)
def test_an_overlong_code_or_model_name_is_invalid_argument_before_routing(
    served: RunningServer, field: str, value: str
) -> None:
    """Broken once on purpose (no length check), a 1 MB code came back echoed in the message: past gRPC's 16 KB
    of metadata the client saw RESOURCE_EXHAUSTED (which says "retry"), and routing's cache kept the code."""
    options = pb.TranslationOptions(source_language="de", target_language="en")
    setattr(options, field, value)
    error = status_of(lambda: served.stub.Translate(pb.TranslateRequest(texts=["Hallo."], options=options), timeout=30))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"options.{field} is {len(value):,} characters long, over the limit of" in error.details
    assert len(error.details) < 200
    assert_still_serving(served)


def test_codes_are_trimmed_before_routing(served: RunningServer) -> None:
    padded = served.stub.Translate(request(["Das Haus ist groß."], " de ", "en\t", beam_size=1), timeout=30)
    plain = served.stub.Translate(request(["Das Haus ist groß."], "de", "en", beam_size=1), timeout=30)
    assert padded.results[0].translation == plain.results[0].translation


def option_errors(options: dict[str, object]) -> bool:
    """Whether the options break a documented rule (independently of the texts)."""
    beam = options.get("beam_size", 4)
    penalty = options.get("length_penalty", DEFAULT_LENGTH_PENALTY)
    n_best = options.get("num_hypotheses", 1)
    assert isinstance(beam, int) and isinstance(penalty, float) and isinstance(n_best, int)
    return not (
        1 <= beam <= RequestLimits().max_beam_size
        and math.isfinite(penalty)
        and 0.0 <= penalty <= MAX_LENGTH_PENALTY
        and 1 <= n_best <= beam
        and int(options.get("max_output_len", 0)) <= MAX_TARGET_LEN  # type: ignore[call-overload]
    )


sentences = [t for pair in TINY_PAIRS for t in pair]
texts_strategy = st.lists(
    st.one_of(st.text(max_size=60), st.sampled_from(sentences), st.sampled_from(list(ODD_TEXTS.values()))),
    max_size=5,
)


def mostly(valid: st.SearchStrategy[object], anything: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    """Two draws in three within the documented range, so that many examples get as far as decoding."""
    return st.one_of(valid, valid, anything)


options_strategy = st.fixed_dictionaries(
    {},
    optional={
        "beam_size": mostly(st.integers(1, 3), st.integers(0, 10)),
        "length_penalty": mostly(st.floats(0.0, 2.0, width=32), st.floats(width=32)),
        "num_hypotheses": mostly(st.integers(1, 2), st.integers(0, 10)),
        "max_output_len": mostly(st.integers(0, MAX_TARGET_LEN), st.integers(0, 2**32 - 1)),
        "return_scores": st.booleans(),
        "stream_tokens": st.booleans(),
    },
)
pairs_strategy = mostly(
    st.sampled_from([("de", "en"), ("en", "de")]),
    st.sampled_from([("de", "de"), ("de", "fr"), ("", "en"), ("auto", "de"), ("de", "")]),
)
SERVED = (("de", "en"), ("en", "de"))


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=texts_strategy, options=options_strategy, pair=pairs_strategy, stream=st.booleans())
def test_any_texts_and_options_get_a_documented_answer(
    served: RunningServer, texts: list[str], options: dict[str, object], pair: tuple[str, str], stream: bool
) -> None:
    message = request(texts, pair[0], pair[1], **options)
    detected = pair[0] in ("", "auto") and pair[1] in ("de", "en")  # each text's source detected
    invalid = not texts or (pair not in SERVED and not detected) or option_errors(options)
    try:
        if stream:
            results = [m.result for m in served.stub.TranslateStream(message, timeout=30) if m.HasField("result")]
        else:
            results = list(served.stub.Translate(message, timeout=30).results)
    except grpc.RpcError as error:
        event("refused")  # --hypothesis-show-statistics shows how the examples split
        assert isinstance(error, grpc.Call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        if not invalid:  # valid options: only a text whose language detection cannot tell or no model serves
            # into the target may be refused (a sentence over the token limit is translated in parts)
            reasons = ("cannot tell the language", "detected as")
            assert any(reason in (error.details() or "") for reason in reasons), error
        return
    event("translated")
    assert not invalid, "a request that breaks a documented rule was accepted"
    assert sorted(r.index for r in results) == list(range(len(texts))), "one result per text, none twice"
    for result in results:
        if not translatable(texts[result.index]):
            assert (result.translation, result.sentences) == (texts[result.index], 0)


def mutate(rng: random.Random, payload: bytes) -> bytes:
    data = bytearray(payload)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(4)
        at = rng.randrange(len(data) + 1)
        if kind == 0 and data:  # flip a bit
            data[at % len(data)] ^= 1 << rng.randrange(8)
        elif kind == 1:  # truncate
            del data[at:]
        elif kind == 2:  # insert random bytes
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        else:  # overwrite with a random byte
            data[at % max(len(data), 1) : at % max(len(data), 1) + 1] = bytes([rng.randrange(256)])
    return bytes(data)


def fuzz_payloads(count: int, seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    texts = ["Das Haus ist groß. Er wartete.", "Geheimpolizei"]
    valid = request(texts, beam_size=2, num_hypotheses=2).SerializeToString()
    payloads = [rng.randbytes(rng.randint(0, 64)) for _ in range(count // 3)]
    payloads += [mutate(rng, valid) for _ in range(count - len(payloads))]
    return payloads


def test_fuzzed_request_bytes_each_get_a_status_and_the_server_stays_up(served: RunningServer) -> None:
    methods: list[Callable[[bytes], object]] = [
        lambda p: raw_unary(served, TRANSLATE)(p, timeout=10),
        lambda p: list(raw_stream(served, STREAM)(p, timeout=10)),
        lambda p: raw_unary(served, LIST_MODELS)(p, timeout=10),
    ]
    codes: dict[grpc.StatusCode, int] = {}
    for n, payload in enumerate(fuzz_payloads(300)):
        try:
            methods[n % len(methods)](payload)
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
        codes[code] = codes.get(code, 0) + 1
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, codes
    assert codes.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 100, "the fuzz reached the parser"
    assert_still_serving(served)


def test_validation_errors_are_invalid_argument_and_a_bare_value_error_is_a_bug() -> None:
    message = "beam_size must be in [1, 8], got 9"
    assert status_for(InvalidWorkError(message)) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    too_long = "texts[0] sentence 2 is 300 tokens long, over the limit of 256 tokens per sentence"
    assert status_for(TextLimitError(too_long)) == (grpc.StatusCode.INVALID_ARGUMENT, too_long)
    assert status_for(ValueError("a bug's details"))[0] == grpc.StatusCode.INTERNAL  # not the caller's fault


def test_a_sentence_over_the_token_limit_is_cut_at_whitespace_or_between_characters(tiny_model_dir: Path) -> None:
    """A sentence of words without clause marks is cut at spaces; a run without a space (a URL, base64) between
    characters. Broken before: both were refused, "sentence 0 is N tokens long, over the limit of 48"."""
    tokenizer = Tokenizer(tiny_model_dir / TOKENIZER_FILE)
    words = " ".join(["Das Haus ist groß"] * 20) + "."
    blob = "Siehe " + "aGVsbG8gd29ybGQ" * 20 + "."
    for text, separator in ((words, " "), (blob, "")):
        (prepared,) = prepare_texts([text], "de", "en", tokenizer, RequestLimits(), 48)
        assert len(prepared.sources) > 2 and all(len(ids) <= 48 for ids in prepared.sources)
        assert set(prepared.split.separators[2:-1]) == {separator}
        assert join(prepared.split.pieces, prepared.split.separators) == text


@pytest.mark.parametrize("source", [[FAKE_SPEC.pad_id], [FAKE_SPEC.pad_id] * 5])
def test_a_source_of_padding_alone_is_refused_before_any_runner_decodes_it(source: list[int]) -> None:
    """Every position of such a source is masked out, so its encoder has nothing to attend to and each runner
    decodes it differently: offline callers (the edge's tokenizer never makes one) get the rule's refusal.
    A padding id among real tokens is masked like the rest of a padded batch, as every runner does."""
    refusal = f"a source needs a token other than padding (id {FAKE_SPEC.pad_id})"
    with pytest.raises(InvalidWorkError, match=re.escape(refusal)):
        check_sources([[4, 3], source], FAKE_SPEC)
    runner = FakeRunner()
    with pytest.raises(InvalidWorkError, match=re.escape(refusal)):
        translate_ids(runner, [[4, 3], source], beam_size=1, length_penalty=1.0, max_len=None)
    assert runner.step_calls == 0 and not runner.encode_calls
    check_sources([[4, FAKE_SPEC.pad_id, 3], [FAKE_SPEC.eos_id]], FAKE_SPEC)


@pytest.mark.parametrize(
    "text",
    [
        "من می\u200cخواهم به خانه بروم.",  # Persian: the non-joiner spells the verb prefix apart from its stem
        "क्\u200dष और क्\u200cष",  # Devanagari: the joiner and non-joiner choose a conjunct's form
        "নিশ্চিন্ত র\u200d্যাব",  # Bengali: the joiner forms the ya-phala after ra
    ],
)
def test_the_joiners_scripts_spell_with_reach_the_model(text: str) -> None:
    """U+200C and U+200D are spelling in these scripts: removed, the model sees another word. Broken once
    on purpose (no character kept as spelling), the Persian verb lost its non-joiner."""
    assert model_text(text) == text
    assert model_text(f"\u200b{text}\u00ad\ufeff") == text  # the other format characters still go
