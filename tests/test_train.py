"""Training machinery: a tiny model overfits a few pairs; schedule, checkpoint averaging and artifacts."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.config import ModelConfig
from model.data import Pair, is_sentence, write_tsv
from model.tokenizer import Tokenizer, file_sha256
from model.training import train as train_module
from model.training.artifact import TOKENIZER_FILE, load_artifact, load_config, save_artifact
from model.training.batching import Example, Resegmenter, collate, epoch_examples, make_examples, pad, token_batches
from model.training.decode import greedy
from model.training.overfit import memorisation_gap
from model.training.train import (
    TrainConfig,
    Trainer,
    average_checkpoints,
    build_parser,
    fit_to_budget,
    loss_of,
    lr_at,
    model_config,
    save_checkpoint,
    train_config,
)
from model.training.transformer import make_model
from tests.tiny import TINY_PAIRS

PAIRS = [((4, 10, 11, 3), (20, 21, 3)), ((4, 12, 13, 14, 3), (22, 23, 24, 3)), ((5, 15, 3), (25, 3))]


def test_lr_warms_up_then_decays() -> None:
    cfg = TrainConfig(peak_lr=1e-3, warmup_steps=100)
    assert lr_at(50, cfg) < lr_at(100, cfg) == 1e-3
    assert lr_at(400, cfg) == 1e-3 * 0.5


def test_cooldown_falls_linearly_to_zero_from_the_decayed_rate() -> None:
    plain = TrainConfig(peak_lr=1e-3, warmup_steps=100)
    cool = TrainConfig(peak_lr=1e-3, warmup_steps=100, cooldown_start=400, cooldown_steps=200)
    assert lr_at(400, cool) == lr_at(400, plain) == 5e-4  # unchanged up to the start
    assert lr_at(500, cool) == 5e-4 * 0.5
    assert lr_at(600, cool) == lr_at(900, cool) == 0.0
    assert cool.last_step == 600 and plain.last_step == plain.max_steps  # training stops where the rate hits zero


def test_mixture_repeats_sentences_and_samples_words() -> None:
    examples = [Example((1,), (2,), "sentence"), Example((1,), (3,), "phrase")] + [Example((1,), (4,), "word")] * 1000
    chosen = epoch_examples(examples, TrainConfig(sentence_repeats=5, word_fraction=0.1).mixture, random.Random(0))
    classes = [e.weight_class for e in chosen]
    assert classes.count("sentence") == 5 and classes.count("phrase") == 1
    assert 60 < classes.count("word") < 140


def test_given_sentences_replace_the_repeats_and_the_rest_is_sampled_as_before() -> None:
    examples = [Example((1,), (2,), "sentence"), Example((1,), (3,), "phrase")] + [Example((1,), (4,), "word")] * 50
    sampled = [Example((1, 9), (2,), "sentence"), Example((1, 8), (2,), "sentence")]
    mixture = TrainConfig(sentence_repeats=5, word_fraction=0.5).mixture
    plain = epoch_examples(examples, mixture, random.Random(0))
    chosen = epoch_examples(examples, mixture, random.Random(0), sampled)
    assert [e for e in chosen if e.weight_class == "sentence"] == sampled
    assert [e for e in chosen if e.weight_class != "sentence"] == [e for e in plain if e.weight_class != "sentence"]


def test_resegmenter_samples_other_source_pieces_of_the_same_text_and_repeats_itself_for_a_seed(
    tiny_model_dir: Path,
) -> None:
    tok = Tokenizer(tiny_model_dir / TOKENIZER_FILE)
    pairs = [Pair(de, en) for de, en in TINY_PAIRS] + [Pair("Haus", "house")]  # a word: not resampled
    resegmenter = Resegmenter(pairs, tok, max_len=64, alpha=0.3)
    first, again, other = (resegmenter.examples(3, seed) for seed in (1, 1, 2))
    assert first == again and first != other
    n_sentences = sum(is_sentence(p) for p in pairs)
    assert n_sentences > 5
    assert len(first) == 3 * 2 * n_sentences and {e.weight_class for e in first} == {"sentence"}
    best = {e.tgt: e.src for e in make_examples(pairs, tok, 64)}  # target -> its source, best pieces
    assert all(e.tgt in best for e in first)  # targets keep the best segmentation
    for example in first:  # the source is the same text, spelt with (sometimes) other pieces
        assert tok.decode(list(example.src[1:-1])) == tok.decode(list(best[example.tgt][1:-1]))
    assert any(e.src != best[e.tgt] for e in first)


RESEGMENT_SCRIPT = """
import hashlib, sys
from model.training.batching import Resegmenter
from model.data import Pair
from model.tokenizer import Tokenizer
from tests.tiny import TINY_PAIRS
resegmenter = Resegmenter([Pair(de, en) for de, en in TINY_PAIRS], Tokenizer(sys.argv[1]), 64, alpha=0.3)
print(hashlib.sha256(repr(resegmenter.examples(3, seed=5)).encode()).hexdigest())
"""


def test_resegmenter_draws_anew_for_each_repeat_and_the_same_in_another_process(tiny_model_dir: Path) -> None:
    """A resumed run is another process: its epoch must be drawn as the first process drew it. (SentencePiece's
    own sampling failed this with its seed set, and drew the same pieces for every repeat of an epoch.)"""
    tok = Tokenizer(tiny_model_dir / TOKENIZER_FILE)
    resegmenter = Resegmenter([Pair(de, en) for de, en in TINY_PAIRS], tok, max_len=64, alpha=0.3)
    examples = resegmenter.examples(3, seed=5)
    n = len(examples) // 3
    assert examples[:n] != examples[n : 2 * n] != examples[2 * n :]
    run = [sys.executable, "-c", RESEGMENT_SCRIPT, str(tiny_model_dir / TOKENIZER_FILE)]
    digests = {subprocess.run(run, capture_output=True, text=True, check=True).stdout for _ in range(2)}
    assert digests == {hashlib.sha256(repr(examples).encode()).hexdigest() + "\n"}


def test_memorisation_gap_is_zero_on_the_same_sentences_and_counts_only_sentences(tiny_model_dir: Path) -> None:
    sentences = [Pair(de, en) for de, en in TINY_PAIRS if is_sentence(Pair(de, en))]
    words = [Pair("Haus", "house")] * 50  # never in the training sample: only sentences are
    same = memorisation_gap(tiny_model_dir, sentences + words, sentences)
    assert same.sentences == len(sentences) and same.nats == pytest.approx(0.0, abs=1e-5)
    other = memorisation_gap(tiny_model_dir, sentences + words, [Pair("Der Baum ist grün.", "The tree is green.")])
    assert other.sentences == 1 and other.nats != pytest.approx(0.0, abs=1e-3)
    with pytest.raises(ValueError, match="no training sentences"):
        memorisation_gap(tiny_model_dir, words, sentences)


def test_token_batches_respect_budget() -> None:
    rng = random.Random(0)
    examples = [Example(tuple(range(rng.randint(3, 20))), tuple(range(rng.randint(3, 20))), "word") for _ in range(300)]
    batches = token_batches(examples, 200, rng)
    assert sum(len(b) for b in batches) == 300
    assert all(len(b) * max(len(e.src) + len(e.tgt) + 1 for e in b) <= 200 for b in batches if len(b) > 1)


def test_pad_right_pads_rows_of_any_length() -> None:
    rows = [(5, 6, 7), (8,), (9, 10), (11, 12, 13)]
    expected = torch.tensor([[5, 6, 7], [8, 0, 0], [9, 10, 0], [11, 12, 13]])
    assert torch.equal(pad(rows), expected)
    assert torch.equal(pad([(4,)]), torch.tensor([[4]]))


def test_a_budget_fits_the_last_step_and_a_cooldown_of_this_processes_steps() -> None:
    cfg = TrainConfig(budget_minutes=2.0, budget_cooldown=0.25)
    fresh = fit_to_budget(cfg, first_step=0, step=120, seconds_per_step=0.1, seconds_left=100.0)
    assert fresh.max_steps == 120 + int(train_module.BUDGET_MARGIN * 1000)
    assert fresh.cooldown_steps == int(0.25 * fresh.max_steps)
    assert fresh.cooldown_start + fresh.cooldown_steps == fresh.max_steps == fresh.last_step
    resumed = fit_to_budget(cfg, first_step=10_000, step=10_120, seconds_per_step=0.1, seconds_left=100.0)
    assert resumed.max_steps == fresh.max_steps + 10_000
    assert resumed.cooldown_steps == fresh.cooldown_steps  # a share of its own cycle, not of all steps
    assert lr_at(resumed.max_steps, resumed) == 0.0 < lr_at(resumed.cooldown_start, resumed)


def test_bf16_and_the_budget_are_flags_saved_in_the_train_config() -> None:
    args = build_parser().parse_args(["--bf16", "--budget-minutes", "9.5"])
    assert train_config(args) == TrainConfig(bf16=True, budget_minutes=9.5)
    assert train_config(build_parser().parse_args([])).bf16 is False


class SteppingClock:
    """A stand-in for the `time` module whose clock moves `tick` seconds at every reading."""

    def __init__(self, tick: float) -> None:
        self.tick, self.now = tick, 0.0

    def time(self) -> float:
        self.now += self.tick
        return self.now


def test_a_budget_run_trains_under_bf16_and_ends_on_its_fitted_schedule(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(train_module, "CALIBRATION_SKIP", 1)
    monkeypatch.setattr(train_module, "CALIBRATION_STEPS", 2)
    monkeypatch.setattr(train_module, "time", SteppingClock(0.05))  # the same schedule on a fast or loaded machine
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train", "valid"):
        write_tsv([Pair(de, en) for de, en in TINY_PAIRS], data / f"{name}.tsv")
    args = argparse.Namespace(run=tmp_path / "run", device="cpu", tokenizer=tiny_model_dir / TOKENIZER_FILE, data=data)
    args.run.mkdir()
    trainer = Trainer(args, load_config(tiny_model_dir), TrainConfig(max_tokens=60, bf16=True, budget_minutes=0.02))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.run()
    fitted = trainer.tcfg
    assert fitted.max_steps > 3 and fitted.cooldown_start + fitted.cooldown_steps == fitted.max_steps
    assert json.loads((args.run / "train_config.json").read_text()) == dataclasses.asdict(fitted)
    assert 3 < trainer.step <= fitted.max_steps  # the step cap, or the wall-time cap just before it
    assert any(not torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    assert all(torch.isfinite(v).all() for v in trainer.model.state_dict().values())
    (args.run / "model_config.json").write_text(load_config(tiny_model_dir).to_json())  # as train_module.run() does
    shipped = tmp_path / "shipped"
    train_module.ship(args.run, shipped, n_average=2, tokenizer=args.tokenizer)
    assert (shipped / TOKENIZER_FILE).read_bytes() == args.tokenizer.read_bytes()
    assert load_artifact(shipped).cfg == load_config(tiny_model_dir)


def test_tiny_model_overfits_a_few_pairs() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=32, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, max_len=16
    )
    model = make_model(cfg)
    batch = collate([Example(s, t, "sentence") for s, t in PAIRS], torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        opt.zero_grad()
        (loss_of(model, batch, 0.0) / batch.n_tokens).backward()
        opt.step()
    model.eval()
    for src, tgt in PAIRS:
        assert greedy(model, list(src), max_len=8).tokens == tgt[:-1]


def test_checkpoint_average_and_artifact_roundtrip(tmp_path: Path) -> None:
    cfg = ModelConfig(vocab_size=32, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1)
    models = [make_model(cfg) for _ in range(2)]
    for step, m in enumerate(models):
        save_checkpoint(tmp_path, {"model": m.state_dict(), "step": step}, keep=5)
    avg = average_checkpoints(sorted(tmp_path.glob("ckpt_*.pt")))
    key = "embed.weight"
    torch.testing.assert_close(avg[key], (models[0].state_dict()[key] + models[1].state_dict()[key]) / 2)
    for step in (7, 10, 9):  # pruning keeps the newest by step, not by the order they were written
        save_checkpoint(tmp_path, {"model": models[0].state_dict(), "step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt_*.pt")) == ["ckpt_0000009.pt", "ckpt_0000010.pt"]
    save_artifact(models[0], tmp_path / "artifact", dtype=torch.float32)
    loaded = load_artifact(tmp_path / "artifact")
    assert loaded.cfg == cfg
    torch.testing.assert_close(loaded.state_dict()[key], models[0].state_dict()[key])


def test_warm_start_loads_a_shipped_artifact_and_continues_its_schedule(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A fresh machine has the shipped weights but not the run's checkpoints: training goes on from them."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train", "valid"):
        write_tsv([Pair(de, en) for de, en in TINY_PAIRS], data / f"{name}.tsv")
    args = argparse.Namespace(run=tmp_path / "run", device="cpu", tokenizer=tiny_model_dir / TOKENIZER_FILE, data=data)
    trainer = Trainer(args, load_config(tiny_model_dir), TrainConfig())
    trainer.warm_start(tiny_model_dir, start_step=500)
    shipped = load_artifact(tiny_model_dir).state_dict()
    assert trainer.step == 500
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(tensor, shipped[name])
    other = Trainer(args, ModelConfig(**{**load_config(tiny_model_dir).to_dict(), "d_ff": 48}), TrainConfig())
    with pytest.raises(ValueError, match="another shape"):
        other.warm_start(tiny_model_dir, start_step=0)


def test_a_run_records_its_tokenizer_and_goes_on_from_weights_only_with_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = tiny_model_dir / TOKENIZER_FILE
    shape = {name: getattr(ModelConfig, name) for name in ("d_model", "n_heads", "d_ff", "n_encoder_layers")}
    flags = {**shape, "n_decoder_layers": 1, "dropout": 0.1, "run": tmp_path / "run", "resume": False}
    fresh = model_config(argparse.Namespace(tokenizer=tokenizer, init_from=None, **flags))
    assert fresh.tokenizer_sha256 == file_sha256(tokenizer) == load_config(tiny_model_dir).tokenizer_sha256
    continued = model_config(argparse.Namespace(tokenizer=tokenizer, init_from=tiny_model_dir, **flags))
    assert continued == dataclasses.replace(load_config(tiny_model_dir), dropout=0.1)
    other = tmp_path / "other.model"
    other.write_bytes(tokenizer.read_bytes() + b"\0")  # any other file
    with pytest.raises(SystemExit, match="not the tokenizer the model was trained with"):
        model_config(argparse.Namespace(tokenizer=other, init_from=tiny_model_dir, **flags))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model_config.json").write_text(fresh.to_json())
    with pytest.raises(SystemExit, match="not the tokenizer the model was trained with"):
        model_config(argparse.Namespace(tokenizer=other, init_from=None, **{**flags, "resume": True}))


@pytest.mark.parametrize("subword_alpha", [0.0, 0.3])
def test_resume_continues_exactly_as_an_uninterrupted_run(
    tiny_model_dir: Path, tmp_path: Path, subword_alpha: float
) -> None:
    """Weights, Adam moments, the data position and dropout's random state all come back from the checkpoint;
    with subword regularisation the epoch's sampled segmentations too."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train", "valid"):
        write_tsv([Pair(de, en) for de, en in TINY_PAIRS], data / f"{name}.tsv")
    config = dataclasses.replace(load_config(tiny_model_dir), dropout=0.1)  # so that the random state matters

    def train(run: str, steps: int, resume: bool = False) -> Trainer:
        args = argparse.Namespace(
            run=tmp_path / run, device="cpu", tokenizer=tiny_model_dir / TOKENIZER_FILE, data=data
        )
        args.run.mkdir(exist_ok=True)
        settings = TrainConfig(
            max_tokens=60, warmup_steps=2, max_steps=steps, save_minutes=1e9, subword_alpha=subword_alpha
        )
        trainer = Trainer(args, config, settings)
        if resume:
            trainer.resume()
        trainer.run()
        return trainer

    straight = train("straight", 5)
    train("split", 2)  # stops, and checkpoints, at step 2, part-way through an epoch
    resumed = train("split", 5, resume=True)
    assert resumed.step == straight.step == 5 and resumed.epoch == straight.epoch
    assert straight.batch_in_epoch == resumed.batch_in_epoch
    for name, tensor in straight.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_loss_plot_chains_a_resumed_run(tmp_path: Path) -> None:
    from model.training.plot import chain, plot

    base = [{"step": s, "train_loss": 5.0 - s / 100, "valid_loss": 4.0 - s / 100} for s in (100, 200, 300)]
    finish = [{"step": s, "train_loss": 2.0, "valid_loss": 1.5} for s in (250, 350)]  # resumed from step 200
    records, takeovers = chain([base, finish])
    assert [r["step"] for r in records] == [100, 200, 250, 350] and takeovers == [200]
    plot(records, tmp_path / "loss.png", takeovers)
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
