"""transformers' own MarianTokenizer over a random Marian directory (bench/marian_random.py builds them)."""

from __future__ import annotations

from pathlib import Path

from bench.marian_random import build_marian_dir

__all__ = ["build_marian_dir", "marian_tokenizer"]


def marian_tokenizer(directory: Path):  # type: ignore[no-untyped-def]
    """transformers' MarianTokenizer over the directory's files."""
    from transformers import MarianTokenizer

    separate = (directory / "target_vocab.json").is_file()
    return MarianTokenizer(
        str(directory / "source.spm"), str(directory / "target.spm"), str(directory / "vocab.json"),
        target_vocab_file=str(directory / "target_vocab.json") if separate else None,
        separate_vocabs=separate, source_lang="de", target_lang="en",
    )  # fmt: skip
