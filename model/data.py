"""Training data from the Ding German-English dictionary (Debian package `trans-de-en`, GPL-2+).

A line holds `German :: English`. ` | ` separates aligned sub-entries (the same count on both sides),
`; ` separates alternatives within a sub-entry. Annotations are stripped: `{f}` grammar, `[techn.]`
usage labels, `<...>` search variants, `/ABBR/` abbreviations. Parenthesised glosses are kept, since
they carry meaning on both sides.

Slash alternatives inside an entry (`ganz/völlig`, `sheer/pure mockery`, `arrant / pure`) are resolved
one way everywhere, in training pairs and test references alike: the first alternative is kept.

Pairing of alternatives: each German alternative pairs with the first English one and each English
alternative with the first German one, so every word is seen without a quadratic cross product.

Split: by a hash of the cleaned German side, so a source is in exactly one split. Validation and
test hold only full sentences; any training pair whose German or English side equals a held-out
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
_ANNOTATION = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]|<[^<>]*>|/[A-Z][A-Za-z0-9.\-&]*/")
_SPACED_SLASH = re.compile(r"(\S+) / \S+")  # "arrant / pure" -> "arrant"
_WORD_SLASH = re.compile(r"\b(\w+)(?:/\w+)+\b")  # "sheer/pure" -> "sheer"; "km/h" is also cut
_DIGIT_SLASH = re.compile(r"\d/\d")
_SPACES = re.compile(r"\s+")
_SENTENCE_END = (".", "!", "?")


@dataclass(frozen=True)
class Pair:
    """One aligned German-English segment."""

    de: str
    en: str


@dataclass
class ParseStats:
    """What the parser saw; recorded in the model card."""

    lines: int = 0
    comments: int = 0
    malformed: Counter[str] = field(default_factory=Counter)
    pairs: int = 0


def resolve_slashes(text: str) -> str:
    """Keep the first of slash alternatives; fractions such as 1/2 are left alone."""
    if "/" not in text:
        return text
    text = _SPACED_SLASH.sub(r"\1", text)
    return _WORD_SLASH.sub(lambda m: m.group(0) if _DIGIT_SLASH.search(m.group(0)) else m.group(1), text)


def clean(text: str) -> str:
    """Strip annotations, resolve slash alternatives, normalise spaces."""
    text = _ANNOTATION.sub(" ", text)
    text = resolve_slashes(text)
    text = _SPACES.sub(" ", text).strip()
    return text.strip(" ,;")


def split_alternatives(side: str) -> list[str]:
    alternatives = (clean(a) for a in side.split("; "))
    return [a for a in alternatives if a]


def pairs_of_subentry(de_side: str, en_side: str) -> list[Pair]:
    """Alternatives of one aligned sub-entry as pairs (see module docstring for the pairing rule)."""
    de_alts, en_alts = split_alternatives(de_side), split_alternatives(en_side)
    if not de_alts or not en_alts:
        return []
    pairs = [Pair(de, en_alts[0]) for de in de_alts] + [Pair(de_alts[0], en) for en in en_alts[1:]]
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
    unique = list(dict.fromkeys(pairs))
    held: dict[str, dict[str, Pair]] = {"valid": {}, "test": {}}
    train: list[Pair] = []
    for pair in unique:
        split = split_of(pair.de)
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
        return [Pair(*line.rstrip("\n").split("\t")) for line in f]


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
