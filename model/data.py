"""Training data from the Ding German-English dictionary (Debian package `trans-de-en`, GPL-2+).

A line holds `German :: English`. ` | ` separates aligned sub-entries (the same count on both sides),
`; ` separates alternatives within a sub-entry. Annotations are stripped: `{f}` grammar, `[techn.]`
usage labels, `<...>` search variants, `/ABBR/` abbreviations. Parenthesised glosses are kept, since
they carry meaning on both sides.

Slash alternatives inside an entry (`ganz/völlig`, `sheer/pure mockery`, `gut / schlecht`) are
resolved one way, the same in every split: a chain of slash-joined words `A/B/C` or `A / B / C`
becomes its first word `A`, keeping the chain's closing punctuation (`(von / nach)` -> `(von)`).
Fractions (`1/2`, `24/7`) are not alternatives. The rule works on words, and Ding's alternatives
are sometimes phrases (`wie warme Semmeln / wie die warmen Semmeln`), which no word rule resolves;
so the held-out sets take no sentence with a slash alternative on either side. Their references are
the dictionary's text with annotations stripped and nothing else rewritten, and the rule's
approximations stay in training, where they are a little noise.

Pairing of alternatives: each German alternative pairs with the first English one and each English
alternative with the first German one, so every word is seen without a quadratic cross product.

Split: by a hash of the cleaned German side, so a source is in exactly one split. Validation and
test hold only full sentences; a German text that the slash rule touched in any pair goes to
training with all its pairs. Any training pair whose German or English side equals a held-out
sentence is dropped, so no test source (in either direction) is seen in training.

Usage: python -m model.data --out data/  (downloads the package with apt if needed)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

DING_PATH_IN_PACKAGE = "usr/share/trans/de-en"
# `/ABBR/` counts as an annotation only as a word of its own: `Äpfel/Birnen/Kirschen` is a chain.
_ANNOTATION = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]|<[^<>]*>|(?<!\S)/[A-Z][A-Za-z0-9.\-&]*/(?=[\s,;)]|$)")
_SLASH_CHAIN = re.compile(r"[^\s/]+(?: ?/ ?[^\s/]+)+")  # "gut / schlecht", "A/B/C"; "km/h" is cut too
_FRACTIONS = re.compile(r"\d+(?:/\d+)+")
_CLOSING = re.compile(r"[.,:;!?)\]\"'\u201c\u201d\u2019\u00bb\u00ab]+$")  # closing marks, curly quotes included
_SPACES = re.compile(r"\s+")
_SENTENCE_END = (".", "!", "?")


@dataclass(frozen=True)
class Pair:
    """One aligned German-English segment."""

    de: str
    en: str
    # A slash alternative was resolved on either side; such pairs are training-only. Not part of
    # equality, so deduplication and leak checks still compare the text alone.
    resolved: bool = field(default=False, compare=False)


@dataclass
class ParseStats:
    """What the parser saw; recorded in the model card."""

    lines: int = 0
    comments: int = 0
    malformed: Counter[str] = field(default_factory=Counter)
    pairs: int = 0


def _first_of_chain(match: re.Match[str]) -> str:
    chain = match.group(0)
    if _FRACTIONS.search(chain):  # "1/2", "(24/7).", "3/4-Takt"
        return chain
    alternatives = chain.split("/")
    closing = _CLOSING.search(alternatives[-1].strip())  # "schlecht." ends the sentence, not the word
    first = alternatives[0].strip()
    return first if closing is None or first.endswith(closing.group(0)) else first + closing.group(0)


def has_slash_alternative(text: str) -> bool:
    """True if `text` (annotations already stripped) holds a slash that is not part of a fraction."""
    return "/" in _FRACTIONS.sub("", text)


def resolve_slashes(text: str) -> str:
    """Replace each chain of slash alternatives by its first word (see the module docstring)."""
    if "/" not in text:
        return text
    return _SLASH_CHAIN.sub(_first_of_chain, _SPACES.sub(" ", text))


def strip_annotations(text: str) -> str:
    return _SPACES.sub(" ", _ANNOTATION.sub(" ", text)).strip()


def clean(text: str) -> str:
    """Strip annotations, resolve slash alternatives, normalise spaces."""
    return resolve_slashes(strip_annotations(text)).strip(" ,;")


def split_alternatives(side: str) -> list[tuple[str, bool]]:
    """The `; `-separated alternatives of one side, cleaned, each with whether a slash was resolved."""
    alternatives = ((clean(a), has_slash_alternative(strip_annotations(a))) for a in side.split("; "))
    return [(text, resolved) for text, resolved in alternatives if text]


def pairs_of_subentry(de_side: str, en_side: str) -> list[Pair]:
    """Alternatives of one aligned sub-entry as pairs (see module docstring for the pairing rule)."""
    de_alts, en_alts = split_alternatives(de_side), split_alternatives(en_side)
    if not de_alts or not en_alts:
        return []
    (de0, de0_resolved), (en0, en0_resolved) = de_alts[0], en_alts[0]
    pairs = [Pair(de, en0, resolved or en0_resolved) for de, resolved in de_alts]
    pairs += [Pair(de0, en, de0_resolved or resolved) for en, resolved in en_alts[1:]]
    return pairs


def parse_line(line: str, stats: ParseStats) -> list[Pair]:
    """Pairs of one dictionary line; malformed lines are counted by reason and yield nothing."""
    stats.lines += 1
    line = line.strip()
    if not line or line.startswith("#"):
        stats.comments += 1
        return []
    sides = line.split(" :: ")
    if len(sides) != 2:
        stats.malformed["separator"] += 1
        return []
    de_subs, en_subs = sides[0].split(" | "), sides[1].split(" | ")
    if len(de_subs) != len(en_subs):
        stats.malformed["unaligned sub-entries"] += 1
        return []
    pairs = [p for de, en in zip(de_subs, en_subs, strict=True) for p in pairs_of_subentry(de, en)]
    if not pairs:
        stats.malformed["empty after cleaning"] += 1
    stats.pairs += len(pairs)
    return pairs


def parse_lines(lines: Iterable[str], stats: ParseStats) -> Iterator[Pair]:
    for line in lines:
        yield from parse_line(line, stats)


def is_sentence(pair: Pair) -> bool:
    """A full example sentence: capitalised, at least four words, ending in . ! or ? on both sides."""
    de, en = pair.de, pair.en
    return (
        len(de.split()) >= 4
        and de[0].isupper()
        and en[0].isupper()
        and de.endswith(_SENTENCE_END)
        and en.endswith(_SENTENCE_END)
    )


def split_of(german: str, valid_per_mille: int = 20, test_per_mille: int = 40) -> str:
    """Deterministic split by the MD5 of the German side: 'test', 'valid' or 'train'."""
    bucket = int(hashlib.md5(german.encode("utf-8")).hexdigest()[:8], 16) % 1000
    if bucket < test_per_mille:
        return "test"
    if bucket < test_per_mille + valid_per_mille:
        return "valid"
    return "train"


def split_pairs(pairs: Iterable[Pair]) -> dict[str, list[Pair]]:
    """Deduplicate, split by hash, keep held-out sentences only, drop training pairs that leak them."""
    pairs = list(pairs)
    # A German text that came out of the slash rule in any pair is training-only, with all its pairs:
    # a held-out source keeps every reference the dictionary gives it verbatim.
    training_only = {pair.de for pair in pairs if pair.resolved}
    unique = list(dict.fromkeys(pairs))
    held: dict[str, dict[str, Pair]] = {"valid": {}, "test": {}}
    train: list[Pair] = []
    for pair in unique:
        split = "train" if pair.de in training_only else split_of(pair.de)
        if split == "train":
            train.append(pair)
        elif is_sentence(pair):
            held[split].setdefault(pair.de, pair)  # one reference per German sentence
    held_de = {de for split in held.values() for de in split}
    held_en = {p.en for split in held.values() for p in split.values()}
    train = [p for p in train if p.de not in held_de and p.en not in held_en]
    return {"train": train, "valid": list(held["valid"].values()), "test": list(held["test"].values())}


def fetch_ding(workdir: Path) -> Path:
    """Download the Debian package with apt and unpack the dictionary file."""
    subprocess.run(["apt-get", "download", "trans-de-en"], cwd=workdir, check=True)
    deb = next(workdir.glob("trans-de-en_*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(workdir / "pkg")], check=True)
    return workdir / "pkg" / DING_PATH_IN_PACKAGE


def write_tsv(pairs: list[Pair], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for p in pairs:
            f.write(f"{p.de}\t{p.en}\n")


def read_tsv(path: Path) -> list[Pair]:
    with path.open(encoding="utf-8") as f:
        rows = (line.rstrip("\n").split("\t") for line in f)
        return [Pair(de, en) for de, en in rows]


def prepare(source: Path, out: Path) -> dict[str, object]:
    """Parse the dictionary at `source`, write train/valid/test TSVs and stats.json into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    stats = ParseStats()
    with source.open(encoding="utf-8", errors="replace") as f:
        splits = split_pairs(parse_lines(f, stats))
    for name, pairs in splits.items():
        write_tsv(pairs, out / f"{name}.tsv")
    summary: dict[str, object] = {
        "lines": stats.lines,
        "comment_lines": stats.comments,
        "malformed_lines": dict(stats.malformed),
        "pairs_parsed": stats.pairs,
        "train_pairs": len(splits["train"]),
        "train_sentences": sum(is_sentence(p) for p in splits["train"]),
        "valid_sentences": len(splits["valid"]),
        "test_sentences": len(splits["test"]),
    }
    (out / "stats.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("data"), help="output directory")
    parser.add_argument("--source", type=Path, help="dictionary file; fetched with apt when omitted")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.source is not None:
        summary = prepare(args.source, args.out)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            summary = prepare(fetch_ding(Path(tmp)), args.out)
    log.info(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
