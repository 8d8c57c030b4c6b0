r"""Train the Transformer as in the paper, resumable, on CPU or CUDA.

Label smoothing, Adam(0.9, 0.98) with linear warmup then inverse-square-root decay, an optional linear
cooldown to zero, token-count batches, dropout. A checkpoint is written every `--save-minutes` and at
the end; `--resume` continues from the newest one exactly where it stopped (step, epoch, batch, RNG
state). `--ship` averages the last `--average` checkpoints into a model directory. `--recipe` runs a
sequence of such commands in order (the shipped model's is `model/shipped/recipe.json`).

Usage:
    python -m model.training.train --data data --run runs/base --resume   # start, or continue where it stopped
    python -m model.training.train --run runs/base --ship model/shipped --average 4   # average and export only
    python -m model.training.train ... --init-from model/shipped --start-step 105500  # warm start, fresh optimiser
    python -m model.training.train ... --resume --cooldown-start 99500 --cooldown-steps 6000   # anneal to zero
    python -m model.training.train --recipe model/shipped/recipe.json [--dry-run]     # the shipped model's schedule
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.nn import functional as F
from tqdm import tqdm

from model.config import PAD_ID, ModelConfig
from model.data import read_tsv
from model.tokenizer import Tokenizer, check_tokenizer, file_sha256
from model.training.artifact import CONFIG_FILE, TOKENIZER_FILE, load_artifact, load_config, save_artifact
from model.training.batching import (
    Batch,
    Mixture,
    Resegmenter,
    collate,
    epoch_examples,
    evaluation_batches,
    make_examples,
    token_batches,
)
from model.training.transformer import Transformer, count_parameters

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; saved next to every checkpoint."""

    max_tokens: int = 3000  # padded source+target tokens per batch
    peak_lr: float = 1.5e-3  # reached at the end of warmup
    warmup_steps: int = 600
    label_smoothing: float = 0.1
    max_minutes: float = 120.0  # stop (and checkpoint) after this much wall time in this process
    max_steps: int = 1_000_000
    save_minutes: float = 10.0
    keep_checkpoints: int = 5
    seed: int = 1234
    sentence_repeats: int = Mixture.sentence_repeats  # full sentences (the test set's kind) per epoch
    word_fraction: float = Mixture.word_fraction  # of one- and two-word entries, resampled each epoch
    cooldown_start: int = 0  # from this step the rate falls linearly to zero; 0: 1/sqrt decay to the end
    cooldown_steps: int = 0  # length of that fall
    # > 0: each sentence repeat gets a sampled source segmentation (Resegmenter); docs/model.md has
    # what it measured on the shipped model
    subword_alpha: float = 0.0
    bf16: bool = False  # CUDA: forward and backward under bfloat16 autocast (weights and Adam stay fp32)
    # > 0: fit the schedule to this many minutes of wall time: after CALIBRATION_STEPS the measured step
    # time fixes max_steps, and the last `budget_cooldown` of the steps fall linearly to zero
    budget_minutes: float = 0.0
    budget_cooldown: float = 0.25

    @property
    def last_step(self) -> int:
        """`max_steps`, or the end of the cooldown: past it the rate is zero and a step changes nothing."""
        cooldown_end = self.cooldown_start + self.cooldown_steps if self.cooldown_steps else self.max_steps
        return min(self.max_steps, cooldown_end)

    @property
    def mixture(self) -> Mixture:
        return Mixture(self.sentence_repeats, self.word_fraction)


# TrainConfig fields settable from the command line (--max-tokens, ...); the rest keep their defaults
TRAIN_FLAGS = (
    "max_tokens",
    "peak_lr",
    "warmup_steps",
    "max_minutes",
    "max_steps",
    "save_minutes",
    "sentence_repeats",
    "word_fraction",
    "cooldown_start",
    "cooldown_steps",
    "subword_alpha",
    "bf16",
    "budget_minutes",
    "budget_cooldown",
)

# --budget-minutes times steps CALIBRATION_SKIP to CALIBRATION_SKIP + CALIBRATION_STEPS of the process
# (the first ones pay for kernel selection) and plans with BUDGET_MARGIN of the rest: validation,
# checkpoints and each epoch's batching take time that the calibration steps do not see
CALIBRATION_SKIP = 20
CALIBRATION_STEPS = 100
BUDGET_MARGIN = 0.9


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to `peak_lr`, then decay with 1/sqrt(step) as in the paper; with a cooldown, a
    linear fall to zero from `cooldown_start` (a short anneal at the end of a budget buys a lower loss
    than the same steps at the 1/sqrt rate)."""
    step = max(step, 1)
    if cfg.cooldown_steps and step > cfg.cooldown_start:
        left = max(0.0, 1.0 - (step - cfg.cooldown_start) / cfg.cooldown_steps)
        return paper_lr(cfg.cooldown_start, cfg) * left
    return paper_lr(step, cfg)


def paper_lr(step: int, cfg: TrainConfig) -> float:
    step = max(step, 1)
    return cfg.peak_lr * min(step / cfg.warmup_steps, math.sqrt(cfg.warmup_steps / step))


def fit_to_budget(
    cfg: TrainConfig, first_step: int, step: int, seconds_per_step: float, seconds_left: float
) -> TrainConfig:
    """The schedule that ends, cooldown included, when the budget does at the measured step time; the
    cooldown is a share of this process's steps (`first_step` on), so a resumed run anneals its own cycle."""
    last = step + max(1, int(BUDGET_MARGIN * seconds_left / seconds_per_step))
    cooldown = max(1, int(cfg.budget_cooldown * (last - first_step)))
    return dataclasses.replace(cfg, max_steps=last, cooldown_start=last - cooldown, cooldown_steps=cooldown)


def write_train_config(run: Path, cfg: TrainConfig) -> None:
    (run / "train_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))


def loss_of(model: Transformer, batch: Batch, smoothing: float) -> torch.Tensor:
    logits = model(batch.src, batch.src_mask, batch.tgt_in)  # (B, T, V)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        batch.tgt_out.reshape(-1),
        ignore_index=PAD_ID,
        label_smoothing=smoothing,
        reduction="sum",
    )


@torch.no_grad()
def validation_loss(model: Transformer, batches: list[Batch]) -> float:
    model.eval()
    total = sum(float(loss_of(model, b, 0.0)) for b in batches)
    model.train()
    return total / max(1, sum(b.n_tokens for b in batches))


def checkpoint_paths(run: Path) -> list[Path]:
    return sorted(run.glob("ckpt_*.pt"), key=lambda p: int(p.stem.split("_")[1]))


def save_checkpoint(run: Path, state: dict[str, object], keep: int) -> None:
    path = run / f"ckpt_{state['step']:07d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a killed run never leaves a torn checkpoint
    for old in checkpoint_paths(run)[:-keep]:
        old.unlink()


def average_checkpoints(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Mean of the model weights of `paths` (Vaswani et al. average the last five)."""
    avg: dict[str, torch.Tensor] = {}
    for path in paths:
        state = torch.load(path, map_location="cpu", weights_only=True)["model"]
        for k, v in state.items():
            avg[k] = avg.get(k, torch.zeros_like(v, dtype=torch.float32)) + v.float() / len(paths)
    return avg


def ship(run: Path, out: Path, n_average: int, tokenizer: Path) -> None:
    paths = checkpoint_paths(run)[-n_average:]
    if not paths:
        raise SystemExit(f"no checkpoints in {run}")
    cfg = ModelConfig.from_dict(json.loads((run / "model_config.json").read_text()))
    check_tokenizer(tokenizer, cfg.tokenizer_sha256)  # the artifact ships beside this tokenizer: it must be the run's
    model = Transformer(cfg)
    model.load_state_dict(average_checkpoints(paths))
    save_artifact(model, out)
    beside = out / TOKENIZER_FILE
    if not (beside.exists() and beside.samefile(tokenizer)):  # the directory serves and evaluates on its own
        shutil.copyfile(tokenizer, beside)
    log.info("averaged %s into %s", [p.name for p in paths], out)


class Trainer:
    """Holds model, optimiser and data position; `run()` trains until a time or step limit."""

    def __init__(self, args: argparse.Namespace, mcfg: ModelConfig, tcfg: TrainConfig) -> None:
        self.run_dir: Path = args.run
        self.tcfg = tcfg
        self.device = torch.device(args.device)
        torch.manual_seed(tcfg.seed)
        self.model = Transformer(mcfg).to(self.device)
        # CUDA: one fused kernel for all parameters instead of several per tensor; None keeps torch's default
        fused = True if self.device.type == "cuda" else None
        self.opt = torch.optim.Adam(self.model.parameters(), lr=tcfg.peak_lr, betas=(0.9, 0.98), eps=1e-9, fused=fused)
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=tcfg.bf16)
        tok = Tokenizer(args.tokenizer)
        train_pairs = read_tsv(args.data / "train.tsv")
        self.train_examples = make_examples(train_pairs, tok, mcfg.max_len)
        self.resegmenter = (
            Resegmenter(train_pairs, tok, mcfg.max_len, tcfg.subword_alpha) if tcfg.subword_alpha > 0 else None
        )
        valid = make_examples(read_tsv(args.data / "valid.tsv"), tok, mcfg.max_len)
        self.valid = evaluation_batches(valid, self.device)
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.calibration_start = 0.0  # --budget-minutes: when the timed steps began
        log.info(
            "model %s parameters, %d training examples", f"{count_parameters(self.model):,}", len(self.train_examples)
        )

    def state(self) -> dict[str, object]:
        state: dict[str, object] = {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "torch_rng": torch.get_rng_state(),  # dropout's masks: without it a resume replays the first ones
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def resume(self) -> None:
        paths = checkpoint_paths(self.run_dir)
        if not paths:
            log.info("nothing to resume in %s; starting fresh", self.run_dir)
            return
        state = torch.load(paths[-1], map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        torch.set_rng_state(state["torch_rng"].cpu())  # dropout's masks continue, not replay
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self.device)
        log.info("resumed from %s (step %d, epoch %d)", paths[-1].name, self.step, self.epoch)

    def warm_start(self, model_dir: Path, start_step: int) -> None:
        """Start from a shipped artifact's weights (no optimiser state): for a machine without the run's
        checkpoints. `start_step` continues the learning-rate schedule where that run stopped."""
        shipped = load_artifact(model_dir, self.device)
        if dataclasses.replace(shipped.cfg, dropout=self.model.cfg.dropout) != self.model.cfg:  # dropout may change
            raise ValueError(f"{model_dir} holds a model of another shape: {shipped.cfg} vs {self.model.cfg}")
        self.model.load_state_dict(shipped.state_dict())
        self.step = start_step
        log.info("warm start from %s at step %d (fresh optimiser)", model_dir, start_step)

    def epoch_batches(self) -> list[list]:
        seed = self.tcfg.seed * 1000 + self.epoch  # same epoch, same batches: exact resume
        rng = random.Random(seed)
        sentences = self.resegmenter.examples(self.tcfg.sentence_repeats, seed) if self.resegmenter else None
        examples = epoch_examples(self.train_examples, self.tcfg.mixture, rng, sentences)
        return token_batches(examples, self.tcfg.max_tokens, rng)

    def log_metrics(self, record: dict[str, float]) -> None:
        with (self.run_dir / "log.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def train_step(self, batch: Batch) -> Tensor:
        """One update; returns the loss per token as a tensor (reading it waits for the device)."""
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step + 1, self.tcfg)
        with self.autocast:
            loss = loss_of(self.model, batch, self.tcfg.label_smoothing)
        self.opt.zero_grad(set_to_none=True)
        (loss / batch.n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.step += 1
        return loss.detach() / batch.n_tokens

    def time_the_budget(self, first_step: int, start: float, minutes: float) -> None:
        """--budget-minutes: note the time at the first calibration step, fit the schedule at the last."""
        if self.step == first_step + CALIBRATION_SKIP:
            self.calibration_start = self.synchronized_time()
        elif self.step == first_step + CALIBRATION_SKIP + CALIBRATION_STEPS:
            now = self.synchronized_time()
            self.fit_budget(
                first_step, (now - self.calibration_start) / CALIBRATION_STEPS, minutes * 60 - (now - start)
            )

    def fit_budget(self, first_step: int, step_seconds: float, seconds_left: float) -> None:
        self.tcfg = fit_to_budget(self.tcfg, first_step, self.step, step_seconds, seconds_left)
        write_train_config(self.run_dir, self.tcfg)
        log.info(
            "budget: %.1f ms per step, %d steps in all, cooldown from %d",
            step_seconds * 1000,
            self.tcfg.max_steps,
            self.tcfg.cooldown_start,
        )

    def synchronized_time(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.time()

    def checkpoint(self, tokens_per_s: float, train_loss: float) -> None:
        vloss = validation_loss(self.model, self.valid)
        self.log_metrics(
            {
                "step": self.step,
                "epoch": self.epoch,
                "train_loss": train_loss,
                "valid_loss": vloss,
                "lr": lr_at(self.step, self.tcfg),
                "tokens_per_s": tokens_per_s,
                "time": time.time(),
            }
        )
        save_checkpoint(self.run_dir, self.state(), self.tcfg.keep_checkpoints)
        log.info(
            "step %d epoch %d train %.3f valid %.3f (%.0f tok/s)",
            self.step,
            self.epoch,
            train_loss,
            vloss,
            tokens_per_s,
        )

    def run(self) -> None:
        self.model.train()
        start = last_save = time.time()
        minutes = self.tcfg.budget_minutes or self.tcfg.max_minutes
        first_step = self.step
        tokens, loss_sum, loss_n = 0, torch.zeros((), device=self.device), 0
        while self.step < self.tcfg.last_step:
            batches = self.epoch_batches()
            bar = tqdm(batches[self.batch_in_epoch :], desc=f"epoch {self.epoch}", mininterval=30)
            for examples in bar:
                batch = collate(examples, self.device)
                loss_sum += self.train_step(batch)  # stays on the device: no wait per step
                loss_n += 1
                tokens += batch.n_tokens
                self.batch_in_epoch += 1
                if self.tcfg.budget_minutes:
                    self.time_the_budget(first_step, start, minutes)
                now = time.time()
                bar.set_postfix(step=self.step, refresh=False)
                out_of_time = now - start > minutes * 60 or self.step >= self.tcfg.last_step
                if now - last_save > self.tcfg.save_minutes * 60 or out_of_time:
                    self.checkpoint(tokens / (now - last_save), float(loss_sum) / loss_n)
                    last_save, tokens, loss_sum, loss_n = time.time(), 0, torch.zeros_like(loss_sum), 0
                if out_of_time:
                    return
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m model.training.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--recipe", type=Path, help="run this recipe's commands in order (see Recipe); no other flag")
    p.add_argument("--dry-run", action="store_true", help="with --recipe: log each command and run none")
    p.add_argument("--data", type=Path, default=Path("data"))
    p.add_argument("--tokenizer", type=Path, default=Path("model/shipped/tokenizer.model"))
    p.add_argument("--run", type=Path, default=Path("runs/base"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init-from", type=Path, help="start from this artifact's weights; its config sets the shape")
    p.add_argument("--start-step", type=int, default=0, help="with --init-from: where the LR schedule resumes")
    p.add_argument("--ship", type=Path, help="average the last checkpoints of --run into this dir and exit")
    p.add_argument("--average", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 keeps torch's default")
    for name, field_type in (
        ("d_model", int),
        ("n_heads", int),
        ("d_ff", int),
        ("n_encoder_layers", int),
        ("n_decoder_layers", int),
        ("dropout", float),
    ):
        p.add_argument(f"--{name.replace('_', '-')}", type=field_type, default=getattr(ModelConfig, name))
    for name in TRAIN_FLAGS:
        default = getattr(TrainConfig, name)
        if isinstance(default, bool):
            p.add_argument(f"--{name.replace('_', '-')}", action="store_true")
        else:
            p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    return p


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{name: getattr(args, name) for name in TRAIN_FLAGS})


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The run's model config: the flags' shape (or --init-from's), bound to the tokenizer by its sha256.

    Weights trained against one tokenizer are garbage with another of the same size, so going on from
    weights (--init-from, --resume) with a tokenizer other than theirs is refused.
    """
    tokenizer_sha256 = file_sha256(args.tokenizer)
    earlier_file = args.init_from / CONFIG_FILE if args.init_from else args.run / "model_config.json"
    earlier = ModelConfig.from_dict(json.loads(earlier_file.read_text())) if earlier_file.is_file() else None
    if earlier is not None and (args.init_from or args.resume):
        try:
            check_tokenizer(args.tokenizer, earlier.tokenizer_sha256)
        except ValueError as err:
            raise SystemExit(f"--tokenizer: {err}") from err
    if args.init_from:
        base = earlier or load_config(args.init_from)  # load_config names the missing file
        return dataclasses.replace(base, dropout=args.dropout, tokenizer_sha256=tokenizer_sha256)
    return ModelConfig(
        vocab_size=Tokenizer(args.tokenizer).vocab_size,
        d_model=args.d_model,
        n_heads=args.n_heads,
        d_ff=args.d_ff,
        n_encoder_layers=args.n_encoder_layers,
        n_decoder_layers=args.n_decoder_layers,
        dropout=args.dropout,
        tokenizer_sha256=tokenizer_sha256,
    )


def run(args: argparse.Namespace) -> None:
    """One training or shipping command."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ship:
        ship(args.run, args.ship, args.average, args.tokenizer)
        return
    if args.init_from and args.resume:
        raise SystemExit("--init-from starts a new run; --resume continues one: give one of them")
    mcfg = model_config(args)
    tcfg = train_config(args)
    args.run.mkdir(parents=True, exist_ok=True)
    (args.run / "model_config.json").write_text(mcfg.to_json())
    write_train_config(args.run, tcfg)
    trainer = Trainer(args, mcfg, tcfg)
    if args.resume:
        trainer.resume()
    elif args.init_from:
        trainer.warm_start(args.init_from, args.start_step)
    trainer.run()


@dataclass(frozen=True)
class Stage:
    """One named step of a recipe: model.training.train flags, optionally stopped at `save_at` steps on the way."""

    name: str
    args: tuple[str, ...]  # the command's flags, the recipe's common ones first (of a repeated flag the last wins)
    save_at: tuple[int, ...] = ()  # steps to stop and checkpoint at before the stage's end, for --average

    def commands(self) -> list[list[str]]:
        """The stage's commands: one per `save_at` step (each with --max-steps), then one to its end."""
        return [[*self.args, "--max-steps", str(step)] for step in self.save_at] + [list(self.args)]


def load_recipe(path: Path) -> list[Stage]:
    """A recipe file: {"common": [flags for every command], "stages": [{"name", "args", "save_at"?}, ...]}."""
    recipe = json.loads(path.read_text())
    common = tuple(recipe.get("common", ()))
    stages = [Stage(s["name"], tuple(s["args"]), tuple(s.get("save_at", ()))) for s in recipe["stages"]]
    return [dataclasses.replace(stage, args=(*common, *stage.args)) for stage in stages]


def newest_step(run_dir: Path) -> int:
    paths = checkpoint_paths(run_dir)
    return int(paths[-1].stem.split("_")[1]) if paths else 0


def run_recipe(path: Path, dry_run: bool) -> None:
    """Run a recipe's commands in order. Run again after an interruption, it skips what its run
    directories already hold and resumes the command that was cut off (a warm start with checkpoints
    in its directory resumes from them instead of starting over)."""
    parser = build_parser()
    for stage in load_recipe(path):
        for argv in stage.commands():
            args = parser.parse_args(argv)
            done = 0 if args.ship else newest_step(args.run)
            if not args.ship and done >= train_config(args).last_step:
                log.info("%s: %s already holds step %d; skipped", stage.name, args.run, done)
                continue
            if args.init_from and done:
                args.init_from, args.resume = None, True
            log.info("%s: python -m model.training.train %s", stage.name, " ".join(argv))
            if not dry_run:
                run(args)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.recipe:
        run_recipe(args.recipe, args.dry_run)
    else:
        run(args)


if __name__ == "__main__":
    main()
