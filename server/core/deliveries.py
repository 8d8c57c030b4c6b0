"""Who receives each request's events: the engine thread hands every event to its request's owner here, and
the observer sees each finished sentence and each abandoned request on the way (engine thread only)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from server.core.events import Abandoned, Event, RequestDone, RequestFailed, SentenceDone
from server.core.observer import EngineObserver

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Owner:
    """Whoever submitted a request: where its events go, and the counters they are kept under."""

    on_event: Callable[[Event], None]
    lang_pair: str | None  # None: internal work (warmup) kept out of the per-language counters


class Owners:
    """The owners of the requests an engine holds, by request id; a final event retires its owner."""

    def __init__(self) -> None:
        self._by_id: dict[int, Owner] = {}

    def add(self, request_id: int, owner: Owner) -> None:
        self._by_id[request_id] = owner

    def request_ids(self) -> list[int]:
        return list(self._by_id)

    def take_all(self) -> list[Owner]:
        """Every owner, retired at once (the loop that held their requests is gone)."""
        owners = list(self._by_id.values())
        self._by_id.clear()
        return owners

    def deliver(
        self, events: list[tuple[int, Event]], abandoned: list[Abandoned], metrics: EngineObserver | None
    ) -> None:
        """Observe what failures left unfinished, then hand the events to their owners."""
        for unfinished in abandoned:  # before the owners (and their language pairs) retire
            owner = self._by_id.get(unfinished.request_id)
            if metrics is not None and owner is not None and owner.lang_pair is not None:
                reason = unfinished.reason.value
                metrics.observe_abandoned(owner.lang_pair, reason, unfinished.queued, unfinished.decoding)
        for request_id, event in events:
            final = isinstance(event, RequestDone | RequestFailed)
            owner = self._by_id.pop(request_id) if final else self._by_id[request_id]
            if metrics is not None and owner.lang_pair is not None and isinstance(event, SentenceDone):
                output = len(event.hypotheses[0].tokens) if event.hypotheses else 0
                metrics.observe_sentence(owner.lang_pair, event.input_tokens, output)
            notify([owner], event)


def notify(owners: Iterable[Owner], event: Event) -> None:
    """Call each owner back; a callback that raises is logged and the engine carries on."""
    for owner in owners:
        try:
            owner.on_event(event)
        except Exception:
            logger.exception("an event callback raised; the engine carries on")
