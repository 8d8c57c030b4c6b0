"""The shipped model's training recipe parses, and each of its commands is valid for model.training.train (no
training)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from model.training.train import TrainConfig, build_parser, load_recipe, main, train_config

RECIPE = Path(__file__).resolve().parents[1] / "model" / "shipped" / "recipe.json"


def test_every_command_of_the_recipe_parses_with_model_trains_flags() -> None:
    parser = build_parser()
    stages = load_recipe(RECIPE)
    assert stages and all(stage.commands() for stage in stages)
    for stage in stages:
        for argv in stage.commands():
            try:
                args = parser.parse_args(argv)
            except SystemExit:
                pytest.fail(f"{stage.name}: model.training.train refuses {argv}")
            assert not (args.init_from and args.resume), stage.name


def test_the_schedule_is_continuous_and_ends_in_the_shipped_directory() -> None:
    """Each run directory's commands go forward in steps; a warm start starts where its average's run ended;
    an average takes no more checkpoints than the stages since the previous one wrote and training keeps."""
    parser = build_parser()
    reached: dict[Path, int] = {}  # run directory -> last step trained there
    saved: dict[Path, int] = {}  # run directory -> checkpoints written by the commands that ran there
    averaged_at: dict[Path, int] = {}  # averaged model directory -> the step its checkpoints reached
    ships = []
    for stage in load_recipe(RECIPE):
        for argv in stage.commands():
            args = parser.parse_args(argv)
            if args.ship:
                assert 1 <= args.average <= min(saved[args.run], TrainConfig.keep_checkpoints), stage.name
                averaged_at[args.ship] = reached[args.run]
                ships.append(args.ship)
                continue
            start = args.start_step if args.init_from else reached.get(args.run, 0)
            if args.init_from:
                assert averaged_at[args.init_from] == args.start_step, stage.name
                assert args.run not in reached, f"{stage.name}: a warm start needs a fresh run directory"
            end = train_config(args).last_step
            assert end > start, f"{stage.name}: ends at {end}, not after {start}"
            reached[args.run], saved[args.run] = end, saved.get(args.run, 0) + 1
    assert ships[-1] == Path("model/shipped")


def test_a_dry_run_lists_the_commands_and_trains_nothing(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the recipe's run directories are relative: none exists here
    with caplog.at_level(logging.INFO, logger="model.training.train"):
        main(["--recipe", str(RECIPE), "--dry-run"])
    commands = [r.getMessage() for r in caplog.records if "python -m model.training.train" in r.getMessage()]
    assert len(commands) == sum(len(stage.commands()) for stage in load_recipe(RECIPE))
    assert not any(tmp_path.iterdir())
