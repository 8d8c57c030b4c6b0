"""Source-language detection for requests whose source_language is empty or "auto".

py3langid (a maintained fork of langid.py; its model ships in its wheel) classifies each text among the
languages the served models take as sources, which is what makes short texts decidable: on the test
set's two-word snippets it decides 89% of them at 0.9% error among six languages, against 33% among all it
knows (docs/service.md, `python -m bench.detect`). Where fewer than two served sources are detectable it
classifies among every language it knows, so that a French text sent to a German-only server is named
French and refused rather than called German. A text whose best language is not ahead of the next by more
than MIN_MARGIN in probability is undecided: the caller asks for source_language, never guesses. The
margin, unlike a floor on the best probability, means the same whatever the number of candidates (two
languages split an uninformative text about evenly, six about a sixth each).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from model.languages import iso639_1, parse

logger = logging.getLogger(__name__)

MIN_MARGIN = 0.2  # the best language's probability over the runner-up's: at or below it, no decision


@dataclass(frozen=True)
class Detection:
    """The language of one text."""

    language: str  # ISO 639-1 code, e.g. "de"
    confidence: float  # the detector's probability of it among its candidates, 0..1


class SourceDetector:
    """Detects a text's language among the served sources. The model loads on first use (about a second and
    some 75 MiB resident): a server whose clients always name the source never pays for it."""

    def __init__(self, sources: Iterable[str]) -> None:
        self._sources = list(dict.fromkeys(sources))
        self._lock = threading.Lock()
        self._identifier: Any = None
        self._candidates: list[str] = []
        self._undetectable: list[str] = []

    @property
    def loaded(self) -> bool:
        return self._identifier is not None

    @property
    def candidates(self) -> list[str]:
        """The languages texts are classified among (ISO 639-1)."""
        self._load()
        return self._candidates

    @property
    def undetectable(self) -> list[str]:
        """Served sources the detector cannot name: texts in them need source_language."""
        self._load()
        return self._undetectable

    def detect(self, text: str) -> Detection | None:
        """The text's language, or None where it is not ahead of the next by more than MIN_MARGIN."""
        self._load()
        ranked = self._identifier.rank(text)
        (language, best), runner_up = ranked[0], ranked[1][1] if len(ranked) > 1 else 0.0
        if best - runner_up <= MIN_MARGIN:
            return None
        return Detection(str(language), float(best))

    def _load(self) -> None:
        with self._lock:
            if self._identifier is not None:
                return
            import py3langid

            identifier = py3langid.langid.LanguageIdentifier.from_model_file(
                py3langid.langid.MODEL_FILE, norm_probs=True
            )
            known = set(identifier.nb_classes)
            sources = [s for s in self._sources if not parse(s).is_group]
            served = sorted({iso639_1(s) for s in sources} & known)
            grouped = len(sources) < len(self._sources)
            self._candidates = served if len(served) >= 2 and not grouped else sorted(known)
            self._undetectable = sorted(s for s in sources if iso639_1(s) not in known)
            identifier.set_languages(self._candidates)
            self._identifier = identifier
        logger.info(
            "source detection loaded: %d candidate languages (%s); served sources it cannot detect: %s",
            len(self._candidates), ", ".join(served) if self._candidates == served else "all it knows",
            ", ".join(self._undetectable) or "none",
        )  # fmt: skip
