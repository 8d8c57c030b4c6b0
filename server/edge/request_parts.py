"""A Translate request as jobs, one per model pair, and the jobs' items merged as they come.

A request that names its source language is one job. One that leaves it to detection (server.edge.detect)
has its texts grouped by the language detected, each group a job of the model that serves that language;
texts without a letter (nothing to translate, or numbers and symbols any model takes) join the first job, and
texts surely detected in the target language itself, which no model translates, come back as they came (as search
engines' and DeepL's translators answer them). A text detection does not decide goes to a model that reads any
language, else to the one language the served models read toward the target, else to the language of most of
the request's other texts. An HTML or XML text is detected by the text it would have
translated (its units: no tag or attribute names, no script, style or code), so its markup does not vote.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from functools import partial

from model.languages import bcp47, same_written_language
from model.languages import parse as parse_language
from server.edge.backends import Backend, Backends
from server.edge.convert import TranslateJob
from server.edge.detect import MIN_MARGIN, Detection, SourceDetector
from server.edge.errors import InvalidRequest
from server.edge.metrics import Metrics
from server.edge.preparation import INLINE_PREPARE_CHARS
from server.edge.preparation_pool import PreparationPool
from server.edge.refusals import Refusal
from server.edge.request import CallOptions, TranslateCall, check_texts
from server.edge.routing import LanguageRoute
from server.text.checkpoints import checkpoint
from server.text.documents import (
    PartialSentence,
    Refuse,
    RequestLimits,
    TextLimitError,
    TextRefused,
    TextTranslation,
    model_text,
)
from server.text.markup import TextType
from server.text.markup_documents import parse_document

Parse = Callable[[TranslateCall, Backend, LanguageRoute], TranslateJob]  # the call's parsing of its texts
Item = TextTranslation | PartialSentence | TextRefused


@dataclass(frozen=True)
class DetectedSource:
    """The language a text was detected in, as its result reports it."""

    language: str  # BCP-47
    confidence: float  # as reported to the client (server.edge.detect.Detection.reported_confidence)


@dataclass(frozen=True)
class JobPart:
    """One model pair's share of a request: its job and where the job's texts sit in the request."""

    backend: Backend
    job: TranslateJob
    indices: list[int]  # request position of each of the job's texts
    detections: Mapping[int, Detection] = field(default_factory=dict)  # by request position, where detected
    unchanged: bool = False  # texts detected in the target language: answered as they came, by no engine
    # Counts a detected text by its language as it is answered (the metric of SourceGrouping); None: not counted
    count_detected: Callable[[str], None] | None = None

    def answered(self, result: TextTranslation) -> tuple[TextTranslation, DetectedSource | None]:
        """A result of the job at its text's place in the request, and the source its text was detected in (counted
        as answered), None where the request named its source."""
        index = self.indices[result.index]
        if (found := self.detections.get(index)) is None:
            return replace(result, index=index), None
        if self.count_detected is not None:  # answered: a call refused before its texts ran counts none
            self.count_detected(found.language)
        # The model's language in BCP-47 (`en` whether the model writes `en` or `eng`), as a request may name it;
        # the detected language itself where no model translated the text, or where the model's source is a
        # group (`mul`) and its code would say nothing
        named = not self.unchanged and not parse_language(self.job.source_lang).is_group
        language = bcp47(self.job.source_lang if named else found.language)
        return replace(result, index=index), DetectedSource(language, found.reported_confidence)

    async def unchanged_items(self) -> AsyncGenerator[TextTranslation, None]:
        """The part's texts as their own translations (an `unchanged` part's items)."""
        for index, text in enumerate(self.job.texts):
            yield TextTranslation(index, [(text, 0.0)], input_tokens=0, output_tokens=0, sentences=0)

    def original_partial(self, partial: PartialSentence) -> PartialSentence:
        return replace(partial, text_index=self.indices[partial.text_index])

    def original_refusal(self, refusal: TextRefused) -> TextRefused:
        return replace(refusal, index=self.indices[refusal.index])

    def with_texts(self, texts: Sequence[str], more: list[int]) -> JobPart:
        """This part with the request's texts at `more` added (texts with nothing to translate)."""
        indices = sorted([*self.indices, *more])
        job = replace(self.job, texts=[texts[i] for i in indices])
        return replace(self, job=job, indices=indices)


def whole_request(call: TranslateCall, backends: Backends, parse: Parse, refuse: Refuse | None = None) -> list[JobPart]:
    """A request that names its source language: one part, every text (with `refuse`, every text not over the
    length limit, and none where each is)."""
    backend, route = backends.route(call.options)
    kept = check_texts(call, backend.limits, refuse)
    return [JobPart(backend, parse(call.at(kept), backend, route), kept)] if kept else []


@dataclass(frozen=True)
class SourceGrouping:
    """Parts of a request that leaves its source language to detection: one per language detected (the first
    part's model and pair label the call's metrics)."""

    detector: SourceDetector
    limits: RequestLimits  # the documented limits, checked before detection reads the texts
    metrics: Metrics | None = None
    pool: PreparationPool = field(default_factory=PreparationPool)  # detection of long requests, a turn each

    async def parts(
        self,
        call: TranslateCall,
        backends: Backends,
        parse: Parse,
        deadline: float | None = None,
        refuse: Refuse | None = None,
    ) -> list[JobPart]:
        """The request's parts; CallEnded once `deadline` (a time.monotonic() time) passes during a long detection.
        `refuse` takes each text refused alone (over a limit, in a language no model serves or none detection tells)."""
        texts, options = call.texts, call.options
        kept = check_texts(call, self.limits, refuse)
        if not options.target_language:  # what routing would say, before any detection
            backends.route(options, source=options.source_language)
        sources = backends.sources_toward(options)  # a target no model writes is refused before detection
        if not sources:  # none of the model it names: an unknown model is the request's refusal, not each text's
            backends.route(options)
        read = partial(_detection_texts, texts, kept, options.text_type, self.limits, refuse)
        detect = partial(_detect_all, self.detector, read)
        small = sum(len(texts[i]) for i in kept) <= INLINE_PREPARE_CHARS and self.detector.loaded
        groups, found, undecided, blank = detect() if small else await self.pool.run(detect, deadline)
        _doubt_the_target(groups, found, undecided, options.target_language)
        parts: list[JobPart] = []
        if undecided and (anyone := backends.any_language_source(options)) is not None:
            # to a model that takes any language as its source, where one serves the target
            backend, route = backends.route(options, source=anyone)
            parts.append(JobPart(backend, parse(call.at(undecided), backend, route), undecided))
        elif undecided and len(sources) == 1:  # one language any model reads toward the target: it is theirs
            language = next((known for known in groups if same_written_language(known, sources[0])), sources[0])
            groups[language] = sorted([*groups.get(language, []), *undecided])
            found.update({i: Detection(language, 0.0) for i in undecided})  # confidence 0: no detection told
        elif undecided and groups:  # a name, "OK", a code snippet among texts whose language is told: theirs
            language = max(groups, key=lambda found_language: len(groups[found_language]))  # ties: the first told
            groups[language] = sorted([*groups[language], *undecided])
            found.update({i: Detection(language, 0.0) for i in undecided})  # confidence 0: told by the others
        elif undecided and refuse is None:
            raise _undecided(undecided)
        elif undecided and refuse is not None:
            for index in undecided:
                refuse(TextRefused(index, _undecided([index])))
        unchanged: list[int] = []
        for language, indices in groups.items():
            if same_written_language(language, options.target_language):  # already in it: no model would
                unchanged += indices  # translate it (a `mul` source model routes en to en, and would only paraphrase)
                continue
            try:
                backend, route = _route_detected(backends, options, language, indices, found)
            except InvalidRequest:
                if refuse is None:
                    raise
                _refuse_each(indices, partial(_route_detected, backends, options, language), found, refuse)
                continue
            job, detections = parse(call.at(indices), backend, route), {i: found[i] for i in indices}
            parts.append(JobPart(backend, job, indices, detections, count_detected=self._counter(backend)))
        if blank and parts:  # no letter: any model's
            parts[0] = parts[0].with_texts(texts, blank)
        elif blank:
            parts.append(_any_source_part(call, backends, parse, blank))
        if unchanged:  # as they came, by no engine; a part that has a job gives the options checked once
            model = parts[0] if parts else _any_source_part(call, backends, parse, unchanged)
            job = replace(model.job, texts=[texts[i] for i in unchanged])
            detections = {i: found[i] for i in unchanged}
            count = self._counter(None)  # no model saw them
            parts.append(JobPart(model.backend, job, unchanged, detections, unchanged=True, count_detected=count))
        return parts

    def _counter(self, backend: Backend | None) -> Callable[[str], None] | None:
        """What counts a part's detected texts by language, under the model that translates them (none: they come
        back as they came)."""
        if self.metrics is None:
            return None
        return partial(self.metrics.observe_detected, model=backend.model.name if backend else "")


def _any_source_part(call: TranslateCall, backends: Backends, parse: Parse, indices: list[int]) -> JobPart:
    """The request's texts at `indices` as a part of a model that pairs with its target (texts no language routes)."""
    backend, route = backends.route(call.options, source=backends.any_source(call.options))
    return JobPart(backend, parse(call.at(indices), backend, route), indices)


def _refuse_each(
    indices: list[int],
    route: Callable[[list[int], dict[int, Detection]], object],
    found: dict[int, Detection],
    refuse: Refuse,
) -> None:
    """Each of texts `indices`, detected in a language no model serves toward the target, refused alone with the
    refusal `route` (`_route_detected`) gives it."""
    for index in indices:
        try:
            route([index], found)
        except InvalidRequest as err:
            refuse(TextRefused(index, err))


UNCHANGED_MARGIN = 0.5  # a text comes back untranslated as already in the target language only this far ahead


def _doubt_the_target(
    groups: dict[str, list[int]], found: dict[int, Detection], undecided: list[int], target: str
) -> None:
    """Texts detected in the target language ahead of the next language by less than UNCHANGED_MARGIN, or not
    `sure` against the languages no model serves, made undecided: one comes back untranslated and unflagged when the
    detection is wrong ("Hallo" to English, taken for English at 0.65 against German's 0.35; "commit invalide %s",
    French, taken for English among German and English), which a translation by the model its request would take
    gets right and otherwise leaves about as it was."""
    for language in [known for known in groups if same_written_language(known, target)]:
        unsure = [i for i in groups[language] if found[i].margin < UNCHANGED_MARGIN or not found[i].sure]
        groups[language] = [i for i in groups[language] if i not in unsure]
        if not groups[language]:
            del groups[language]
        for index in unsure:
            del found[index]
        undecided[:] = sorted([*undecided, *unsure])


def _detection_texts(
    texts: tuple[str, ...], kept: list[int], text_type: TextType, limits: RequestLimits, refuse: Refuse | None
) -> list[str | None]:
    """What detection reads of each text at `kept` (None for the others): the text, or for HTML and XML its units
    (the text a translation replaces, attributes such as alt and title included) joined by spaces; TextLimitError
    as parsing gives it, or with `refuse`, the document refused alone."""
    read: list[str | None] = [None] * len(texts)
    for index in kept:
        if text_type is TextType.TEXT:
            read[index] = texts[index]
            continue
        try:
            read[index] = " ".join(parse_document(index, texts[index], text_type, limits).units)
        except TextLimitError as err:
            if refuse is None:
                raise
            refuse(TextRefused(index, err))
    return read


def _detect_all(
    detector: SourceDetector, read: Callable[[], list[str | None]]
) -> tuple[dict[str, list[int]], dict[int, Detection], list[int], list[int]]:
    """Texts (what `read` gives of them; None: refused) grouped by detected language, each text's detection, the
    texts no detection decides, and those without a letter (no language to tell, any model's)."""
    texts = read()
    groups: dict[str, list[int]] = {}
    found: dict[int, Detection] = {}
    undecided: list[int] = []
    blank: list[int] = []
    for index, text in enumerate(texts):
        checkpoint()
        if text is None:
            continue
        text = model_text(text)  # what the model would see: no soft hyphens or zero-width spaces inside words
        if not any(char.isalpha() for char in text):  # digits and symbols: no language to tell, any model's
            blank.append(index)
            continue
        detection = detector.detect(text)
        if detection is None:
            undecided.append(index)
            continue
        found[index] = detection
        groups.setdefault(detection.language, []).append(index)
    return groups, found, undecided, blank


def _listed(indices: list[int]) -> str:
    return ", ".join(f"texts[{i}]" for i in indices[:5]) + (f" and {len(indices) - 5} more" if len(indices) > 5 else "")


def _undecided(undecided: list[int]) -> InvalidRequest:
    return Refusal.UNDECIDED.error(texts=_listed(undecided), margin=MIN_MARGIN)


def _route_detected(
    backends: Backends, options: CallOptions, language: str, indices: list[int], found: dict[int, Detection]
) -> tuple[Backend, LanguageRoute]:
    if indistinct := found[indices[0]].indistinct:  # never a guess among them
        raise Refusal.INDISTINCT.error(texts=_listed(indices), language=language, languages=", ".join(indistinct))
    try:
        return backends.route(options, source=language)
    except InvalidRequest as err:
        confidence = min(found[i].confidence for i in indices)
        raise Refusal.DETECTED_UNROUTED.error(
            texts=_listed(indices), language=language, confidence=confidence, refusal=err
        ) from err


async def merged_items(
    parts: list[JobPart], translate: Callable[[JobPart], AsyncGenerator[Item, None]]
) -> AsyncGenerator[tuple[JobPart, Item], None]:
    """Every part's items as they come, each with its part; a part that fails fails the call (and ends the
    others: their engines drop their sentences)."""

    def items_of(part: JobPart) -> AsyncGenerator[Item, None]:
        return part.unchanged_items() if part.unchanged else translate(part)

    if len(parts) == 1:
        async with aclosing(items_of(parts[0])) as items:
            async for item in items:
                yield parts[0], item
        return
    queue: asyncio.Queue[tuple[JobPart, Item | Exception | None]] = asyncio.Queue()

    async def pump(part: JobPart) -> None:
        try:
            async with aclosing(items_of(part)) as items:
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
