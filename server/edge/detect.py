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
from collections.abc import Iterable
from dataclasses import dataclass

from model.languages import iso639_1, parse

logger = logging.getLogger(__name__)

MIN_MARGIN = 0.2  # the best language's probability over the runner-up's: at or below it, no decision


@dataclass(frozen=True)
class Detection:
    """The language of one text."""

    language: str  # ISO 639-1 code, e.g. "de"
    confidence: float  # the detector's probability of it among its candidates, 0..1


class SourceDetector:
    """Detects a text's language among the served sources (loaded once, at startup)."""

    def __init__(self, sources: Iterable[str]) -> None:
        import py3langid

        self._identifier = py3langid.langid.LanguageIdentifier.from_model_file(
            py3langid.langid.MODEL_FILE, norm_probs=True
        )
        known = set(self._identifier.nb_classes)
        sources = list(dict.fromkeys(sources))
        wanted = {iso639_1(source) for source in sources if not parse(source).is_group}
        grouped = any(parse(source).is_group for source in sources)
        self.undetectable = sorted(s for s in sources if not parse(s).is_group and iso639_1(s) not in known)
        served = sorted(wanted & known)
        self.candidates = served if len(served) >= 2 and not grouped else sorted(known)
        self._identifier.set_languages(self.candidates)
        logger.info(
            "source detection: %d candidate languages (%s); served sources it cannot detect: %s",
            len(self.candidates), ", ".join(served) if self.candidates == served else "all it knows",
            ", ".join(self.undetectable) or "none",
        )  # fmt: skip

    def detect(self, text: str) -> Detection | None:
        """The text's language, or None where it is not ahead of the next by more than MIN_MARGIN."""
        ranked = self._identifier.rank(text)
        (language, best), runner_up = ranked[0], ranked[1][1] if len(ranked) > 1 else 0.0
        if best - runner_up <= MIN_MARGIN:
            return None
        return Detection(str(language), float(best))
