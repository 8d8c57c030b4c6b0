"""The response cache: bounded, keyed by everything that decides an output, and invisible in the results."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from server.core.beam import Hypothesis
from server.core.events import Event, RequestDone, SentenceDone, TokensEvent
from server.core.response_cache import CachedSentence, CacheKey, ResponseCache, entry_bytes, submit_through
from server.core.work import DecodeOptions
from server.edge.config import LimitsConfig, ModelsConfig
from server.edge.flags import parse_config
from server.edge.loading import LoadedModel
from server.edge.metrics import Metrics
from server.proto.translation.v1 import translation_pb2 as pb
from tests.serving import (
    FP32_ON_CPU,
    GatedRunner,
    RunningServer,
    fake_model,
    request,
    runner_of,
    running_server,
    sample_value,
    server_config,
    status_of,
)

UI_STRINGS = ["Speichern", "Abbrechen", "Das Haus ist groß.", "Einstellungen öffnen", "Er wartete."]
TEXTS = [*UI_STRINGS, "Speichern", "Sie schrieben gemeinsam ein Buch. Speichern", "", "Das Haus ist groß."]


def key(source: list[int], beam: int = 4, lang_pair: str = "de-en", variant: str = "fp32") -> CacheKey:
    return CacheKey.of("0" * 64, variant, lang_pair, DecodeOptions(beam_size=beam), source)


def sentence(*tokens: int) -> CachedSentence:
    return CachedSentence.of([Hypothesis(tuple(tokens), -1.0, -0.5)], 3)


class Recorder:
    def __init__(self) -> None:
        self.lookups = [0, 0]
        self.evictions = 0
        self.size = (0, 0)

    def observe_lookups(self, hits: int, misses: int) -> None:
        self.lookups = [self.lookups[0] + hits, self.lookups[1] + misses]

    def observe_evictions(self, count: int) -> None:
        self.evictions += count

    def set_size(self, entries: int, size_bytes: int) -> None:
        self.size = (entries, size_bytes)


def test_least_recently_used_entries_go_first_within_both_bounds() -> None:
    recorder = Recorder()
    one = entry_bytes(key([1]), sentence(5))
    cache = ResponseCache(max_entries=2, max_bytes=10 * one, observer=recorder)
    cache.put(key([1]), sentence(5))
    cache.put(key([2]), sentence(6))
    assert cache.lookup([key([1])]) == [sentence(5)]  # [1] is now the most recent
    cache.put(key([3]), sentence(7))
    assert cache.lookup([key([1]), key([2]), key([3])]) == [sentence(5), None, sentence(7)]
    assert recorder.lookups == [3, 1] and recorder.evictions == 1 and recorder.size == (2, 2 * one)
    small = ResponseCache(max_entries=100, max_bytes=2 * one)
    for n in range(5):
        small.put(key([n]), sentence(n))
    assert len(small) == 2 and small.size_bytes <= 2 * one
    small.put(key(list(range(1000))), sentence(1))  # larger than the whole cache: not kept, nothing evicted
    assert len(small) == 2


@pytest.mark.parametrize(("hypotheses", "source_len", "output_len"), [(1, 5, 5), (1, 20, 20), (8, 20, 20), (4, 60, 80)])
def test_the_byte_bound_counts_what_the_entries_really_hold(hypotheses: int, source_len: int, output_len: int) -> None:
    """tracemalloc over 5,000 entries of OPUS-MT-sized ids (a 58k vocabulary), each request's options streamed:
    the estimate within 25% of what the entries hold. When ids were kept as tuples of Python ints with a copy of
    the options per key, the same measurement gave 1.9-3x the estimate: the default 64 MiB bound let a model's
    cache grow to some 190 MiB."""
    rng = random.Random(0)
    entries = [
        (
            [rng.randrange(58_000) for _ in range(source_len)],
            [
                Hypothesis(tuple(rng.randrange(58_000) for _ in range(output_len)), -1.0, -0.5)
                for _ in range(hypotheses)
            ],
        )
        for _ in range(5_000)
    ]
    cache = ResponseCache(max_entries=10**6, max_bytes=10**12)
    options = DecodeOptions(beam_size=4, stream_tokens=True)
    tracemalloc.start()
    try:
        for source, found in entries:  # as the relay stores what the engine finishes
            cache.put(CacheKey.of("0" * 64, "fp32", "de-en", options, source), CachedSentence.of(found, source_len))
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0.75 <= held / cache.size_bytes <= 1.25, (held, cache.size_bytes)


def test_an_entry_gives_back_the_hypotheses_it_was_given() -> None:
    found = [Hypothesis((57_999, 0, 4_000_000_000), -1.25, -0.5), Hypothesis((), -3.0, -3.0)]
    assert CachedSentence.of(found, 7).hypotheses == found


def test_every_option_that_changes_an_output_is_in_the_key_and_streaming_is_not() -> None:
    base = key([1, 2])
    assert base == CacheKey.of("0" * 64, "fp32", "de-en", DecodeOptions(beam_size=4, stream_tokens=True), [1, 2])
    others = [
        key([1, 2], beam=2),
        key([1, 2], lang_pair="en-de"),
        key([1, 2], variant="int8"),
        key([1, 3]),
        CacheKey.of("1" * 64, "fp32", "de-en", DecodeOptions(beam_size=4), [1, 2]),
        CacheKey.of("0" * 64, "fp32", "de-en", DecodeOptions(beam_size=4, length_penalty=0.6), [1, 2]),
        CacheKey.of("0" * 64, "fp32", "de-en", DecodeOptions(beam_size=4, max_output_len=7), [1, 2]),
        CacheKey.of("0" * 64, "fp32", "de-en", DecodeOptions(beam_size=4, num_hypotheses=2), [1, 2]),
    ]
    assert len({base, *others}) == len(others) + 1


def test_hits_come_first_repeats_decode_once_and_request_done_comes_last() -> None:
    cache = ResponseCache(100, 1 << 20)
    cache.put(key([9]), sentence(90))
    events: list[Event] = []
    submitted: list[list[list[int]]] = []

    def submit(sources: list[list[int]], on_event: object) -> object:
        submitted.append(sources)
        assert callable(on_event)
        on_event(TokensEvent(0, (7,)))
        on_event(SentenceDone(1, [Hypothesis((8,), -1.0, -1.0)], 2))
        on_event(SentenceDone(0, [Hypothesis((7,), -1.0, -1.0)], 2))
        on_event(RequestDone())
        return object()

    submit_through(cache, key, [[1], [9], [2], [1]], events.append, submit)  # type: ignore[arg-type]
    assert submitted == [[[1], [2]]]
    assert events[0] == SentenceDone(1, sentence(90).hypotheses, 3)
    assert events[1:3] == [TokensEvent(0, (7,)), TokensEvent(3, (7,))]
    assert {e.sentence_index for e in events if isinstance(e, SentenceDone)} == {0, 1, 2, 3}
    assert events[-1] == RequestDone()
    stored = cache.lookup([key([1]), key([2])])
    assert [c.hypotheses[0].tokens if c else None for c in stored] == [(7,), (8,)]
    answered: list[Event] = []
    submit_through(cache, key, [[1], [2]], answered.append, submit)  # type: ignore[arg-type]
    assert len(submitted) == 1 and answered[-1] == RequestDone() and len(answered) == 3


@pytest.fixture()
def model(tiny_model_dir: Path) -> LoadedModel:
    return fake_model(tiny_model_dir)


@pytest.fixture()
def cached(model: LoadedModel) -> Iterator[RunningServer]:
    with running_server(model, server_config(limits=LimitsConfig(cache_size=1000))) as running:
        yield running


@pytest.fixture()
def uncached(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(fake_model(tiny_model_dir), server_config(limits=LimitsConfig(cache_size=0))) as running:
        yield running


def decoded(served: RunningServer) -> float:
    return sample_value(served.registry, "translation_sentences_total")


@pytest.mark.parametrize(
    "options",
    [{}, {"beam_size": 1}, {"beam_size": 3, "num_hypotheses": 3, "return_scores": True}, {"max_output_len": 3}],
)
def test_results_are_those_of_an_uncached_server_and_repeats_skip_the_engine(
    cached: RunningServer, uncached: RunningServer, options: dict[str, Any]
) -> None:
    """Broken once on purpose (each missing sentence decoded apart, repeats within the request too), the
    engine decoded 9 sentences where 6 differ."""
    expected = uncached.stub.Translate(request(TEXTS, **options))
    first = cached.stub.Translate(request(TEXTS, **options))
    engine_sentences = decoded(cached)
    again = cached.stub.Translate(request(TEXTS, **options))
    assert first == expected and again == expected
    assert engine_sentences == len(set(UI_STRINGS) | {"Sie schrieben gemeinsam ein Buch."})  # repeats once
    assert decoded(cached) == engine_sentences  # the second request: every sentence a hit
    hits = sample_value(cached.registry, "translation_cache_lookups_total", result="hit", model="fake")
    misses = sample_value(cached.registry, "translation_cache_lookups_total", result="miss", model="fake")
    # 9 sentences each time: the first request's 6 distinct ones miss once each and its 3 repeats are answered by
    # their one decode, hits (broken once on purpose, counted as misses: a hit rate a third too low)
    assert (hits, misses) == (12, 6)
    assert sample_value(cached.registry, "translation_cache_entries", model="fake") == 6


def test_a_beam_or_option_change_never_reuses_another_entry(cached: RunningServer, uncached: RunningServer) -> None:
    """Broken once on purpose (the key built without the length penalty), the beam-4 request with length
    penalty 0.3 got the default penalty's cached answers, not the uncached server's."""
    for options in ({"beam_size": 2}, {"beam_size": 4}, {"beam_size": 4, "length_penalty": 0.3}, {"beam_size": 1}):
        before = decoded(cached)
        assert cached.stub.Translate(request(UI_STRINGS, **options)) == uncached.stub.Translate(
            request(UI_STRINGS, **options)
        )
        assert decoded(cached) == before + len(UI_STRINGS), options
    assert cached.stub.Translate(request(["Speichern"], "en", "de")).results[0].sentences == 1
    assert sample_value(cached.registry, "translation_cache_lookups_total", result="hit") == 0


def streamed(served: RunningServer) -> tuple[list[tuple[int, str]], list[tuple[int, int, str]]]:
    """A stream's results and its finished sentences, in a fixed order."""
    stream = list(served.stub.TranslateStream(request(TEXTS, beam_size=2, stream_tokens=True)))
    results = sorted((m.result.index, m.result.translation) for m in stream if m.HasField("result"))
    finals = [m.partial for m in stream if m.HasField("partial") and m.partial.finished]
    return results, sorted((p.text_index, p.sentence_index, p.text) for p in finals)


def test_streaming_on_hits_sends_what_an_uncached_stream_does(cached: RunningServer, uncached: RunningServer) -> None:
    first = streamed(cached)
    engine_sentences = decoded(cached)
    assert streamed(cached) == first == streamed(uncached)
    assert decoded(cached) == engine_sentences  # the second stream was all hits


def test_hits_answer_while_the_engine_is_held_and_misses_keep_their_deadline(tiny_model_dir: Path) -> None:
    base = fake_model(tiny_model_dir)
    gated = GatedRunner(runner_of(base))
    with running_server(
        LoadedModel(gated, base.tokenizer, base.description), server_config(limits=LimitsConfig(cache_size=100))
    ) as served:
        warm = served.stub.Translate(request(UI_STRINGS, beam_size=1))
        gated.close_gate()
        assert served.stub.Translate(request(UI_STRINGS, beam_size=1), timeout=5) == warm
        error = status_of(
            lambda: served.stub.Translate(request([*UI_STRINGS, "Geheimpolizei"], beam_size=1), timeout=1)
        )
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_the_cache_flags_and_their_default() -> None:
    assert parse_config([], {}).limits.cache_size == 0  # off unless asked for: the images ask for 10,000
    limits = parse_config(["--cache-size", "0", "--cache-bytes", "1024"], {}).limits
    assert (limits.cache_size, limits.cache_bytes) == (0, 1024)
    assert parse_config([], {"TRANSLATE_CACHE_SIZE": "5"}).limits.cache_size == 5
    with pytest.raises(ValueError, match="cache_size"):
        parse_config(["--cache-size", "-1"], {})
    Metrics(CollectorRegistry()).for_cache("m").observe_lookups(1, 2)  # the observer the cache is given


def test_an_off_cache_is_no_cache(uncached: RunningServer) -> None:
    uncached.stub.Translate(request(["Speichern", "Speichern"]))
    uncached.stub.Translate(request(["Speichern"]))
    assert uncached.server.caches == {} and decoded(uncached) == 3


def test_the_real_runtime_answers_the_same_from_the_cache_in_an_engine_process(tiny_exported_dir: Path) -> None:
    """fp32 onnxruntime: an engine process behind a cache answers as an in-process engine without one."""
    from server.edge.loading import load_model

    def loaded(in_process: bool) -> LoadedModel:
        config = server_config(models=ModelsConfig(model_dirs=(tiny_exported_dir,)), engines=FP32_ON_CPU)
        return load_model(config, tiny_exported_dir, in_process=in_process)

    documents = ["<p>Das <b>Haus</b> ist groß.</p><p>Er wartete.</p>", *TEXTS[:3]]
    html = request(documents, text_type=pb.TEXT_TYPE_HTML, beam_size=2)
    with running_server(loaded(True), server_config(limits=LimitsConfig(cache_size=0))) as plain:
        expected = [plain.stub.Translate(request(TEXTS, beam_size=2)), plain.stub.Translate(html)]
    with running_server(loaded(False), server_config(limits=LimitsConfig(cache_size=100))) as cached:
        for _ in range(2):
            assert [cached.stub.Translate(request(TEXTS, beam_size=2)), cached.stub.Translate(html)] == expected
        hits = sample_value(cached.registry, "translation_cache_lookups_total", result="hit")
        # the first call's 3 repeats, answered by one decode each; every unit of the first html call was in TEXTS;
        # the second round hits all
        assert hits == 3 + 5 + 9 + 5
