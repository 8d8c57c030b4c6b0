"""Which of a model's language pairs a client's two codes mean (model.languages does the matching).

A client may write `pt-BR`, `pt`, `por` or the model's own `pob`; the route names the model's own codes,
which the tokenizer's tags and the metrics use, and the language whose sentence rules split the texts:
the model's source, or the client's code where the model's source is a group (`mul`), which says nothing
about where a sentence ends.
"""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass
from functools import lru_cache

from model.directions import Directions
from model.languages import AmbiguousLanguage, Fit, bcp47, match, match_fit, parse, same_language

MAX_LISTED_PAIRS = 24  # pairs an error message names before pointing at ListModels


@dataclass(frozen=True)
class LanguageRoute:
    """A client's language pair resolved against one model."""

    source: str  # the model's source code
    target: str  # the model's target code
    sentence_language: str  # whose sentence rules split the texts
    fit: tuple[Fit, Fit]  # how well source and target fit: the best-fitting model serves the request


@lru_cache(maxsize=4096)
def route_pair(client_source: str, client_target: str, directions: Directions) -> LanguageRoute | None:
    """The model pair (among `directions`) that the client's codes mean, None if none does: the source among the
    model's sources, then the target among those it writes from that source.

    Raises model.languages.AmbiguousLanguage where a code fits several of the model's codes equally.
    """
    found = match_fit(client_source, directions.sources)
    if found is None:
        return None
    source_fit, source = found
    found = match_fit(client_target, directions.targets_from(source))
    if found is None:
        return None
    target_fit, target = found
    sentence_language = client_source if parse(source).is_group else source
    return LanguageRoute(source, target, sentence_language, (source_fit, target_fit))


@lru_cache(maxsize=1024)
def sources_toward(client_target: str, directions: Directions) -> tuple[str, ...]:
    """The model's sources that `route_pair` takes toward the client's target code, in the model's order. An
    any-to-any model's are found without routing each source: every source but the target's own code routes to
    the target's best fit, and that code to the next best, if one fits; none where the code is ambiguous."""
    if not directions.any_to_any:
        return tuple(source for source in directions.sources if _routes(source, client_target, directions))
    try:
        best = match(client_target, directions.targets)
    except AmbiguousLanguage:
        return ()
    if best is None:
        return ()
    return tuple(s for s in directions.sources if s != best or _routes(s, client_target, directions))


def _routes(source: str, client_target: str, directions: Directions) -> bool:
    with suppress(AmbiguousLanguage):
        return route_pair(source, client_target, directions) is not None
    return False


def describe_pairs(models: dict[str, Directions]) -> str:
    """The served pairs for an error message, with their BCP-47 spelling where it differs; long lists cut, an
    any-to-any model's languages counted."""
    return "; ".join(f"{name}: {describe_directions(directions)}" for name, directions in models.items())


def describe_directions(directions: Directions) -> str:
    """One model's pairs as `describe_pairs` names them."""
    if directions.any_to_any:
        return (
            f"any of {len(directions.sources)} languages into any of {len(directions.targets)} but itself"
            " (ListModels lists them)"
        )
    shown = [_pair_text(s, t) for s, t in directions.listed[:MAX_LISTED_PAIRS]]
    hidden = directions.count() - len(shown)
    return ", ".join(shown) + (f" and {hidden} more (ListModels lists them)" if hidden else "")


def near_misses(client_source: str, client_target: str, models: dict[str, Directions]) -> str:
    """What the models have of a language the client named in a script or region none serves, for the refusal:
    `sr-Latn`: Serbian as srp_Cyrl (sr-Cyrl) in NLLB's; '' where they have nothing of it."""
    said: list[str] = []
    for client, side in ((client_source, "sources"), (client_target, "targets")):
        offered = [code for directions in models.values() for code in getattr(directions, side)]
        with suppress(AmbiguousLanguage):  # several fit: the refusal says so already
            if not client or match_fit(client, offered) is not None:
                continue
        if others := same_language(client, offered):
            codes = ", ".join(f"{code} ({bcp47(code)})" if bcp47(code) != code else code for code in others)
            said.append(f"{client!r} is not served as written; the served {side[:-1]}s of its language: {codes}")
    return "; ".join(said)


def _pair_text(source: str, target: str) -> str:
    spelled = f"{bcp47(source)}-{bcp47(target)}"
    return f"{source}-{target}" + (f" ({spelled})" if spelled != f"{source}-{target}" else "")
