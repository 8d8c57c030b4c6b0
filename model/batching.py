"""Turn text pairs into token-count batches of both translation directions."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from model.config import BOS_ID, PAD_ID
from model.data import Pair, is_sentence
from model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Example:
    """One direction of one pair: `src` has tag and EOS, `tgt` has EOS."""

    src: tuple[int, ...]
    tgt: tuple[int, ...]
    weight_class: str  # 'sentence', 'phrase' or 'word': drives sampling per epoch


@dataclass(frozen=True)
class Batch:
    src: Tensor  # (B, S) ids, PAD on the right
    src_mask: Tensor  # (B, S) True at real tokens
    tgt_in: Tensor  # (B, T) BOS + target
    tgt_out: Tensor  # (B, T) target + EOS, PAD where ignored
    n_tokens: int  # real target tokens


@dataclass(frozen=True)
class Mixture:
    """How often each kind of example is seen per epoch: full sentences matter most for the test set."""

    sentence_repeats: int = 3
    word_fraction: float = 0.3  # of one- and two-word entries, resampled each epoch


def weight_class(pair: Pair) -> str:
    if is_sentence(pair):
        return "sentence"
    return "phrase" if len(pair.de.split()) > 2 or len(pair.en.split()) > 2 else "word"


def make_examples(pairs: list[Pair], tok: Tokenizer, max_len: int) -> list[Example]:
    """Both directions of every pair, dropping those longer than `max_len` tokens."""
    de_ids = tok.encode_batch([p.de for p in pairs])
    en_ids = tok.encode_batch([p.en for p in pairs])
    de_tag, en_tag, eos = tok.tag_ids["de"], tok.tag_ids["en"], tok.sp.eos_id()
    examples: list[Example] = []
    for pair, de, en in zip(pairs, de_ids, en_ids, strict=True):
        if max(len(de), len(en)) + 2 > max_len:
            continue
        cls = weight_class(pair)
        examples.append(Example((en_tag, *de, eos), (*en, eos), cls))
        examples.append(Example((de_tag, *en, eos), (*de, eos), cls))
    return examples


def epoch_examples(examples: list[Example], mixture: Mixture, rng: random.Random) -> list[Example]:
    chosen: list[Example] = []
    for ex in examples:
        if ex.weight_class == "sentence":
            chosen.extend([ex] * mixture.sentence_repeats)
        elif ex.weight_class == "phrase" or rng.random() < mixture.word_fraction:
            chosen.append(ex)
    return chosen


def token_batches(examples: list[Example], max_tokens: int, rng: random.Random) -> list[list[Example]]:
    """Group examples of similar length so that padded (source + target) tokens stay under `max_tokens`."""
    shuffled = examples[:]
    rng.shuffle(shuffled)  # random order among equal lengths
    ordered = sorted(shuffled, key=lambda e: (len(e.src), len(e.tgt)))
    batches: list[list[Example]] = []
    current: list[Example] = []
    longest = 0
    for ex in ordered:
        longest_if_added = max(longest, len(ex.src) + len(ex.tgt) + 1)
        if current and longest_if_added * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest_if_added = [], len(ex.src) + len(ex.tgt) + 1
        current.append(ex)
        longest = longest_if_added
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def pad(rows: list[tuple[int, ...]]) -> Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def collate(batch: list[Example], device: torch.device) -> Batch:
    src = pad([e.src for e in batch])
    tgt_out = pad([e.tgt for e in batch])
    tgt_in = pad([(BOS_ID, *e.tgt[:-1]) for e in batch])
    return Batch(
        src=src.to(device),
        src_mask=(src != PAD_ID).to(device),
        tgt_in=tgt_in.to(device),
        tgt_out=tgt_out.to(device),
        n_tokens=int((tgt_out != PAD_ID).sum()),
    )


def iterate(batches: list[list[Example]], device: torch.device, start: int = 0) -> Iterator[Batch]:
    for b in batches[start:]:
        yield collate(b, device)
