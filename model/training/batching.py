"""Turn text pairs into token-count batches of both translation directions."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
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
    ids = (tok.encode_batch([p.de for p in pairs]), tok.encode_batch([p.en for p in pairs]))
    return examples_from_ids(pairs, tok, max_len, sources=ids, targets=ids)


Encoded = tuple[list[list[int]], list[list[int]]]  # (German ids, English ids), one per pair


def examples_from_ids(
    pairs: list[Pair], tok: Tokenizer, max_len: int, sources: Encoded, targets: Encoded
) -> list[Example]:
    """Both directions of every pair from its encoded sides: the sources' ids (the Resegmenter's are
    sampled) and the targets' (always the best segmentation)."""
    de_tag, en_tag, eos = tok.tag_ids["de"], tok.tag_ids["en"], tok.sp.eos_id()
    examples: list[Example] = []
    for pair, de_s, en_s, de, en in zip(pairs, *sources, *targets, strict=True):
        if max(len(de), len(en), len(de_s), len(en_s)) + 2 > max_len:
            continue
        cls = weight_class(pair)
        examples.append(Example((en_tag, *de_s, eos), (*en, eos), cls))
        examples.append(Example((de_tag, *en_s, eos), (*de, eos), cls))
    return examples


def epoch_examples(
    examples: list[Example], mixture: Mixture, rng: random.Random, sentences: list[Example] | None = None
) -> list[Example]:
    """The epoch's examples: every sentence `sentence_repeats` times (or, given `sentences`, those in their
    place: the repeats already made), every phrase once, a fresh `word_fraction` of the words."""
    chosen: list[Example] = [] if sentences is None else sentences[:]
    for ex in examples:
        if ex.weight_class == "sentence":
            if sentences is None:
                chosen.extend([ex] * mixture.sentence_repeats)
        elif ex.weight_class == "phrase" or rng.random() < mixture.word_fraction:
            chosen.append(ex)
    return chosen


class Resegmenter:
    """Subword regularisation (Kudo 2018) for the full sentences: every repeat of a sentence in an epoch
    gets its own source segmentation, drawn from the text's `nbest` most likely segmentations with
    probability proportional to P(segmentation)^alpha, so the model cannot learn a sentence by its one
    piece sequence. Sentences are the test set's kind and the only examples repeated within an epoch;
    the training loss on them fell far below the validation loss (1.37 against 2.43 nats after 105,500
    steps, `python -m model.training.overfit`). Targets keep the best segmentation, the one the decoder emits
    when serving: sampled targets teach it to spread a word's probability over its spellings in pieces,
    which beam search then splits (and the validation loss, on best segmentations, can no longer tell
    whether the model got better: it rose 0.08 nats in 1,800 steps of a run that sampled both sides).

    `alpha` 1.0 draws by the unigram model's probabilities, smaller flattens them (0 is uniform over
    the `nbest`). The candidates are computed once and drawn with a seeded `random.Random`, so an
    epoch's batches are the same in any process: a resumed run sees what an uninterrupted one would.
    """

    def __init__(self, pairs: list[Pair], tok: Tokenizer, max_len: int, alpha: float, nbest: int = 8) -> None:
        self.sentences = [p for p in pairs if is_sentence(p)]
        texts = ([p.de for p in self.sentences], [p.en for p in self.sentences])
        self.targets = (tok.encode_batch(texts[0]), tok.encode_batch(texts[1]))
        self.candidates = tuple([self._weighted(c, alpha) for c in tok.segmentations(side, nbest)] for side in texts)
        self.tok, self.max_len = tok, max_len

    @staticmethod
    def _weighted(candidates: list[tuple[list[int], float]], alpha: float) -> tuple[list[list[int]], list[float]]:
        best = max(score for _, score in candidates)
        return [ids for ids, _ in candidates], [math.exp(alpha * (score - best)) for _, score in candidates]

    def examples(self, repeats: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        out: list[Example] = []
        for _ in range(repeats):
            de, en = ([rng.choices(ids, weights)[0] for ids, weights in side] for side in self.candidates)
            out.extend(examples_from_ids(self.sentences, self.tok, self.max_len, (de, en), self.targets))
        return out


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
    """(len(rows), longest) ids, PAD on the right; filled in numpy (a torch call per row costs more)."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    out = np.full((len(rows), int(lengths.max())), PAD_ID, dtype=np.int64)
    out[np.arange(out.shape[1]) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum())
    )
    return torch.from_numpy(out)


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


def evaluation_batches(examples: list[Example], device: torch.device) -> list[Batch]:
    """Fixed batches (seeded order) for a loss that is comparable from one measurement to the next."""
    return [collate(b, device) for b in token_batches(examples, 4000, random.Random(0))]


def iterate(batches: list[list[Example]], device: torch.device, start: int = 0) -> Iterator[Batch]:
    for b in batches[start:]:
        yield collate(b, device)
