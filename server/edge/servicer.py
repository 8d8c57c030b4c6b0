"""The Translator gRPC servicer: validate, convert, delegate to the engine, convert back.

Each request is submitted to the engine as one flat list of sentences; the engine's events arrive
on its thread and are handed to this request's `CallInbox` on the event loop. Errors
become statuses in `server.edge.errors`; nothing here catches an exception to choose a status.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import replace
from functools import partial
from typing import TypeVar

import grpc.aio

from server.core.admission_ledger import Admission
from server.core.engine_client import Cancellable, EngineClient
from server.core.events import Event, RequestDone, RequestFailed, SentenceDone, TokensEvent
from server.core.response_cache import CacheKey, ResponseCache, submit_through
from server.edge.admission import sentences_to_hold
from server.edge.backends import Backend, Backends
from server.edge.convert import TranslateJob, parse_request
from server.edge.detect import SourceDetector
from server.edge.errors import (
    CallRecord,
    ResponseTooLarge,
    cancelled_by_deadline,
    request_failed,
    status_for,
    stream_call,
    unary_call,
)
from server.edge.glossaries import GlossaryStore
from server.edge.glossary_terms import with_glossary
from server.edge.loop_mailbox import mailbox_of
from server.edge.messages import (
    from_pb,
    glossary_info_to_pb,
    glossary_to_pb,
    model_info_to_pb,
    new_glossary_from_pb,
    part_result_to_pb,
    partial_to_pb,
    refusal_to_pb,
)
from server.edge.metrics import Metrics
from server.edge.preparation import INLINE_PREPARE_CHARS, PreparationLane
from server.edge.refusals import Refusal
from server.edge.request import TranslateCall
from server.edge.request_parts import JobPart, SourceGrouping, merged_items, whole_request
from server.edge.routing import LanguageRoute
from server.edge.tracing import Tracing
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc
from server.text.checkpoints import CallEnded
from server.text.documents import (
    PartialSentence,
    Refuse,
    RequestLimits,
    TextRefused,
    TextTranslation,
    prepare_texts,
)
from server.text.markup import TextType
from server.text.markup_documents import RequestAssembler, prepare_request
from server.text.placeholders import Placeholders
from server.text.terms import term_index

Context = grpc.aio.ServicerContext  # the generic parameters add nothing to these signatures
M = TypeVar("M", pb.TranslateResponse, pb.TranslateStreamResponse)


class TranslatorServicer(pb_grpc.TranslatorServicer):
    def __init__(
        self,
        limits: RequestLimits,
        glossaries: GlossaryStore,
        metrics: Metrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.limits = limits  # before loading: the documented limits, for refusals that need one
        self.glossaries = glossaries  # read on every call: other server processes may share the directory
        self.metrics = metrics
        self.tracing = tracing
        self._backends = Backends([])
        self._grouping: SourceGrouping | None = None  # requests that leave the source language to detection
        self._lane = PreparationLane()  # splits and tokenizes admitted calls between arrivals

    def attach(self, backends: list[Backend], detector: SourceDetector | None = None, first_turn: int = 0) -> None:
        """Start serving with loaded, warmed-up models, routed by language pair (and name) in this order;
        `detector` serves requests that leave the source language to detection; `first_turn`: where this
        process's round robin among equally loaded engines begins (`Backends`)."""
        self._backends = Backends(backends, first_turn)
        pool = self._lane.pool  # detection takes its turns with the other calls' preparation
        self._grouping = None if detector is None else SourceGrouping(detector, self.limits, self.metrics, pool)

    @unary_call("Translate")
    async def Translate(self, request: pb.TranslateRequest, context: Context, call: CallRecord) -> pb.TranslateResponse:
        parts, refused = await self._parts(await self._typed(request), context, call, stream=False)
        results = [self._refused(refusal) for refusal in refused]
        async with aclosing(self._translate_parts(parts, context, call)) as items:
            async for part, item in items:
                if isinstance(item, TextTranslation):
                    results.append(part_result_to_pb(part, item))
                elif isinstance(item, TextRefused):
                    results.append(self._refused(part.original_refusal(item), part.backend.model.name))
        results.sort(key=lambda r: r.index)
        return self._fits(pb.TranslateResponse(results=results), parts[0].backend.limits if parts else self.limits)

    @stream_call("TranslateStream")
    async def TranslateStream(
        self, request: pb.TranslateRequest, context: Context, call: CallRecord
    ) -> AsyncGenerator[pb.TranslateStreamResponse, None]:
        parts, refused = await self._parts(await self._typed(request), context, call, stream=True)
        for refusal in refused:
            yield pb.TranslateStreamResponse(result=self._refused(refusal))
        async with aclosing(self._translate_parts(parts, context, call)) as items:
            async for part, item in items:
                if isinstance(item, TextTranslation):
                    result = part_result_to_pb(part, item)
                    yield self._fits(pb.TranslateStreamResponse(result=result), part.backend.limits)
                elif isinstance(item, TextRefused):
                    refusal = part.original_refusal(item)
                    yield pb.TranslateStreamResponse(result=self._refused(refusal, part.backend.model.name))
                else:
                    yield pb.TranslateStreamResponse(partial=partial_to_pb(part.original_partial(item)))

    @unary_call("ListModels")
    async def ListModels(
        self, request: pb.ListModelsRequest, context: Context, call: CallRecord
    ) -> pb.ListModelsResponse:
        models = {b.model.name: b for b in self._backends.serving()}  # a model's replicas: one entry
        return pb.ListModelsResponse(models=[model_info_to_pb(b.model, b.spec, b.limits) for b in models.values()])

    # Glossary calls are refused while the server loads or drains, as every call is, so that clients retrying
    # UNAVAILABLE go to a replica that serves. Their files are read and written on a thread: the loop stays free.

    @unary_call("CreateGlossary")
    async def CreateGlossary(
        self, request: pb.CreateGlossaryRequest, context: Context, call: CallRecord
    ) -> pb.Glossary:
        self._backends.serving()
        new = await asyncio.to_thread(new_glossary_from_pb, request)  # up to 10,000 entries to read and check
        return glossary_info_to_pb((await asyncio.to_thread(self.glossaries.create, new)).info)

    @unary_call("GetGlossary")
    async def GetGlossary(self, request: pb.GetGlossaryRequest, context: Context, call: CallRecord) -> pb.Glossary:
        self._backends.serving()
        return await asyncio.to_thread(lambda: glossary_to_pb(self.glossaries.get(request.glossary_id)))

    @unary_call("ListGlossaries")
    async def ListGlossaries(
        self, request: pb.ListGlossariesRequest, context: Context, call: CallRecord
    ) -> pb.ListGlossariesResponse:
        self._backends.serving()
        infos = await asyncio.to_thread(self.glossaries.list_glossaries)
        return pb.ListGlossariesResponse(glossaries=[glossary_info_to_pb(info) for info in infos])

    @unary_call("DeleteGlossary")
    async def DeleteGlossary(
        self, request: pb.DeleteGlossaryRequest, context: Context, call: CallRecord
    ) -> pb.DeleteGlossaryResponse:
        self._backends.serving()
        await asyncio.to_thread(self.glossaries.delete, request.glossary_id)
        return pb.DeleteGlossaryResponse()

    async def _typed(self, request: pb.TranslateRequest) -> TranslateCall:
        """The request as its typed call, the terms of its stored glossary (if it names one) after its own: what
        routing and the decoder see, never the id."""
        typed = from_pb(request)
        if not request.options.glossary_id:
            return typed
        glossary = await asyncio.to_thread(self.glossaries.get, request.options.glossary_id, "options.glossary_id")
        return with_glossary(typed, glossary)

    def _fits(self, message: M, limits: RequestLimits) -> M:
        """The message, if grpc may send it; else a status we send and count (grpc would fail it after us)."""
        if (size := message.ByteSize()) > limits.max_response_bytes:
            advice = (
                "split the text across requests or ask for fewer hypotheses"  # one text's result is the message
                if isinstance(message, pb.TranslateStreamResponse)
                else "send fewer texts or hypotheses per request, or use TranslateStream (one message per text)"
            )
            raise ResponseTooLarge(
                f"the response would be {size:,} bytes, over the server's limit of {limits.max_response_bytes:,}"
                f" (each hypothesis repeats its text's whitespace): {advice}"
            )
        return message

    def _refused(self, refusal: TextRefused, model: str = "") -> pb.TextResult:
        """A text refused alone (allow_partial), counted by its status under the model it was routed to, if any."""
        if self.metrics is not None:
            self.metrics.observe_text_error(status_for(refusal.error)[0].name, model)
        return refusal_to_pb(refusal)

    def _parse(
        self, request: TranslateCall, backend: Backend, route: LanguageRoute, call: CallRecord, stream: bool
    ) -> TranslateJob:
        """The request's texts as the method runs them (the unary method never streams tokens)."""
        job = parse_request(request, route, backend.spec, backend.limits, backend.model)
        call.lang_pair, call.model = job.lang_pair, backend.model.name
        return job if stream else replace(job, options=replace(job.options, stream_tokens=False))

    async def _parts(
        self, request: TranslateCall, context: Context, call: CallRecord, stream: bool
    ) -> tuple[list[JobPart], list[TextRefused]]:
        """The request as jobs, one per model pair (server.edge.request_parts), and with allow_partial, the texts
        refused alone before any job took them (by their position in the request)."""
        parse = partial(self._parse, call=call, stream=stream)
        refused: list[TextRefused] = []
        refuse = refused.append if request.allow_partial else None
        if request.options.source_language:
            return whole_request(request, self._backends, parse, refuse), refused
        if self._grouping is None:
            self._backends.serving()  # while the models load: Unavailable, as for any call
            raise Refusal.NO_DETECTION.error()
        return await self._grouping.parts(request, self._backends, parse, _deadline(context), refuse), refused

    def _translate_parts(
        self, parts: list[JobPart], context: Context, call: CallRecord
    ) -> AsyncGenerator[tuple[JobPart, TextTranslation | PartialSentence | TextRefused], None]:
        return merged_items(parts, lambda part: self._translate(part, context, call))

    async def _translate(
        self, part: JobPart, context: Context, call: CallRecord
    ) -> AsyncGenerator[TextTranslation | PartialSentence | TextRefused, None]:
        """Texts as they finish (blank ones first), with partial sentences in between when streaming tokens.

        Admitted by the engine first, holding the queue places for the sentences it counts
        (`server.edge.admission`): a request the queue cannot take is refused before any splitting, and
        a drain that begins while the texts are still being split waits for this call instead of
        refusing it at submit. Splitting then waits for
        a lull in the calls arriving (`server.edge.preparation`): no refusal waits behind it.
        """
        job, backend = part.job, part.backend
        call.texts = len(job.texts)
        call.trace.describe(backend.model.name, job.lang_pair, job.options.beam_size)
        holds = sentences_to_hold(job.texts, backend.limits.max_sentences)
        with self._lane.arrival(), backend.engine.admission(holds) as admission:
            refused: list[TextRefused] = []  # texts over a limit, where the request allows partial results
            refuse = refused.append if job.allow_partial else None
            prepare = _preparation(job, backend, part.indices, self.metrics, refuse)  # parsing, splitting, tokenizing
            chars = sum(len(text) for text in job.texts)
            with _timed_preparation(self.metrics, backend.model.name):
                assembler = await self._lane.prepare(prepare, chars, _deadline(context))
            for refusal in refused:
                yield refusal
            for blank in assembler.blank_texts():
                yield blank
            if not assembler.sources:
                return
            sources = assembler.sources
            key_of: Callable[[list[int]], CacheKey] | None = _cache_key(job, backend)
            if terms := assembler.terms():  # the cache keys sentences by their ids alone: terms decode around it
                job, key_of = replace(job, options=replace(job.options, terms=terms)), None
            # A long document's markup (or a long text's placeholders) is put back around its translation off the
            # loop, as it was parsed: placing a page's inline tags holds the loop for a while per hypothesis
            placed = job.text_type is not TextType.TEXT or job.placeholders is Placeholders.KEEP
            render_in_thread = placed and chars > INLINE_PREPARE_CHARS
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
                    done_with = (event.sentence_index, event.hypotheses, event.input_tokens)
                    if render_in_thread:
                        done = await asyncio.to_thread(assembler.sentence_done, *done_with)
                    else:
                        done = assembler.sentence_done(*done_with)
                    if done is not None:
                        _count_text(call, done)
                        if self.metrics is not None and done.terms.requested:
                            self.metrics.observe_terms(done.terms, backend.model.name)
                        yield done


def _preparation(
    job: TranslateJob, backend: Backend, positions: list[int], metrics: Metrics | None, refuse: Refuse | None = None
) -> Callable[[], RequestAssembler]:
    """The request's texts to the engine's sentences: parsed (HTML/XML), split and tokenized, when called; a limit's
    message names a text by `positions`, its place in the client's request; `metrics` count the sentences cut;
    `refuse` takes a text over a limit, refused alone (else the limit fails the call)."""
    on_cut = None if metrics is None else partial(metrics.observe_cut, model=backend.model.name)
    texts = partial(
        prepare_texts,
        source_lang=job.sentence_lang,  # whose sentence rules split the texts
        target_lang=job.target_lang,
        model_source=job.source_lang,  # the model's code, which an NLLB or M2M100 source starts with
        tokenizer=backend.tokenizer,
        limits=backend.limits,
        max_tokens=backend.spec.max_source_len,
        on_cut=on_cut,
        glossary=term_index(job.glossary) if job.glossary else None,
    )
    limits, n_best = backend.limits, job.options.num_hypotheses
    prepare = partial(prepare_request, job.texts, job.text_type, texts, backend.tokenizer, limits, n_best, positions)
    return partial(prepare, refuse, job.placeholders)


def _deadline(context: Context) -> float | None:
    """The call's deadline as a time.monotonic() time; None: it has none."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


@contextmanager
def _timed_preparation(metrics: Metrics | None, model: str) -> Iterator[None]:
    """Time a call's preparation into the metrics, by how it ended."""
    started, outcome = time.monotonic(), "failed"
    try:
        yield
        outcome = "done"
    except (CallEnded, asyncio.CancelledError):
        outcome = "ended"
        raise
    finally:
        if metrics is not None:
            metrics.observe_preparation(time.monotonic() - started, outcome, model)


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
        self._mailbox = mailbox_of(loop)
        self._events: asyncio.Queue[Event | int] = asyncio.Queue()  # an int: that sentence's latest tokens
        self._latest_tokens: dict[int, TokensEvent] = {}

    def deliver(self, event: Event) -> None:
        """The engine's callback: runs on the engine thread, so it only posts the put to the loop."""
        self._mailbox.post(self._put, event)

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
