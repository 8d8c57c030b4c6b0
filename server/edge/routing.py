"""Which of a model's language pairs a client's two codes mean (model.languages does the matching).

A client may write `pt-BR`, `pt`, `por` or the model's own `pob`; the route names the model's own codes,
which the tokenizer's tags and the metrics use, and the language whose sentence rules split the texts:
the model's source, or the client's code where the model's source is a group (`mul`), which says nothing
about where a sentence ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from model.languages import Fit, bcp47, match_fit, parse

MAX_LISTED_PAIRS = 24  # pairs an error message names before pointing at ListModels


@dataclass(frozen=True)
class LanguageRoute:
    """A client's language pair resolved against one model."""

    source: str  # the model's source code
    target: str  # the model's target code
    sentence_language: str  # whose sentence rules split the texts
    fit: tuple[Fit, Fit]  # how well source and target fit: the best-fitting model serves the request


@lru_cache(maxsize=4096)
def route_pair(client_source: str, client_target: str, pairs: tuple[tuple[str, str], ...]) -> LanguageRoute | None:
    """The model pair (among `pairs`) that the client's codes mean, None if none does.

    Raises model.languages.AmbiguousLanguage where a code fits several of the model's codes equally.
    """
    found = match_fit(client_source, [s for s, _ in pairs])
    if found is None:
        return None
    source_fit, source = found
    found = match_fit(client_target, [t for s, t in pairs if s == source])
    if found is None:
        return None
    target_fit, target = found
    sentence_language = client_source if parse(source).is_group else source
    return LanguageRoute(source, target, sentence_language, (source_fit, target_fit))


def describe_pairs(models: dict[str, tuple[tuple[str, str], ...]]) -> str:
    """The served pairs for an error message, with their BCP-47 spelling where it differs; long lists cut."""
    listed: list[str] = []
    for name, pairs in models.items():
        shown = [_pair_text(s, t) for s, t in pairs[:MAX_LISTED_PAIRS]]
        hidden = len(pairs) - len(shown)
        more = f" and {hidden} more (ListModels lists them)" if hidden else ""
        listed.append(f"{name}: {', '.join(shown)}{more}")
    return "; ".join(listed)


def _pair_text(source: str, target: str) -> str:
    spelled = f"{bcp47(source)}-{bcp47(target)}"
    return f"{source}-{target}" + (f" ({spelled})" if spelled != f"{source}-{target}" else "")
