"""A bounded cache of finished sentences, so repeated strings (menus, buttons, boilerplate) skip the model.

An entry is keyed by everything that decides a sentence's hypotheses: the model's weights digest and
exported variant, the language pair, the decoding options that change the output (beam width, length
penalty, output limit, hypotheses returned; not streaming) and the sentence's source ids (the target
tag included). Decoding is deterministic and independent of the batch, so an entry is exactly what the
engine would answer again. Least recently used entries go first when either bound, entries or bytes,
would be passed.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Protocol

from server.core.beam import Hypothesis
from server.core.engine_client import Cancellable
from server.core.events import Event, RequestDone, SentenceDone, TokensEvent
from server.core.work import DecodeOptions

# What an entry holds beyond its ids' 4 bytes each, measured with tracemalloc (tests/test_response_cache.py): the
# key and value objects, the dict's slot and the stored size; per hypothesis its tuple, bytes and two floats
ENTRY_OVERHEAD_BYTES = 360
HYPOTHESIS_OVERHEAD_BYTES = 105
ID_BYTES = 4  # ids are packed as unsigned 32-bit integers: a Python int object in a tuple would take 36


@dataclass(frozen=True, slots=True)
class CacheKey:
    model_sha256: str  # digest of the weights the graphs were exported from
    variant: str  # fp32, int8, fp16: each decodes slightly differently
    lang_pair: str
    options: DecodeOptions  # stream_tokens cleared: it changes how results arrive, not what they are
    source: bytes  # tag + pieces + EOS, packed (`pack`)

    @staticmethod
    def of(model_sha256: str, variant: str, lang_pair: str, options: DecodeOptions, source: list[int]) -> CacheKey:
        return CacheKey(model_sha256, variant, lang_pair, _unstreamed(options), pack(source))


@lru_cache(maxsize=256)
def _unstreamed(options: DecodeOptions) -> DecodeOptions:
    """One options object for every key of a request (and of requests alike), not a copy per sentence."""
    return replace(options, stream_tokens=False)


def pack(ids: Iterable[int]) -> bytes:
    return array(ID_TYPECODE, ids).tobytes()


def unpack(packed: bytes) -> tuple[int, ...]:
    ids = array(ID_TYPECODE)
    ids.frombytes(packed)
    return tuple(ids)


ID_TYPECODE = "I"  # unsigned int: 4 bytes on every platform CPython builds for


@dataclass(frozen=True, slots=True)
class CachedSentence:
    packed: tuple[tuple[bytes, float, float], ...]  # each hypothesis as the engine gave it, best first: ids, scores
    input_tokens: int

    @staticmethod
    def of(hypotheses: Iterable[Hypothesis], input_tokens: int) -> CachedSentence:
        return CachedSentence(tuple((pack(h.tokens), h.score, h.normalized) for h in hypotheses), input_tokens)

    @property
    def hypotheses(self) -> list[Hypothesis]:
        return [Hypothesis(unpack(tokens), score, normalized) for tokens, score, normalized in self.packed]


class CacheObserver(Protocol):
    """Receives the cache's counts; implemented by server.edge.metrics (labelled with the model)."""

    def observe_lookups(self, hits: int, misses: int) -> None: ...

    def observe_evictions(self, count: int) -> None: ...

    def set_size(self, entries: int, size_bytes: int) -> None: ...


def entry_bytes(key: CacheKey, value: CachedSentence) -> int:
    """The memory an entry holds: its packed ids and a measured cost per object."""
    ids = len(key.source) + sum(len(tokens) for tokens, _, _ in value.packed)
    return ENTRY_OVERHEAD_BYTES + ids + HYPOTHESIS_OVERHEAD_BYTES * len(value.packed)


class ResponseCache:
    """Least recently used entries, bounded in count and estimated bytes; safe from any thread."""

    def __init__(self, max_entries: int, max_bytes: int, observer: CacheObserver | None = None) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"a cache needs room: max_entries={max_entries}, max_bytes={max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._observer = observer
        self._entries: OrderedDict[CacheKey, tuple[CachedSentence, int]] = OrderedDict()  # value, its bytes
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def lookup(self, keys: list[CacheKey]) -> list[CachedSentence | None]:
        """The entry of each key, or None; found ones become the most recently used. Counted: one miss per
        distinct missing key, a hit for every other (`submit_through` decodes a repeated sentence once)."""
        found: list[CachedSentence | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                found.append(None if entry is None else entry[0])
        if self._observer is not None:  # a key repeated among `keys` misses once: its one decode answers the rest
            misses = len({key for key, value in zip(keys, found, strict=True) if value is None})
            self._observer.observe_lookups(len(found) - misses, misses)
        return found

    def put(self, key: CacheKey, value: CachedSentence) -> None:
        """Store an entry, evicting the least recently used until it fits; one larger than the cache is not kept."""
        size = entry_bytes(key, value)
        if size > self.max_bytes:
            return
        evicted = 0
        with self._lock:
            if (old := self._entries.pop(key, None)) is not None:
                self._bytes -= old[1]
            while self._entries and (len(self._entries) >= self.max_entries or self._bytes + size > self.max_bytes):
                _, (_, freed) = self._entries.popitem(last=False)
                self._bytes -= freed
                evicted += 1
            self._entries[key] = (value, size)
            self._bytes += size
            entries, total = len(self._entries), self._bytes
        if self._observer is not None:
            if evicted:
                self._observer.observe_evictions(evicted)
            self._observer.set_size(entries, total)


class _Answered:
    """The handle of a request the cache answered whole: nothing is left to cancel."""

    def cancel(self, deadline_passed: bool = False) -> None:
        return None


def submit_through(
    cache: ResponseCache | None,
    key_of: Callable[[list[int]], CacheKey] | None,  # a sentence's key; with `cache`
    sources: list[list[int]],
    on_event: Callable[[Event], None],
    submit: Callable[[list[list[int]], Callable[[Event], None]], Cancellable],
) -> Cancellable:
    """Submit a request's sentences with `submit`, answering those in the cache at once (before anything the
    engine sends) and decoding a sentence repeated within the request once. Events reach `on_event` with
    the request's own sentence indices, RequestDone last; what the engine finishes is stored."""
    if cache is None or key_of is None:
        return submit(sources, on_event)
    keys = [key_of(source) for source in sources]
    found = cache.lookup(keys)
    slots: dict[CacheKey, int] = {}  # a missing sentence -> its index in what the engine decodes
    fans: list[list[int]] = []  # per decoded sentence: the request's indices it answers
    for index, (key, value) in enumerate(zip(keys, found, strict=True)):
        if value is None:
            slot = slots.setdefault(key, len(fans))
            if slot == len(fans):
                fans.append([])
            fans[slot].append(index)
    for index, value in enumerate(found):
        if value is not None:
            on_event(SentenceDone(index, value.hypotheses, value.input_tokens))
    if not fans:
        on_event(RequestDone())
        return _Answered()

    def relay(event: Event) -> None:  # on the engine's thread
        if isinstance(event, SentenceDone):
            cache.put(keys[fans[event.sentence_index][0]], CachedSentence.of(event.hypotheses, event.input_tokens))
        if isinstance(event, SentenceDone | TokensEvent):
            for index in fans[event.sentence_index]:
                on_event(replace(event, sentence_index=index))
        else:
            on_event(event)

    return submit([sources[indices[0]] for indices in fans], relay)
