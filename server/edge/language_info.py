"""The languages part of ListModels' ModelInfo: a model's listed pairs, or an any-to-any model's two sets of
languages (NLLB-200's 202: pairs would list some 40,000), each code with the BCP-47 spelling a client may send."""

from __future__ import annotations

from collections.abc import Mapping

from model.directions import Directions
from model.languages import bcp47_spellings
from server.proto.translation.v1 import translation_pb2 as pb


def language_codes(directions: Directions) -> list[str]:
    """Every code the model reads or writes, sorted."""
    return sorted({*directions.sources, *directions.targets})


def pairs_to_pb(directions: Directions, target_tags: Mapping[str, str]) -> list[pb.LanguagePair]:
    """The listed pairs with their spellings and tags; none for an any-to-any model (`any_to_any_to_pb`)."""
    spelt = bcp47_spellings(language_codes(directions))
    return [
        pb.LanguagePair(
            source=s, target=t, source_bcp47=spelt[s], target_bcp47=spelt[t], target_tag=target_tags.get(t, "")
        )
        for s, t in directions.listed
    ]


def any_to_any_to_pb(directions: Directions) -> pb.AnyToAny | None:
    """An any-to-any model's sources and targets with their spellings; None for a model that lists its pairs."""
    if not directions.any_to_any:
        return None
    spelt = bcp47_spellings(language_codes(directions))
    return pb.AnyToAny(
        sources=[pb.Language(code=code, bcp47=spelt[code]) for code in directions.sources],
        targets=[pb.Language(code=code, bcp47=spelt[code]) for code in directions.targets],
    )
