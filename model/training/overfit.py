"""How far a model's loss on training sentences is below its loss on the validation sentences.

The test set holds full sentences only, and the training data's 19,388 sentences are repeated every
epoch: a wide gap says the model learns those sentences by heart rather than how to translate, and
that regularisation (not more of the same steps) is what it lacks.

Usage: python -m model.training.overfit --model-dir model/shipped --data data
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from model.data import Pair, is_sentence, read_tsv
from model.tokenizer import Tokenizer
from model.training.artifact import TOKENIZER_FILE, load_artifact
from model.training.batching import evaluation_batches, make_examples
from model.training.train import validation_loss
from model.training.transformer import Transformer


@dataclass(frozen=True)
class Gap:
    train_sentences: float  # cross-entropy, nats per target token, both directions
    valid: float
    sentences: int  # of each set

    @property
    def nats(self) -> float:
        return self.valid - self.train_sentences


def loss_on(model: Transformer, tok: Tokenizer, pairs: list[Pair]) -> float:
    return validation_loss(model, evaluation_batches(make_examples(pairs, tok, model.cfg.max_len), torch.device("cpu")))


def memorisation_gap(model_dir: Path, train: list[Pair], valid: list[Pair], seed: int = 0) -> Gap:
    """Loss on as many training sentences, drawn at random, as there are validation sentences."""
    model = load_artifact(model_dir).float()
    tok = Tokenizer(model_dir / TOKENIZER_FILE)
    sentences = [p for p in train if is_sentence(p)]
    if not sentences or not valid:
        raise ValueError("no training sentences or no validation pairs to compare")
    sample = random.Random(seed).sample(sentences, min(len(valid), len(sentences)))
    return Gap(loss_on(model, tok, sample), loss_on(model, tok, valid), len(sample))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=Path("model/shipped"))
    p.add_argument("--data", type=Path, default=Path("data"))
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gap = memorisation_gap(args.model_dir, read_tsv(args.data / "train.tsv"), read_tsv(args.data / "valid.tsv"))
    print(
        f"{args.model_dir}: {gap.sentences} training sentences {gap.train_sentences:.3f}, validation "
        f"{gap.valid:.3f} nats per token (gap {gap.nats:.3f})"
    )


if __name__ == "__main__":
    main()
