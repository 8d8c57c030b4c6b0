"""Every Prometheus series of the service, on an injected registry (tests use a fresh one).

The engine and the servicer hand over plain numbers or stats objects; nothing else in the server
touches prometheus_client. `Metrics` is the engine's observer (server.core.observer.EngineObserver).
Names carry the `translation_` prefix and their unit; durations are histograms (not summaries) so
they aggregate across replicas.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from server.core.observer import StepStats
from server.edge.process_metrics import Children, register_process_collectors
from server.processes.process_reports import forget_report, read_reports
from server.text.documents import TermsUsed

__all__ = [
    "CacheMetrics",
    "Metrics",
    "ModelMetrics",
    "StepStats",
    "forget_process",
    "start_metrics_server",
    "start_multiprocess_metrics_server",
]

# Milliseconds to a minute: a single short sentence on a GPU up to a long document on a loaded CPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# One decoder step: tens of microseconds (tiny batch on GPU) to a second (full batch on a slow CPU).
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
SLOT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TIMED_CODES = ("OK", "DEADLINE_EXCEEDED")  # calls whose duration is the latency a client saw from the service
STAGES = ("encode", "decode")  # the runner calls padding efficiency is measured for
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class Metrics:
    """The `translation_*` series; one instance per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.calls_in_flight = 0  # this process's calls in the service's handlers, any method: what shutdown awaits
        self.requests = Counter(
            "translation_requests_total",
            "Finished RPCs by method, gRPC status code name, language pair and model (empty before routing).",
            ["method", "code", "lang_pair", "model"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "translation_requests_in_flight",
            "RPCs received by the service and not yet answered, by method.",
            ["method"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.request_duration = Histogram(
            "translation_request_duration_seconds",
            "Latency of RPCs answered OK or cut off by their deadline, from receipt to the last response; fast"
            " refusals (queue full, bad input, no token) are only counted, in translation_requests_total.",
            ["method", "lang_pair", "model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "translation_queue_wait_seconds",
            "Time a sentence waited in the queue before it got slots.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.first_result = Histogram(
            "translation_time_to_first_result_seconds",
            "Time from receipt to the first result sent (a sentence, or tokens when streaming).",
            ["method", "model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.preparation = Histogram(
            "translation_preparation_seconds",
            "Time from a call's admission to its sentences being ready for the engine (detection, parsing, splitting"
            " and tokenizing, the wait for a lull or a worker's turn included), by outcome: done, failed (a limit),"
            " ended (deadline or cancellation).",
            ["model", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.step_duration = Histogram(
            "translation_decode_step_duration_seconds",
            "Wall time of one decoder step call (with its beam-row copies; the encoder is apart).",
            ["model"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.encode_duration = Histogram(
            "translation_encode_duration_seconds",
            "Wall time of one encoder call over the sentences admitted in an iteration.",
            ["model"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.step_active_slots = Histogram(
            "translation_step_active_slots",
            "Rows (slots) stepped together in one decoder call: the batch size.",
            ["model"],
            buckets=SLOT_BUCKETS,
            registry=registry,
        )
        self.queue_depth = Gauge(
            "translation_queue_depth",
            "Sentences waiting for slots.",
            ["model"],
            registry=registry,
            multiprocess_mode="livesum",  # --processes: the sum over the live server processes
        )
        self.active_slots = Gauge(
            "translation_active_slots",
            "Slots reserved by running sentences.",
            ["model"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.max_slots = Gauge(
            "translation_max_slots",
            "Slots the model's engines may use.",
            ["model"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.input_tokens = Counter(
            "translation_input_tokens_total",
            "Source tokens of finished sentences, language tag and EOS included.",
            ["lang_pair", "model"],
            registry=registry,
        )
        self.output_tokens = Counter(
            "translation_output_tokens_total",
            "Tokens of the best hypothesis of finished sentences, EOS excluded.",
            ["lang_pair", "model"],
            registry=registry,
        )
        self.rejected = Counter(
            "translation_requests_rejected_total",
            "Calls the service answered RESOURCE_EXHAUSTED, by reason: `queue_full` (no room to queue the"
            " request: capacity is short) or `response_too_large` (a Translate answer over the message limit:"
            " the client's to fix). Each is also in translation_requests_total.",
            ["method", "reason", "model"],
            registry=registry,
        )
        self.sentences = Counter(
            "translation_sentences_total", "Finished sentences.", ["lang_pair", "model"], registry=registry
        )
        self.sentences_failed = Counter(
            "translation_sentences_failed_total",
            "Unfinished sentences of failed requests by reason (the gRPC status name) and stage: `queued`"
            " never got slots, `decoding` did. Queue waits only count sentences that got slots.",
            ["lang_pair", "reason", "stage", "model"],
            registry=registry,
        )
        self.padding_efficiency = Histogram(
            "translation_padding_efficiency_ratio",
            "Real over padded tokens per runner call, by stage: `encode` (source padding of a batch of new"
            " sentences) and `decode` (attended cache span of a step's rows, each padded to the longest).",
            ["stage", "model"],
            buckets=RATIO_BUCKETS,
            registry=registry,
        )
        self.detected_texts = Counter(
            "translation_detected_texts_total",
            "Texts of calls that left source_language to detection, counted as each is answered (a refused call"
            " counts none), by language (ISO 639-1: the one detected, or the one an undecided text took from its"
            " request) and the model that translated it (empty: already in the target language, it came back as it"
            " came). An undecided text sent to a model that reads any language (`mul`) is not counted.",
            ["language", "model"],
            registry=registry,
        )
        self.sentences_cut = Counter(
            "translation_sentences_cut_total",
            "Sentences over the model's source token limit, translated in parts (cut at clause boundaries, then"
            " whitespace, then between characters), counted as their calls are prepared.",
            ["model"],
            registry=registry,
        )
        self.sentence_parts = Counter(
            "translation_sentence_parts_total",
            "Parts the sentences of translation_sentences_cut_total were cut into; each is decoded as a sentence.",
            ["model"],
            registry=registry,
        )
        self.glossary_terms = Counter(
            "translation_glossary_terms_total",
            "Glossary terms found in the sentences of finished texts (outcome requested), and those whose target the"
            " translation holds as often as the source held the term (outcome applied); requested minus applied is"
            " terms the output limit cut short or the vocabulary cannot spell.",
            ["outcome", "model"],
            registry=registry,
        )
        self.text_errors = Counter(
            "translation_text_errors_total",
            "Texts refused alone in calls that allow partial results (TranslateRequest.allow_partial), by status"
            " code, under the model that prepared them (empty: refused before preparation, by their length or"
            " their detected language); the call itself answers OK.",
            ["code", "model"],
            registry=registry,
        )
        self.cache_lookups = Counter(
            "translation_cache_lookups_total",
            "Sentences looked up in the response cache, by result: `hit` (answered without decoding) or `miss`.",
            ["result", "model"],
            registry=registry,
        )
        self.cache_evictions = Counter(
            "translation_cache_evictions_total",
            "Entries the response cache dropped (least recently used) to stay within --cache-size/--cache-bytes.",
            ["model"],
            registry=registry,
        )
        self.cache_entries = Gauge(
            "translation_cache_entries", "Sentences in the response cache.", ["model"], registry=registry,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self.cache_bytes = Gauge(
            "translation_cache_bytes", "Estimated memory of the response cache's entries.", ["model"],
            registry=registry, multiprocess_mode="livesum",
        )  # fmt: skip
        self.model_info = Gauge(
            "translation_model_info",
            "The served model; always 1.",
            ["model", "variant", "provider", "opset"],
            registry=registry,
            multiprocess_mode="livemax",
        )

    def observe_request(self, method: str, code: str, lang_pair: str, seconds: float, model: str = "") -> None:
        """Count every finished call; time those that ran: answered OK, or cut off by their deadline (often
        the slowest, and left out they would cap the quantiles at the clients' deadlines). Refusals take
        milliseconds: timed, a flood of them would make latency look better exactly when it is worst."""
        self.requests.labels(method=method, code=code, lang_pair=lang_pair, model=model).inc()
        if code in TIMED_CODES:
            self.request_duration.labels(method=method, lang_pair=lang_pair, model=model).observe(seconds)

    def count_in_flight(self, method: str, change: int) -> None:
        """A call of `method` began (+1) or ended (-1)."""
        self.in_flight.labels(method=method).inc(change)
        self.calls_in_flight += change

    def observe_rejected(self, method: str, reason: str, model: str = "") -> None:
        self.rejected.labels(method=method, reason=reason, model=model).inc()

    def observe_first_result(self, method: str, seconds: float, model: str = "") -> None:
        self.first_result.labels(method=method, model=model).observe(seconds)

    def observe_preparation(self, seconds: float, outcome: str, model: str = "") -> None:
        self.preparation.labels(model=model, outcome=outcome).observe(seconds)

    def observe_detected(self, language: str, model: str = "") -> None:
        self.detected_texts.labels(language=language, model=model).inc()

    def observe_cut(self, parts: int, model: str = "") -> None:
        """A sentence over the token limit, cut into `parts`."""
        self.sentences_cut.labels(model=model).inc()
        self.sentence_parts.labels(model=model).inc(parts)

    def observe_terms(self, terms: TermsUsed, model: str = "") -> None:
        """A finished text's glossary terms: found in its source, and used by its translation."""
        self.glossary_terms.labels(outcome="requested", model=model).inc(terms.requested)
        self.glossary_terms.labels(outcome="applied", model=model).inc(terms.applied)

    def observe_text_error(self, code: str, model: str = "") -> None:
        """A text refused alone with status `code` (its name, as in translation_requests_total)."""
        self.text_errors.labels(code=code, model=model).inc()

    def set_model_info(self, model: str, variant: str, provider: str, opset: int) -> None:
        self.model_info.labels(model=model, variant=variant, provider=provider, opset=str(opset)).set(1)

    def for_model(self, model: str) -> ModelMetrics:
        """The observer of one more engine of `model`; its series carry `model`."""
        return ModelMetrics(self, model)

    def for_cache(self, model: str) -> CacheMetrics:
        """The observer of `model`'s response cache (server.core.response_cache.CacheObserver)."""
        return CacheMetrics(self, model)


class CacheMetrics:
    """One model's response cache series."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self._hits = metrics.cache_lookups.labels(result="hit", model=model)
        self._misses = metrics.cache_lookups.labels(result="miss", model=model)
        self._evictions = metrics.cache_evictions.labels(model=model)
        self._entries = metrics.cache_entries.labels(model=model)
        self._bytes = metrics.cache_bytes.labels(model=model)

    def observe_lookups(self, hits: int, misses: int) -> None:
        self._hits.inc(hits)
        self._misses.inc(misses)

    def observe_evictions(self, count: int) -> None:
        self._evictions.inc(count)

    def set_size(self, entries: int, size_bytes: int) -> None:
        self._entries.set(entries)
        self._bytes.set(size_bytes)


class ModelMetrics:
    """One engine's series (server.core.observer.EngineObserver), labelled with its model's name. A model's
    engines (replicas) share its gauges: each adds the change of its own value, so they show the sum."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.metrics, self.model = metrics, model
        # Children resolved once: the engine reports its load and step every iteration
        self._queue_depth, self._active_slots = (
            metrics.queue_depth.labels(model=model),
            metrics.active_slots.labels(model=model),
        )
        self._max_slots = metrics.max_slots.labels(model=model)
        self._step_duration = metrics.step_duration.labels(model=model)
        self._step_active_slots = metrics.step_active_slots.labels(model=model)
        self._encode_duration = metrics.encode_duration.labels(model=model)
        self._queue_wait = metrics.queue_wait.labels(model=model)
        self._padding = {stage: metrics.padding_efficiency.labels(stage=stage, model=model) for stage in STAGES}
        self._reported = {"queue_depth": 0, "active_slots": 0, "max_slots": 0}  # this engine's share of the gauges

    def set_capacity(self, max_slots: int) -> None:
        self._report("max_slots", self._max_slots, max_slots)

    def set_load(self, queue_depth: int, active_slots: int) -> None:
        self._report("queue_depth", self._queue_depth, queue_depth)
        self._report("active_slots", self._active_slots, active_slots)

    def _report(self, name: str, gauge: Gauge, value: int) -> None:
        gauge.inc(value - self._reported[name])  # each engine reports from its own thread; inc is atomic
        self._reported[name] = value

    def observe_queue_waits(self, waits: Iterable[float]) -> None:
        """Seconds each sentence waited for slots, reported once, when it first got them."""
        for wait in waits:
            self._queue_wait.observe(wait)

    def observe_step(self, stats: StepStats) -> None:
        self._step_duration.observe(stats.duration_s)
        if stats.encode_real_tokens:
            self._encode_duration.observe(stats.encode_duration_s)
        if stats.active_slots:
            self._step_active_slots.observe(stats.active_slots)
        self.observe_queue_waits(stats.queue_waits_s)
        for stage, real, padded in (
            ("encode", stats.encode_real_tokens, stats.encode_padded_tokens),
            ("decode", stats.step_real_tokens, stats.step_padded_tokens),
        ):
            if padded:  # apart: decoder steps outnumber encoder calls, and one mean would hide the encoder
                self._padding[stage].observe(real / padded)

    def observe_sentence(self, lang_pair: str, input_tokens: int, output_tokens: int) -> None:
        m, labels = self.metrics, {"lang_pair": lang_pair, "model": self.model}
        m.sentences.labels(**labels).inc()
        m.input_tokens.labels(**labels).inc(input_tokens)
        m.output_tokens.labels(**labels).inc(output_tokens)

    def observe_abandoned(self, lang_pair: str, reason: str, queued: int, decoding: int) -> None:
        for stage, count in (("queued", queued), ("decoding", decoding)):
            if count:
                self.metrics.sentences_failed.labels(
                    lang_pair=lang_pair, reason=reason, stage=stage, model=self.model
                ).inc(count)


def start_multiprocess_metrics_server(
    port: int, path: str, addr: str = "0.0.0.0", servers: Children | None = None
) -> int:
    """Serve `/metrics` summed over the server processes that write their series under `path` (prometheus
    client's multiprocess mode, which each process enters by finding PROMETHEUS_MULTIPROC_DIR at import),
    with this process's own process series, the process series of `servers` (the fronts and engines it started)
    and the GC series the fronts report (server.edge.process_metrics, server.processes.process_reports)."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    live: Children = servers or dict
    register_process_collectors(registry, live, lambda: read_reports(Path(path), live()).gc)
    return start_metrics_server(port, registry, addr)


def forget_process(pid: int, path: str) -> None:
    """Drop an exited process's live gauges (queue depth, slots) from the sums, and its report; its counters
    stay."""
    mark_process_dead(pid, path)
    forget_report(Path(path), pid)


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str = "0.0.0.0") -> int:
    """Serve `/metrics` of `registry` from a daemon thread; return the bound port (port 0 = any free one)."""
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return int(server.server_port)
