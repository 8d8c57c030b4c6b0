"""The loaded models a server translates with, and the choice of the one that serves a call: the best fit of
the client's language codes (server.edge.routing), among the model it names, and the least loaded replica."""

from __future__ import annotations

import itertools
from contextlib import suppress
from dataclasses import dataclass

from model.languages import AmbiguousLanguage, same_written_language, written_language
from model.tokenizer import TextTokenizer
from server.core.engine_client import EngineClient
from server.core.events import DrainingError
from server.core.response_cache import ResponseCache
from server.core.runner import ModelSpec
from server.edge.convert import ModelDescription
from server.edge.errors import InvalidRequest, Unavailable
from server.edge.refusals import Refusal
from server.edge.request import CallOptions
from server.edge.routing import LanguageRoute, describe_pairs, near_misses, route_pair, sources_toward
from server.text.documents import RequestLimits


@dataclass(frozen=True)
class Backend:
    """A loaded model the servicer translates with, and its engine."""

    engine: EngineClient
    spec: ModelSpec  # the runner's spec: languages and token limits
    tokenizer: TextTokenizer
    model: ModelDescription
    limits: RequestLimits  # what its engine can take
    cache: ResponseCache | None = None  # finished sentences of the model, shared by its replicas; None = off


class Backends:
    """Every loaded backend in load order (none while the models load), routed among per call."""

    def __init__(self, backends: list[Backend], first_turn: int = 0) -> None:
        self._backends = list(backends)
        # Round robin among equally loaded engines, from this server process's own turn (its index among
        # `--processes`): fronts sharing the engines see a call another has just sent only once the engine
        # reports it, so two calls arriving together at two processes must start on different engines.
        self._turn = itertools.count(first_turn)

    def serving(self) -> list[Backend]:
        """Every backend, while the server takes calls; Unavailable while loading, DrainingError once draining."""
        if not self._backends:
            raise Unavailable("the model is still loading; retry shortly")
        # Every engine drains together: every new call, ListModels too, goes to another replica (a failed
        # engine refuses at admission, saying so).
        if any(b.engine.draining and not b.engine.failed for b in self._backends):
            raise DrainingError("the server is draining")
        return self._backends

    def route(self, options: CallOptions, source: str | None = None) -> tuple[Backend, LanguageRoute]:
        """The model for the request and its pair: the best fit of the client's codes (model.languages) among
        every model serving them, among those of its name if it names one; ties go to the model with the fewest
        pairs sharing the route's source or target, then the first in load order, and among one model's engines
        to the least loaded. `source` overrides the request's (a detected language)."""
        backends = self.serving()
        if options.model:
            backends = [b for b in backends if b.model.name == options.model]
            if not backends:
                served = ", ".join(dict.fromkeys(b.model.name for b in self._backends))
                raise Refusal.UNKNOWN_MODEL.error(model=options.model, served=served)
        source = options.source_language if source is None else source
        target = options.target_language
        if not target:
            raise Refusal.NO_TARGET.error(pairs=_served_pairs(backends))
        routes, ambiguous = [], None
        for backend in backends:  # a code one model cannot tell apart may fit another's plainly
            try:
                if route := route_pair(source, target, backend.spec.directions):
                    routes.append((backend, route))
            except AmbiguousLanguage as err:
                ambiguous = ambiguous or err
        if not routes and ambiguous is not None:
            raise Refusal.AMBIGUOUS.error(ambiguous=ambiguous, pairs=_served_pairs(backends)) from ambiguous
        if not routes and same_written_language(source, target):  # a model serving such a pair has routed above
            raise Refusal.SAME_LANGUAGE.error(source=source, target=target, pairs=_served_pairs(backends))
        if not routes:  # the codes quoted: the client's own strings, exactly as sent
            nearest = near_misses(source, target, {b.model.name: b.spec.directions for b in backends})
            raise Refusal.UNSUPPORTED_PAIR.error(
                source=source, target=target, nearest=f"{nearest}; " if nearest else "", pairs=_served_pairs(backends)
            )
        best = max(route.fit for _, route in routes)
        # Among equal fits the most specialised model (opus-mt-en-de before a multilingual en-mul, opus-mt-fr-en
        # before opus-mt-ROMANCE-en), then the first in load order.
        backend, route = min(((b, r) for b, r in routes if r.fit == best), key=lambda found: _breadth(*found))
        replicas = [b for b, r in routes if b.model.name == backend.model.name]
        if len(replicas) == 1:
            return backend, route
        # The least loaded engine of the model; ties taken in turn, so a burst of idle-time calls spreads out.
        start = next(self._turn) % len(replicas)
        return min(replicas[start:] + replicas[:start], key=lambda b: b.engine.load), route

    def any_language_source(self, options: CallOptions) -> str | None:
        """`mul` where a served model takes any language as its source toward the request's target: such a model
        reads a text without being told its language, so a text no detection decides can go to it."""
        for backend in self.serving():
            if ANY_LANGUAGE in backend.spec.directions.sources:
                with suppress(InvalidRequest):
                    self.route(options, source=ANY_LANGUAGE)
                    return ANY_LANGUAGE
        return None

    def sources_toward(self, options: CallOptions) -> list[str]:
        """The served sources that pair with the request's target (of the model it names, if it names one), one per
        written language, in load order; InvalidRequest naming the served pairs where none does. Each model's
        sources are those that route toward the target (an any-to-any model's: all but the target itself)."""
        backends = [b for b in self.serving() if not options.model or b.model.name == options.model]
        sources: list[str] = []
        written: set[tuple[str, str]] = set()  # the written languages among `sources`
        for backend in backends:
            for source in sources_toward(options.target_language, backend.spec.directions):
                key = written_language(source)  # None: a group, which is no one language
                if key is None or key not in written:
                    sources.append(source)
                    written |= {key} if key else set()
        if not sources and backends:
            raise Refusal.NO_MODEL_INTO_TARGET.error(target=options.target_language, pairs=_served_pairs(backends))
        return sources

    def any_source(self, options: CallOptions) -> str:
        """A served source that pairs with the request's target (of the model it names, if it names one), for texts
        no language routes; InvalidRequest as `sources_toward` raises it."""
        sources = self.sources_toward(options)
        return sources[0] if sources else self.serving()[0].spec.directions.sources[0]  # routing names the unknown


ANY_LANGUAGE = "mul"  # OPUS-MT's source group of every language (`ROMANCE`, `gem`... name families)


def _served_pairs(backends: list[Backend]) -> str:
    return "supported pairs: " + describe_pairs({b.model.name: b.spec.directions for b in backends})


def _breadth(backend: Backend, route: LanguageRoute) -> int:
    """How many of the model's pairs share the route's source or target: 1 for a model made for the pair."""
    return backend.spec.directions.sharing(route.source, route.target)
