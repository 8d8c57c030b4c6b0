"""Memory comes back once the largest shapes have passed (server.backend.arena_release): the release rule on a
recorded session, both of the runner's sessions wired through it, and the resident set of a working batch
that met the engine's largest encode and step falling back near where it stood before."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from server.backend import arena_release
from server.backend.arena_release import RELEASE_SPACING, ArenaRelease, trim_heap
from server.backend.runners import open_runner
from server.backend.working_batch import WorkingBatchRunner
from server.core.runner import EncodeItem


class RecordedSession:
    """Stands in for an InferenceSession: records whether each call ran with release options."""

    def __init__(self) -> None:
        self.released: list[bool] = []

    def run(self, names: Sequence[str] | None, feeds: Mapping[str, Any], options: object = None) -> list[Any]:
        self.released.append(options is not None)
        return []


def test_a_session_releases_once_its_calls_fall_to_half_their_largest_and_not_more_often_than_the_spacing() -> None:
    memory = ArenaRelease(ratio=2, spacing=3)
    session = RecordedSession()
    for size in (10, 100, 60, 50, 50, 10, 10, 100, 40):
        memory.run(session, None, {}, size)  # type: ignore[arg-type]
    # 50 is half of 100 at the fourth call; after it, 10 is a fifth of 50 but only 2 calls have passed;
    # the third call after the release (10) goes; 40 after 100 is below half and 2 calls after it: waits.
    assert session.released == [False, False, False, True, False, False, True, False, False]
    assert memory.releases == 2


def test_a_release_trims_the_heap_after_its_call_and_no_other_call_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The arena's shrinkage alone leaves glibc holding the freed pages; the release trims the heap after the call.

    Deliberate break: `ArenaRelease.run` without its `trim_heap()` fails it (no trim at the release)."""
    events: list[str] = []
    monkeypatch.setattr(arena_release, "trim_heap", lambda: events.append("trim"))

    class Session(RecordedSession):
        def run(self, names: Sequence[str] | None, feeds: Mapping[str, Any], options: object = None) -> list[Any]:
            events.append("release" if options is not None else "call")
            return super().run(names, feeds, options)

    memory, session = ArenaRelease(ratio=2, spacing=1), Session()
    for size in (100, 80, 50, 40):  # 50 is half of 100: released; 40 is not half of 50
        memory.run(session, None, {}, size)  # type: ignore[arg-type]
    assert events == ["call", "call", "release", "trim", "call"]


def test_the_spacing_counts_the_calls_of_every_session_of_the_runner() -> None:
    memory = ArenaRelease(ratio=2, spacing=4)
    encoder, decoder = RecordedSession(), RecordedSession()
    memory.run(encoder, None, {}, 100)  # type: ignore[arg-type]
    for _ in range(3):
        memory.run(decoder, None, {}, 8)  # type: ignore[arg-type]
    memory.run(encoder, None, {}, 1)  # type: ignore[arg-type]
    assert encoder.released == [False, True] and not any(decoder.released)


def runner_for(variant_dir: Path, slots: int) -> WorkingBatchRunner:
    runner = open_runner(variant_dir, slots, "cpu", 1, "auto", spin_threads=False)
    assert isinstance(runner, WorkingBatchRunner), "auto on CPU is the working batch"
    return runner


def largest_then_small(runner: WorkingBatchRunner, steps: int, small_calls: int) -> tuple[float, float]:
    """The resident set after the engine's largest encode (every slot, the longest source) and `steps` steps
    of every slot, then after `small_calls` calls of one short sentence: (at the largest, after the small)."""
    spec, slots = runner.spec, list(range(runner.max_slots))
    pieces = [4 + i % (spec.vocab_size - 4) for i in range(spec.max_source_len - 2)]
    runner.encode([EncodeItem([spec.tag_ids["en"], *pieces, spec.eos_id], [slot]) for slot in slots])
    for position in range(steps):
        runner.step(slots, [spec.bos_id] * len(slots), [position] * len(slots), [0.0] * len(slots), 1)
    largest = rss_mib()
    small_work(runner, small_calls)
    return largest, rss_mib()


def small_work(runner: WorkingBatchRunner, calls: int) -> None:
    """One short sentence encoded and stepped 7 times over, until `calls` runner calls have passed."""
    spec = runner.spec
    for call in range(calls):
        if call % 8 == 0:
            runner.encode([EncodeItem([spec.tag_ids["en"], 5, 6, spec.eos_id], [0])])
        else:
            runner.step([0], [spec.bos_id], [call % 8 - 1], [0.0], 1)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_both_sessions_of_the_working_batch_release_after_the_largest_shapes(tiny_exported_dir: Path) -> None:
    runner = runner_for(tiny_exported_dir / "onnx" / "fp32", 16)
    runner.memory = ArenaRelease(spacing=1)
    largest_then_small(runner, runner.spec.max_target_len, 2)
    assert set(runner.memory.released_at) == {runner.encoder, runner.decoder}


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model whose largest encode needs some hundreds of MiB: 256 wide, 256 positions, fp32."""
    from export.__main__ import main as export
    from tests.tiny import TINY_CONFIG, build_tiny_artifact

    out = tmp_path_factory.mktemp("wide_model")
    config = replace(TINY_CONFIG, d_model=256, d_ff=512, n_encoder_layers=1, n_decoder_layers=1, max_len=256)
    build_tiny_artifact(out, config=config)
    assert export(["--model-dir", str(out), "--variants", "fp32"]) == 0
    return out / "onnx" / "fp32"


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the resident set from /proc")
def test_the_resident_set_falls_back_after_the_largest_shapes(wide_model: Path) -> None:
    """Without a release the arena keeps the largest encode's memory for good (the resident set stays at its
    peak); with it the memory comes back, within RELEASE_SPACING calls, but for the slot caches the largest
    source filled."""
    runner = runner_for(wide_model, 64)
    small_work(runner, 8)
    trim_heap()  # what earlier tests freed would otherwise hide the largest shapes' growth
    before = rss_mib()
    largest, after = largest_then_small(runner, 8, RELEASE_SPACING)
    assert largest - before > 200, f"the largest shapes should need memory: {before:.0f} -> {largest:.0f} MiB"
    assert after - before < (largest - before) / 3, f"{before:.0f} -> {largest:.0f} -> {after:.0f} MiB"
