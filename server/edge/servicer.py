"""The Translator gRPC servicer: validate, convert, delegate to the engine, convert back.

Each request is submitted to the engine as one flat list of sentences; the engine's events arrive
on its thread and are handed to this request's `CallInbox` on the event loop. Errors
become statuses in `server.edge.errors`; nothing here catches an exception to choose a status.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

import grpc.aio

from model.tokenizer import TextTokenizer
from server.backend.engine_process import EngineProcess
from server.core.documents import Assembler, PartialSentence, RequestLimits, TextTranslation, prepare_texts
from server.core.engine import (
    Admission,
    DrainingError,
    Engine,
    Event,
    RequestDone,
    RequestFailed,
    SentenceDone,
    TokensEvent,
)
from server.core.runner import ModelSpec
from server.edge.admission import sentences_to_hold
from server.edge.convert import (
    ModelDescription,
    TranslateJob,
    model_info_to_pb,
    parse_request,
    partial_to_pb,
    text_result_to_pb,
)
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
from server.edge.preparation import PreparationLane
from server.edge.tracing import Tracing
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc

Context = grpc.aio.ServicerContext  # the generic parameters add nothing to these signatures
M = TypeVar("M", pb.TranslateResponse, pb.TranslateStreamResponse)


@dataclass(frozen=True)
class Backend:
    """A loaded model the servicer translates with, and its engine."""

    engine: Engine | EngineProcess
    spec: ModelSpec  # the runner's spec: languages and token limits
    tokenizer: TextTokenizer
    model: ModelDescription
    limits: RequestLimits  # what its engine can take


class TranslatorServicer(pb_grpc.TranslatorServicer):
    def __init__(self, limits: RequestLimits, metrics: Metrics | None = None, tracing: Tracing | None = None) -> None:
        self.limits = limits  # before loading: the documented limits, for refusals that need one
        self.metrics = metrics
        self.tracing = tracing
        self._backends: list[Backend] = []
        self._turn = itertools.count()  # round robin among equally loaded engines
        self._lane = PreparationLane()  # splits and tokenizes admitted calls between arrivals

    def attach(self, backends: list[Backend]) -> None:
        """Start serving with loaded, warmed-up models, routed by language pair (and name) in this order."""
        self._backends = list(backends)

    @unary_call("Translate")
    async def Translate(self, request: pb.TranslateRequest, context: Context, call: CallRecord) -> pb.TranslateResponse:
        backend = self._route(request.options)
        job = self._parse(request, backend, call)
        job = replace(job, options=replace(job.options, stream_tokens=False))
        results: list[TextTranslation] = []
        async with aclosing(self._translate(job, backend, context, call)) as items:
            async for item in items:
                if isinstance(item, TextTranslation):
                    results.append(item)
        results.sort(key=lambda r: r.index)
        return self._fits(pb.TranslateResponse(results=[text_result_to_pb(r, job) for r in results]), backend.limits)

    @stream_call("TranslateStream")
    async def TranslateStream(
        self, request: pb.TranslateRequest, context: Context, call: CallRecord
    ) -> AsyncGenerator[pb.TranslateStreamResponse, None]:
        backend = self._route(request.options)
        job = self._parse(request, backend, call)
        async with aclosing(self._translate(job, backend, context, call)) as items:
            async for item in items:
                if isinstance(item, TextTranslation):
                    yield self._fits(pb.TranslateStreamResponse(result=text_result_to_pb(item, job)), backend.limits)
                else:
                    yield pb.TranslateStreamResponse(partial=partial_to_pb(item))

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

    def _route(self, options: pb.TranslationOptions) -> Backend:
        """The model for the request: the first (in load order) serving its pair, among those of its name if
        it names one. Without both languages, the first model, whose parsing says what is missing."""
        backends = self._require_backends()
        if options.model:
            backends = [b for b in backends if b.model.name == options.model]
            if not backends:
                served = ", ".join(dict.fromkeys(b.model.name for b in self._backends))
                raise InvalidRequest(f"unknown model {options.model!r}; this server serves {served}")
        pair = (options.source_language, options.target_language)
        if not all(pair):
            return backends[0]
        serving = [b for b in backends if pair in b.spec.pairs]
        if not serving:
            models = {b.model.name: b.spec.pairs for b in backends}
            offered = "; ".join(f"{name}: {', '.join(f'{s}-{t}' for s, t in pairs)}" for name, pairs in models.items())
            raise InvalidRequest(f"unsupported language pair {pair[0]}-{pair[1]}; supported pairs: {offered}")
        replicas = [b for b in serving if b.model.name == serving[0].model.name]
        if len(replicas) == 1:
            return replicas[0]
        # The least loaded engine of the model; ties taken in turn, so a burst of idle-time calls spreads out.
        start = next(self._turn) % len(replicas)
        return min(replicas[start:] + replicas[:start], key=lambda b: b.engine.load)

    def _parse(self, request: pb.TranslateRequest, backend: Backend, call: CallRecord) -> TranslateJob:
        job = parse_request(request, backend.spec, backend.limits, backend.model)
        call.lang_pair, call.model = job.lang_pair, backend.model.name
        return job

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
            prepare = partial(
                prepare_texts,
                job.texts,
                job.source_lang,
                job.target_lang,
                backend.tokenizer,
                backend.limits,
                backend.spec.max_source_len,
            )
            texts = await self._lane.prepare(prepare, sum(len(text) for text in job.texts))
            assembler = Assembler(backend.tokenizer, texts, job.options.num_hypotheses)
            for blank in assembler.blank_texts():
                yield blank
            if not assembler.sources:
                return
            events_of = _engine_events(backend.engine, admission, assembler.sources, job, context, call)
            async with aclosing(events_of) as events:
                async for event in events:
                    if isinstance(event, TokensEvent):
                        yield assembler.partial(event.sentence_index, event.token_ids, finished=False)
                        continue
                    call.queue_wait_s = max(call.queue_wait_s, event.queue_wait_s)
                    output_tokens = len(event.hypotheses[0].tokens) if event.hypotheses else 0
                    call.trace.sentence(
                        event.sentence_index, call.submitted, event.queue_wait_s, event.input_tokens, output_tokens
                    )
                    if job.options.stream_tokens:
                        yield assembler.partial(event.sentence_index, event.hypotheses[0].tokens, finished=True)
                    done = assembler.sentence_done(event.sentence_index, event.hypotheses, event.input_tokens)
                    if done is not None:
                        _count_text(call, done)
                        yield done


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
    engine: Engine | EngineProcess,
    admission: Admission,
    sources: list[list[int]],
    job: TranslateJob,
    context: Context,
    call: CallRecord,
) -> AsyncGenerator[TokensEvent | SentenceDone, None]:
    """Submit one request and yield its events until it is done; cancel it if the caller stops early."""
    inbox = CallInbox(asyncio.get_running_loop())
    remaining = context.time_remaining()
    call.submitted = time.monotonic()
    deadline = None if remaining is None else call.submitted + remaining
    handle = engine.submit(
        sources, job.options, inbox.deliver, deadline=deadline, lang_pair=job.lang_pair, admitted=admission
    )
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
