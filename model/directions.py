"""The language directions a model translates, as its languages.json and its export's metadata declare them.

A model either lists its (source, target) pairs (`{"pairs": [["de", "en"], ...]}`: OPUS-MT, the trained model)
or takes any of its sources into any of its targets but the same code (`{"sources": [...], "targets": [...],
"any_to_any": true}`: NLLB-200's 202 languages, some 40,000 directions, never written out). Whoever asks
whether a direction is served asks `translates`, which answers by set membership; nothing enumerates an
any-to-any model's pairs. Torch-free: the importer, the export and the server read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LANGUAGES_FILE = "languages.json"  # written by the importer beside the tokenizer files


class DirectionsError(ValueError):
    """A languages declaration that is neither a list of pairs nor an any-to-any set."""


@dataclass(frozen=True)
class Directions:
    """The directions one model translates."""

    sources: tuple[str, ...]  # every code the model reads, in the model's order
    targets: tuple[str, ...]  # every code it writes
    listed: tuple[tuple[str, str], ...] = ()  # the pairs served, where they are listed; () where any_to_any
    any_to_any: bool = False  # every source into every target except the same code
    # The sets `translates` asks, made once
    _source_set: frozenset[str] = field(init=False, repr=False, compare=False)
    _target_set: frozenset[str] = field(init=False, repr=False, compare=False)
    _listed_set: frozenset[tuple[str, str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        assert not (self.any_to_any and self.listed), "an any-to-any model lists no pairs"
        for name, items in (("_source_set", self.sources), ("_target_set", self.targets), ("_listed_set", self.listed)):
            object.__setattr__(self, name, frozenset(items))

    @classmethod
    def of_pairs(cls, pairs: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> Directions:
        """A model that serves these pairs and no others."""
        listed = tuple((str(s), str(t)) for s, t in pairs)
        sources = tuple(dict.fromkeys(s for s, _ in listed))
        return cls(sources, tuple(dict.fromkeys(t for _, t in listed)), listed)

    @classmethod
    def between(cls, sources: list[str] | tuple[str, ...], targets: list[str] | tuple[str, ...]) -> Directions:
        """A model that takes any of `sources` into any of `targets` but the same code."""
        return cls(tuple(dict.fromkeys(sources)), tuple(dict.fromkeys(targets)), any_to_any=True)

    def translates(self, source: str, target: str) -> bool:
        if self.any_to_any:
            return source != target and source in self._source_set and target in self._target_set
        return (source, target) in self._listed_set

    def targets_from(self, source: str) -> tuple[str, ...]:
        """The targets the model writes from `source`, in its order."""
        if self.any_to_any:
            return tuple(t for t in self.targets if t != source) if source in self._source_set else ()
        return tuple(t for s, t in self.listed if s == source)

    def count(self) -> int:
        """How many directions: what a message says instead of listing an any-to-any model's."""
        if self.any_to_any:
            return len(self.sources) * len(self.targets) - len(self._source_set & self._target_set)
        return len(self.listed)

    def sharing(self, source: str, target: str) -> int:
        """How many directions start at `source` or end at `target`: 1 for a model made for that one pair."""
        if self.any_to_any:
            into_target = len(self._source_set - {source, target}) if target in self._target_set else 0
            return len(self.targets_from(source)) + into_target
        return sum(1 for s, t in self.listed if s == source or t == target)

    def to_json(self) -> dict[str, Any]:
        if self.any_to_any:
            return {"sources": list(self.sources), "targets": list(self.targets), "any_to_any": True}
        return {"pairs": [[s, t] for s, t in self.listed]}

    @classmethod
    def from_json(cls, data: object, where: str) -> Directions:
        """Either form `to_json` writes; DirectionsError naming `where` otherwise."""
        fields = data if isinstance(data, dict) else {}
        sources, targets, pairs = fields.get("sources"), fields.get("targets"), fields.get("pairs")
        if set(fields) == {"sources", "targets", "any_to_any"} and fields["any_to_any"] is True:
            if _codes(sources) and _codes(targets):
                return cls.between(sources, targets)  # type: ignore[arg-type]
        elif set(fields) == {"pairs"} and isinstance(pairs, list) and all(_codes(p) and len(p) == 2 for p in pairs):
            return cls.of_pairs([(s, t) for s, t in pairs])
        raise DirectionsError(
            f'{where}: expected {{"pairs": [["de", "en"], ...]}} or '
            f'{{"sources": [...], "targets": [...], "any_to_any": true}}'
        )


def _codes(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(code, str) and code for code in value)


def read_directions(model_dir: Path) -> Directions:
    """The directions the model in `model_dir` translates, from its languages.json."""
    path = model_dir / LANGUAGES_FILE
    return Directions.from_json(json.loads(path.read_text(encoding="utf-8")), str(path))
