"""Training steps per second of our Transformer at several batch sizes: where a GPU run's time goes.

Builds a Trainer on the training data (as `python -m model.train` does), then times `--steps` updates
at each `--max-tokens` after 10 warm-up updates, and prints milliseconds per step and target tokens
per second. A step time that does not grow with the batch says the host, not the device, sets the pace.

Usage:
    python -m bench.train_rate --data data --device cuda --bf16 --layers 3,6 --max-tokens 3000,6000,12000,25000
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from model.artifact import TOKENIZER_FILE, load_config
from model.batching import collate, epoch_examples, token_batches
from model.train import TrainConfig, Trainer

WARMUP_STEPS = 10


@dataclass(frozen=True)
class StepRate:
    layers: int  # encoder and decoder layers each
    max_tokens: int
    ms_per_step: float
    target_tokens_per_s: float


def step_rates(args: argparse.Namespace) -> list[StepRate]:
    """Time `args.steps` updates for each layer count and batch size, the shipped model's other settings."""
    base = load_config(args.model_dir)
    trainer_args = argparse.Namespace(run=args.run, device=args.device, tokenizer=args.model_dir / TOKENIZER_FILE,
                                      data=args.data)  # fmt: skip
    args.run.mkdir(parents=True, exist_ok=True)
    rates = []
    for layers in args.layers:
        shape = dataclasses.replace(base, n_encoder_layers=layers, n_decoder_layers=layers, dropout=0.3)
        trainer = Trainer(trainer_args, shape, TrainConfig(bf16=args.bf16))
        examples = epoch_examples(trainer.train_examples, trainer.tcfg.mixture, random.Random(0), None)
        for max_tokens in args.max_tokens:
            batches = token_batches(examples, max_tokens, random.Random(0))
            for examples_of_batch in batches[:WARMUP_STEPS]:
                trainer.train_step(collate(examples_of_batch, trainer.device))
            start, tokens = trainer.synchronized_time(), 0
            timed = batches[WARMUP_STEPS : WARMUP_STEPS + args.steps]
            for examples_of_batch in timed:
                batch = collate(examples_of_batch, trainer.device)
                tokens += batch.n_tokens
                trainer.train_step(batch)
            seconds = trainer.synchronized_time() - start
            rates.append(StepRate(layers, max_tokens, seconds / len(timed) * 1000, tokens / seconds))
            print(f"{layers}+{layers} layers, {max_tokens:>6} tokens per batch: {rates[-1].ms_per_step:7.1f} ms per "
                  f"step, {rates[-1].target_tokens_per_s:9.0f} target tokens/s", flush=True)  # fmt: skip
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path("data"), help="holds train.tsv and valid.tsv")
    p.add_argument("--model-dir", type=Path, default=Path("model/shipped"), help="shape and tokenizer")
    p.add_argument("--run", type=Path, default=Path("runs/train-rate"), help="scratch run directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[3])
    p.add_argument("--max-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[3000, 25000])
    p.add_argument("--steps", type=int, default=80, help="timed updates per batch size")
    return p


def main() -> None:
    step_rates(build_parser().parse_args())


if __name__ == "__main__":
    main()
