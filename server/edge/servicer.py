"""The Translator gRPC servicer: validate, convert, delegate to the engine, convert back.

Each request is submitted to the engine as one flat list of sentences; the engine's events arrive
on its thread and are handed to this request's `CallInbox` on the event loop. Errors
become statuses in `server.edge.errors`; nothing here catches an exception to choose a status.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing, suppress
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TypeVar

import grpc.aio

from model.languages import AUTO, AmbiguousLanguage
from model.tokenizer import TextTokenizer
from server.core.documents import PartialSentence, RequestLimits, TextTranslation, prepare_texts
from server.core.engine import (
    Admission,
    DrainingError,
    Event,
    RequestDone,
    RequestFailed,
    SentenceDone,
    TokensEvent,
)
from server.core.engine_client import Cancellable, EngineClient
from server.core.markup_documents import RequestAssembler, prepare_request
from server.core.response_cache import CacheKey, ResponseCache, submit_through
from server.core.runner import ModelSpec
from server.edge.admission import sentences_to_hold
from server.edge.convert import (
    ModelDescription,
    TranslateJob,
    check_texts,
    model_info_to_pb,
    parse_request,
    partial_to_pb,
    text_result_to_pb,
)
from server.edge.detect import MIN_MARGIN, Detection, SourceDetector
from server.edge.errors import (
    CallRecord,
    InvalidRequest,
    ResponseTooLarge,
    Unavailable,
    cancelled_by_deadline,
    request_failed,
    stream_call,
    unary_call,
)
from server.edge.metrics import Metrics
from server.edge.preparation import INLINE_PREPARE_CHARS, PreparationLane
from server.edge.routing import LanguageRoute, describe_pairs, route_pair
from server.edge.tracing import Tracing
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc

Context = grpc.aio.ServicerContext  # the generic parameters add nothing to these signatures
M = TypeVar("M", pb.TranslateResponse, pb.TranslateStreamResponse)


@dataclass(frozen=True)
class Backend:
    """A loaded model the servicer translates with, and its engine."""

    engine: EngineClient
    spec: ModelSpec  # the runner's spec: languages and token limits
    tokenizer: TextTokenizer
    model: ModelDescription
    limits: RequestLimits  # what its engine can take
    cache: ResponseCache | None = None  # finished sentences of the model, shared by its replicas; None = off


@dataclass(frozen=True)
class JobPart:
    """One model pair's share of a request: its job and where the job's texts sit in the request."""

    backend: Backend
    job: TranslateJob
    indices: list[int]  # request position of each of the job's texts
    detections: Mapping[int, Detection] = field(default_factory=dict)  # by request position, where detected

    def result_to_pb(self, result: TextTranslation) -> pb.TextResult:
        message = text_result_to_pb(replace(result, index=self.indices[result.index]), self.job)
        if (found := self.detections.get(message.index)) is not None:
            message.detected_source_language = self.job.source_lang
            message.detected_language_confidence = found.confidence
        return message

    def original_partial(self, partial: PartialSentence) -> PartialSentence:
        return replace(partial, text_index=self.indices[partial.text_index])

    def with_texts(self, texts: list[str], more: list[int]) -> JobPart:
        """This part with the request's texts at `more` added (texts with nothing to translate)."""
        indices = sorted([*self.indices, *more])
        job = replace(self.job, texts=[texts[i] for i in indices])
        return replace(self, job=job, indices=indices)


def _streaming(job: TranslateJob, stream: bool) -> TranslateJob:
    """The job as the method runs it: the unary method never streams tokens."""
    return job if stream else replace(job, options=replace(job.options, stream_tokens=False))


def _detect_all(detector: SourceDetector, texts: list[str]) -> tuple[dict[str, list[int]], dict[int, Detection]]:
    """Texts grouped by detected language, and each text's detection; texts without a letter (nothing to
    translate, or numbers and symbols any model takes) are in neither. InvalidRequest naming the texts whose
    language no detection decides."""
    groups: dict[str, list[int]] = {}
    found: dict[int, Detection] = {}
    undecided: list[int] = []
    for index, text in enumerate(texts):
        if not any(char.isalpha() for char in text):  # digits and symbols: no language to tell, any model's
            continue
        detection = detector.detect(text)
        if detection is None:
            undecided.append(index)
            continue
        found[index] = detection
        groups.setdefault(detection.language, []).append(index)
    if undecided:
        listed = ", ".join(f"texts[{i}]" for i in undecided[:5]) + (" and more" if len(undecided) > 5 else "")
        raise InvalidRequest(
            f"cannot tell the language of {listed} (no language ahead of the others by {MIN_MARGIN}); "
            "set options.source_language"
        )
    return groups, found


class TranslatorServicer(pb_grpc.TranslatorServicer):
    def __init__(self, limits: RequestLimits, metrics: Metrics | None = None, tracing: Tracing | None = None) -> None:
        self.limits = limits  # before loading: the documented limits, for refusals that need one
        self.metrics = metrics
        self.tracing = tracing
        self._backends: list[Backend] = []
        self._turn = itertools.count()  # round robin among equally loaded engines
        self._lane = PreparationLane()  # splits and tokenizes admitted calls between arrivals

    def attach(self, backends: list[Backend], detector: SourceDetector | None = None) -> None:
        """Start serving with loaded, warmed-up models, routed by language pair (and name) in this order;
        `detector` serves requests that leave the source language to detection."""
        self._backends = list(backends)
        self._detector = detector

    @unary_call("Translate")
    async def Translate(self, request: pb.TranslateRequest, context: Context, call: CallRecord) -> pb.TranslateResponse:
        parts = await self._parts(request, call, stream=False)
        results: list[pb.TextResult] = []
        async with aclosing(self._translate_parts(parts, context, call)) as items:
            async for part, item in items:
                if isinstance(item, TextTranslation):
                    results.append(part.result_to_pb(item))
        results.sort(key=lambda r: r.index)
        return self._fits(pb.TranslateResponse(results=results), parts[0].backend.limits)

    @stream_call("TranslateStream")
    async def TranslateStream(
        self, request: pb.TranslateRequest, context: Context, call: CallRecord
    ) -> AsyncGenerator[pb.TranslateStreamResponse, None]:
        parts = await self._parts(request, call, stream=True)
        async with aclosing(self._translate_parts(parts, context, call)) as items:
            async for part, item in items:
                if isinstance(item, TextTranslation):
                    yield self._fits(pb.TranslateStreamResponse(result=part.result_to_pb(item)), part.backend.limits)
                else:
                    yield pb.TranslateStreamResponse(partial=partial_to_pb(part.original_partial(item)))

    @unary_call("ListModels")
    async def ListModels(
        self, request: pb.ListModelsRequest, context: Context, call: CallRecord
    ) -> pb.ListModelsResponse:
        models = {b.model.name: b for b in self._require_backends()}  # a model's replicas: one entry
        return pb.ListModelsResponse(models=[model_info_to_pb(b.model, b.spec, b.limits) for b in models.values()])

    def _fits(self, message: M, limits: RequestLimits) -> M:
        """The message, if grpc may send it; else a status we send and count (grpc would fail it after us)."""
        if (size := message.ByteSize()) > limits.max_response_bytes:
            raise ResponseTooLarge(
                f"the response would be {size:,} bytes, over the server's limit of {limits.max_response_bytes:,}"
                " (each hypothesis repeats its text's whitespace): send fewer texts or hypotheses per request, "
                "or use TranslateStream (one message per text)"
            )
        return message

    def _require_backends(self) -> list[Backend]:
        if not self._backends:
            raise Unavailable("the model is still loading; retry shortly")
        # Every engine drains together: every new call, ListModels too, goes to another replica (a failed
        # engine refuses at admission, saying so).
        if any(b.engine.draining and not b.engine.failed for b in self._backends):
            raise DrainingError("the server is draining")
        return self._backends

    def _route(self, options: pb.TranslationOptions, source: str | None = None) -> tuple[Backend, LanguageRoute]:
        """The model for the request and its pair: the best fit of the client's codes (model.languages) among
        every model serving them, among those of its name if it names one; ties go to the first in load
        order, and among one model's engines to the least loaded. `source` overrides the request's (a
        detected language)."""
        backends = self._require_backends()
        if options.model:
            backends = [b for b in backends if b.model.name == options.model]
            if not backends:
                served = ", ".join(dict.fromkeys(b.model.name for b in self._backends))
                raise InvalidRequest(f"unknown model {options.model!r}; this server serves {served}")
        source = options.source_language if source is None else source
        target = options.target_language
        if not target:
            raise InvalidRequest(f"options.target_language is required; {self._served_pairs(backends)}")
        try:
            routes = [(b, route) for b in backends if (route := route_pair(source, target, b.spec.pairs))]
        except AmbiguousLanguage as err:
            raise InvalidRequest(f"{err}; {self._served_pairs(backends)}") from err
        if not routes:
            raise InvalidRequest(f"unsupported language pair {source}-{target}; {self._served_pairs(backends)}")
        best = max(route.fit for _, route in routes)
        backend, route = next((b, r) for b, r in routes if r.fit == best)
        replicas = [b for b, r in routes if b.model.name == backend.model.name]
        if len(replicas) == 1:
            return backend, route
        # The least loaded engine of the model; ties taken in turn, so a burst of idle-time calls spreads out.
        start = next(self._turn) % len(replicas)
        return min(replicas[start:] + replicas[:start], key=lambda b: b.engine.load), route

    @staticmethod
    def _served_pairs(backends: list[Backend]) -> str:
        return "supported pairs: " + describe_pairs({b.model.name: b.spec.pairs for b in backends})

    def _parse(
        self, request: pb.TranslateRequest, backend: Backend, route: LanguageRoute, call: CallRecord
    ) -> TranslateJob:
        job = parse_request(request, route, backend.spec, backend.limits, backend.model)
        call.lang_pair, call.model = job.lang_pair, backend.model.name
        return job

    async def _parts(self, request: pb.TranslateRequest, call: CallRecord, stream: bool) -> list[JobPart]:
        """The request as jobs, one per model pair: one, or with the source left to detection one per
        language detected (the first part's model and pair label the call's metrics)."""
        if request.options.source_language not in ("", AUTO):
            backend, route = self._route(request.options)
            job = self._parse(request, backend, route, call)
            return [JobPart(backend, _streaming(job, stream), list(range(len(request.texts))))]
        if self._detector is None:
            raise InvalidRequest("source detection is not available on this server; set options.source_language")
        texts = list(request.texts)
        check_texts(texts, self.limits)
        detect = partial(_detect_all, self._detector, texts)
        small = sum(len(text) for text in texts) <= INLINE_PREPARE_CHARS and self._detector.loaded
        groups, found = detect() if small else await asyncio.to_thread(detect)  # the first call loads it
        parts: list[JobPart] = []
        for language, indices in groups.items():
            backend, route = self._route_detected(request.options, language, [found[i] for i in indices])
            sub_request = pb.TranslateRequest(texts=[texts[i] for i in indices], options=request.options)
            job = self._parse(sub_request, backend, route, call)
            parts.append(JobPart(backend, _streaming(job, stream), indices, {i: found[i] for i in indices}))
            if self.metrics is not None:
                for _ in indices:
                    self.metrics.observe_detected(language, backend.model.name)
        if blank := [i for i in range(len(texts)) if i not in found]:  # no letter: with any model
            if parts:
                parts[0] = parts[0].with_texts(texts, blank)
            else:
                backend, route = self._route(request.options, source=self._any_source(request.options))
                job = self._parse(pb.TranslateRequest(texts=texts, options=request.options), backend, route, call)
                parts.append(JobPart(backend, _streaming(job, stream), blank))
        return parts

    def _route_detected(
        self, options: pb.TranslationOptions, language: str, detections: list[Detection]
    ) -> tuple[Backend, LanguageRoute]:
        try:
            return self._route(options, source=language)
        except InvalidRequest as err:
            confidence = min(d.confidence for d in detections)
            raise InvalidRequest(
                f"{len(detections)} text(s) detected as {language!r} (confidence >= {confidence:.2f}): {err}"
            ) from err

    def _any_source(self, options: pb.TranslationOptions) -> str:
        """A served source that pairs with the request's target, for texts with nothing to translate."""
        backends = self._require_backends()
        for backend in backends:
            for source, _ in backend.spec.pairs:
                with suppress(AmbiguousLanguage):
                    if route_pair(source, options.target_language, backend.spec.pairs):
                        return source
        return backends[0].spec.pairs[0][0]  # routing says what is wrong with the target

    async def _translate_parts(
        self, parts: list[JobPart], context: Context, call: CallRecord
    ) -> AsyncGenerator[tuple[JobPart, TextTranslation | PartialSentence], None]:
        """Every part's items as they come, each with its part; a part that fails fails the call (and ends
        the others: their engines drop their sentences)."""
        if len(parts) == 1:
            async with aclosing(self._translate(parts[0].job, parts[0].backend, context, call)) as items:
                async for item in items:
                    yield parts[0], item
            return
        queue: asyncio.Queue[tuple[JobPart, TextTranslation | PartialSentence | Exception | None]] = asyncio.Queue()

        async def pump(part: JobPart) -> None:
            try:
                async with aclosing(self._translate(part.job, part.backend, context, call)) as items:
                    async for item in items:
                        queue.put_nowait((part, item))
            except Exception as err:  # handed to the call, which raises it
                queue.put_nowait((part, err))
                return
            queue.put_nowait((part, None))

        tasks = [asyncio.create_task(pump(part)) for part in parts]
        try:
            remaining = len(tasks)
            while remaining:
                done, got = await queue.get()
                if got is None:
                    remaining -= 1
                elif isinstance(got, Exception):
                    raise got
                else:
                    yield done, got
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _translate(
        self, job: TranslateJob, backend: Backend, context: Context, call: CallRecord
    ) -> AsyncGenerator[TextTranslation | PartialSentence, None]:
        """Texts as they finish (blank ones first), with partial sentences in between when streaming tokens.

        Admitted by the engine first, holding the queue places for the sentences it counts
        (`server.edge.admission`): a request the queue cannot take is refused before any splitting, and
        a drain that begins while the texts are still being split waits for this call instead of
        refusing it at submit. Splitting then waits for
        a lull in the calls arriving (`server.edge.preparation`): no refusal waits behind it.
        """
        self._lane.arrived()
        call.texts = len(job.texts)
        call.trace.describe(backend.model.name, job.lang_pair, job.options.beam_size)
        with backend.engine.admission(sentences_to_hold(job.texts, backend.limits.max_sentences)) as admission:
            prepare = _preparation(job, backend)  # parsing (HTML/XML), splitting and tokenizing
            assembler = await self._lane.prepare(prepare, sum(len(text) for text in job.texts))
            for blank in assembler.blank_texts():
                yield blank
            if not assembler.sources:
                return
            key_of, sources = _cache_key(job, backend), assembler.sources
            events_of = _engine_events(backend.engine, admission, sources, job, context, call, backend.cache, key_of)
            async with aclosing(events_of) as events:
                async for event in events:
                    if isinstance(event, TokensEvent):
                        yield assembler.partial(event.sentence_index, event.token_ids, finished=False)
                        continue
                    call.queue_wait_s = max(call.queue_wait_s, event.queue_wait_s)
                    call.trace.sentence(call.submitted, event)
                    if job.options.stream_tokens:
                        yield assembler.partial(event.sentence_index, event.hypotheses[0].tokens, finished=True)
                    done = assembler.sentence_done(event.sentence_index, event.hypotheses, event.input_tokens)
                    if done is not None:
                        _count_text(call, done)
                        yield done


def _preparation(job: TranslateJob, backend: Backend) -> Callable[[], RequestAssembler]:
    """The request's texts to the engine's sentences: parsed (HTML/XML), split and tokenized, when called."""
    texts = partial(
        prepare_texts,
        source_lang=job.sentence_lang,  # whose sentence rules split the texts
        target_lang=job.target_lang,
        tokenizer=backend.tokenizer,
        limits=backend.limits,
        max_tokens=backend.spec.max_source_len,
    )
    limits, n_best = backend.limits, job.options.num_hypotheses
    return partial(prepare_request, job.texts, job.text_type, texts, backend.tokenizer, limits, n_best)


def _cache_key(job: TranslateJob, backend: Backend) -> Callable[[list[int]], CacheKey]:
    """A sentence's key in the model's response cache, for this request's pair and options."""
    return partial(CacheKey.of, backend.model.model_sha256, backend.model.variant, job.lang_pair, job.options)


def _count_text(call: CallRecord, text: TextTranslation) -> None:
    """A text answered: its sentences and tokens go into the call's access record."""
    call.sentences += text.sentences
    call.input_tokens += text.input_tokens
    call.output_tokens += text.output_tokens


class CallInbox:
    """One call's engine events, handed from the engine thread to the call's event loop.

    Each TokensEvent carries a sentence's whole output so far, so a newer one replaces one the call
    has not read yet: a client that reads slowly makes the server hold one partial output per
    sentence, not every prefix of it (which grows with the square of its length). Every other event
    is kept, in order, and a sentence's partial output is always read before its SentenceDone.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: asyncio.Queue[Event | int] = asyncio.Queue()  # an int: that sentence's latest tokens
        self._latest_tokens: dict[int, TokensEvent] = {}

    def deliver(self, event: Event) -> None:
        """The engine's callback: runs on the engine thread, so it only schedules the put."""
        self._loop.call_soon_threadsafe(self._put, event)

    def _put(self, event: Event) -> None:
        if not isinstance(event, TokensEvent):
            self._events.put_nowait(event)
            return
        unread = event.sentence_index in self._latest_tokens
        self._latest_tokens[event.sentence_index] = event
        if not unread:
            self._events.put_nowait(event.sentence_index)

    async def get(self) -> Event:
        item = await self._events.get()
        return self._latest_tokens.pop(item) if isinstance(item, int) else item


async def _engine_events(
    engine: EngineClient,
    admission: Admission,
    sources: list[list[int]],
    job: TranslateJob,
    context: Context,
    call: CallRecord,
    cache: ResponseCache | None = None,
    key_of: Callable[[list[int]], CacheKey] | None = None,  # the cache's key of a sentence; with `cache`
) -> AsyncGenerator[TokensEvent | SentenceDone, None]:
    """Submit one request (through the response cache) and yield its events until it is done; cancel it if
    the caller stops early."""
    inbox = CallInbox(asyncio.get_running_loop())
    remaining = context.time_remaining()
    call.submitted = time.monotonic()
    deadline = None if remaining is None else call.submitted + remaining

    def submit(sentences: list[list[int]], on_event: Callable[[Event], None]) -> Cancellable:
        return engine.submit(
            sentences, job.options, on_event, deadline=deadline, lang_pair=job.lang_pair, admitted=admission
        )

    handle = submit_through(cache, key_of, sources, inbox.deliver, submit)
    finished = False
    try:
        while True:
            event = await inbox.get()
            if isinstance(event, RequestDone):
                finished = True
                return
            if isinstance(event, RequestFailed):
                finished = True
                raise request_failed(event)
            yield event
    finally:
        if not finished:  # client gone, deadline hit by grpc, or a conversion error: free the slots now
            handle.cancel(deadline_passed=cancelled_by_deadline(context, call))  # for the failed-sentences metric
