"""Source-language detection for requests whose source_language is empty or "auto".

py3langid (a maintained fork of langid.py; its model ships in its wheel) classifies each text among the
languages the served models take as sources, which is what makes short texts decidable
(docs/decisions.md, `python -m bench.detect`). It ranks every language it knows first, though: a text
whose best language is one no model serves, ahead of the best served one by more than MIN_MARGIN, is named
after it (and refused by routing) rather than called the nearest served language. That way a Spanish text
sent to a German and English server is refused as Spanish, not translated as German, while German and
English texts are almost never taken for another language (`python -m bench.detect --foreign`,
docs/decisions.md). A short text (fewer than SHORT_WORDS words: a button's
label, a greeting) is named after an unserved language only where the served ones are next to impossible
(under SHORT_FOREIGN_RATIO of its probability): a single word in a served language spreads its probability over
dozens of languages, and its best one is often another that spells the word alike (the test set's most common
German words "heute", "Katze" and "wurde" rank Acehnese, Basque and Frisian first), while one in
a script no served language writes ("Привет", "你好") stays refused. Where fewer than two served sources are
detectable it classifies among every language it knows. A text whose best language is not ahead of the next by more
than MIN_MARGIN in probability is undecided: the caller asks for source_language, never guesses. The
margin, unlike a floor on the best probability, means the same whatever the number of candidates (two
languages split an uninformative text about evenly, six about a sixth each).

Deciding among the served languages renormalizes their probabilities, which makes a text most of whose
probability lies elsewhere look sure ("commit invalide %s": English 0.88 against German among the two, 0.08
against Latin's 0.06 and French's 0.05 among all). A detection therefore carries its `rival`: the likeliest
unserved language's probability over its own, among every language the detector knows. A detection whose rival
is at UNSURE_RATIO or above is not `sure`: the caller does not take it for the target language (it would come
back untranslated and unflagged). Short texts in served languages often have such rivals ("Anmelden": Norwegian
ahead), so the rule does not refuse them, only keeps them from passing unchanged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from model.languages import iso639_1, parse, written_language

logger = logging.getLogger(__name__)

MIN_MARGIN = 0.2  # the best language's probability over the runner-up's: at or below it, no decision
SHORT_WORDS = 3  # a text of fewer words is short: named after an unserved language only past SHORT_FOREIGN_RATIO
SHORT_FOREIGN_RATIO = 0.001  # a short text's best served language under this share of the unserved best's
UNSURE_RATIO = 0.75  # a detection whose likeliest unserved rival has this share of its probability is unsure


@dataclass(frozen=True)
class Detection:
    """The language of one text."""

    language: str  # ISO 639-1 code, e.g. "de"
    confidence: float  # the detector's probability of it among its candidates, 0..1
    margin: float = 0.0  # its probability's lead over the next language's: how sure the decision is
    # The likeliest unserved language's probability over this one's, among every language the detector knows
    # (0: every language is served, or this one is unserved)
    rival: float = 0.0
    # The served sources this language stands for where they are several written languages the detector cannot
    # tell apart (`zh`: zho_Hans, zho_Hant, yue_Hant); () where it names one
    indistinct: tuple[str, ...] = ()

    @property
    def sure(self) -> bool:
        """Ahead of every language no model serves by enough to be taken for the target language."""
        return self.rival < UNSURE_RATIO

    @property
    def reported_confidence(self) -> float:
        """The confidence a client sees: lowered where an unserved language comes close (not `sure`), so that a
        text translated from a doubtful guess ("commit invalide %s" read as English) is flagged, not passed as sure."""
        return self.confidence if self.sure else self.confidence / (1.0 + self.rival)


class SourceDetector:
    """Detects a text's language among the served sources (or names a language none serves). The model loads on
    first use (docs/decisions.md gives its memory): a server whose clients always name the source never
    pays for it."""

    def __init__(self, sources: Iterable[str]) -> None:
        self._sources = list(dict.fromkeys(sources))
        self._lock = threading.Lock()
        self._identifier: Any = None
        self._candidates: list[str] = []
        self._candidate_set: frozenset[str] = frozenset()
        self._served: frozenset[str] = frozenset()  # languages a model takes (every one known where a group is served)
        self._undetectable: list[str] = []
        self._indistinct: dict[str, tuple[str, ...]] = {}

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

    @property
    def indistinct(self) -> dict[str, tuple[str, ...]]:
        """Languages the detector names that stand for several served sources of other written languages (a
        macrolanguage's members, a language's scripts): a text detected as one of them needs source_language."""
        self._load()
        return self._indistinct

    def detect(self, text: str) -> Detection | None:
        """The text's language, or None where it is not ahead of the next by more than MIN_MARGIN: a language
        no model serves where it leads the served ones by that much (a short text: where they are next to
        impossible), else one of the candidates."""
        self._load()
        everything = self._identifier.rank(text)  # every language it knows; probabilities over all of them
        (top, top_p) = everything[0]
        best_served = next((p for language, p in everything if language in self._candidate_set), 0.0)
        plainly_foreign = len(text.split()) >= SHORT_WORDS or best_served < SHORT_FOREIGN_RATIO * top_p
        if top not in self._candidate_set and top_p - best_served > MIN_MARGIN and plainly_foreign:
            return Detection(str(top), float(top_p), float(top_p - everything[1][1]) if len(everything) > 1 else 1.0)
        served = self._among_candidates(everything)
        (language, best), runner_up = served[0], served[1][1] if len(served) > 1 else 0.0
        if best - runner_up <= MIN_MARGIN:
            return None
        rival, indistinct = self._rival(language, everything), self._indistinct.get(str(language), ())
        return Detection(str(language), float(best), float(best - runner_up), rival, indistinct)

    def rank(self, text: str) -> list[tuple[str, float]]:
        """The candidates, best first, with their probabilities among the candidates alone."""
        self._load()
        return self._among_candidates(self._identifier.rank(text))

    def _rival(self, language: str, everything: list[tuple[str, float]]) -> float:
        """The likeliest unserved language's probability over `language`'s, both among every language known."""
        if language not in self._served:  # routing refuses it whatever its rivals
            return 0.0
        own = next(p for known, p in everything if known == language)
        rival = next((p for known, p in everything if known not in self._served), 0.0)
        return float(rival / own) if own > 0 else float("inf")

    def _among_candidates(self, everything: list[tuple[str, float]]) -> list[tuple[str, float]]:
        """Probabilities over every language renormalized over the candidates: what a classifier restricted to
        them computes (each is a softmax over its classes' scores)."""
        kept = [(language, p) for language, p in everything if language in self._candidate_set]
        total = sum(p for _, p in kept) or 1.0
        return [(language, p / total) for language, p in kept]

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
            self._candidate_set = frozenset(self._candidates)
            self._served = frozenset(known if grouped else served)
            self._undetectable = sorted(s for s in sources if iso639_1(s) not in known)
            self._indistinct = indistinct_sources(sources, known)
            self._identifier = identifier
        logger.info(
            "source detection loaded: %d candidate languages (%s); served sources it cannot detect: %s; it cannot tell"
            " apart: %s", len(self._candidates), ", ".join(served) if self._candidates == served else "all it knows",
            ", ".join(self._undetectable) or "none",
            "; ".join(f"{code} ({', '.join(codes)})" for code, codes in self._indistinct.items()) or "none",
        )  # fmt: skip


def indistinct_sources(sources: Iterable[str], known: set[str]) -> dict[str, tuple[str, ...]]:
    """The detector's languages (ISO 639-1, among `known`) that stand for served sources of more than one written
    language, with those sources: `zh` for zho_Hans and zho_Hant (one language, two scripts) and yue_Hant (a member
    of the macrolanguage); not `fr` for fr and fr_CA (one written language, two regions)."""
    by_code: dict[str, list[str]] = {}
    for source in dict.fromkeys(sources):
        if (code := iso639_1(source)) in known and written_language(source) is not None:
            by_code.setdefault(code, []).append(source)
    return {code: tuple(sorted(found)) for code, found in sorted(by_code.items()) if _several_written(found)}


def _several_written(codes: list[str]) -> bool:
    """Whether `codes` name more than one language, or one in more than one script (a script unsaid fits any)."""
    written = [language for code in codes if (language := written_language(code)) is not None]
    return len({language for language, _ in written}) > 1 or len({script for _, script in written if script}) > 1
