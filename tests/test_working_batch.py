"""The working-batch cache (`--kv-cache working`) against the captured runner's static slot buffers (on the CPU
provider, over the tiny model's capturable fp32 graphs): step for step through joins, beam copies, re-encoded
slots, compactions and parked slots; whole decodes; NaN left by a former occupant; and the export it needs."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
import pytest

from model.directory import MetadataError, buffer_head_dim
from server.backend.captured import CapturedRunner
from server.backend.working_batch import LENGTH_STEP, WorkingBatchRunner
from server.core.offline import translate_ids
from server.core.runner import EncodeItem

SOURCES = [[4, 10, 11, 12, 3], [5, 20, 21, 3], [4, 30, 31, 32, 33, 34, 3], [6, 7, 8, 9, 13, 14, 15, 16, 17, 3]]


@pytest.fixture(scope="module")
def variant(tiny_exported_dir: Path) -> Path:
    return tiny_exported_dir / "onnx" / "fp32"


def pair(variant: Path, max_slots: int) -> tuple[CapturedRunner, WorkingBatchRunner]:
    """The reference, whose slots each keep their keys/values where they are, and the working batch."""
    return CapturedRunner(variant, max_slots, intra_op_threads=1), WorkingBatchRunner(
        variant, max_slots, intra_op_threads=1
    )


def step_both(
    runners: tuple[CapturedRunner, WorkingBatchRunner], slots: list[int], tokens: list[int], positions: list[int]
) -> None:
    slot_out, working_out = (r.step_log_probs(slots, tokens, positions) for r in runners)
    np.testing.assert_allclose(working_out, slot_out, rtol=0, atol=1e-5)


def test_step_for_step_equal_to_the_slot_buffers_through_joins_copies_and_compactions(variant: Path) -> None:
    """Rows join at different steps, beams reorder within and across sources, sentences leave and their
    slots take new sources, the batch compacts (most rows sit idle) and its buffers grow longer."""
    runners = pair(variant, 12)
    rng = np.random.default_rng(0)
    position = dict.fromkeys(range(12), 0)
    source_of: dict[int, int] = {}

    def encode(slots: list[int], source: int) -> None:
        for r in runners:
            r.encode([EncodeItem(SOURCES[source], slots)])
        for slot in slots:
            position[slot], source_of[slot] = 0, source

    encode([0, 1, 2], 0)
    encode([3], 2)
    live = [0, 1, 2, 3]
    compactions = 0
    for step in range(40):
        if step == 3:
            encode([4, 5, 6, 7, 8, 9], 3)  # six more rows: later most of them leave at once
            live += [4, 5, 6, 7, 8, 9]
        if step == 9:
            live = [0, 1, 2, 3]  # six rows leave: more than a quarter idle, the batch compacts
        if step in (14, 26):
            encode([3], 1 + step % 3)  # slot 3 takes a new sentence
        width = runners[1].width
        tokens = [int(t) for t in rng.integers(4, 60, len(live))]
        step_both(runners, live, tokens, [position[s] for s in live])
        compactions += runners[1].width < width
        for slot in live:
            position[slot] += 1
        if step % 2:  # a beam reorder of slots 0-2, some of whose parents come from another source
            parents = [int(p) for p in rng.choice([0, 1, 2, 3], size=3)]
            for r in runners:
                r.copy_slots(parents, [0, 1, 2])
            moved = {d: position[p] for p, d in zip(parents, [0, 1, 2], strict=True)}
            position.update(moved)
    assert compactions >= 1
    assert runners[1].kv_store[0].shape[2] > LENGTH_STEP  # the buffers grew with the rows


def test_a_slot_idle_through_a_compaction_is_put_back(variant: Path) -> None:
    """A slot that sits out steps while the batch compacts keeps its keys/values (parked, then restored)."""
    runners = pair(variant, 10)
    for r in runners:
        r.encode([EncodeItem(SOURCES[0], [0]), EncodeItem(SOURCES[2], list(range(1, 10)))])
    for i in range(3):
        step_both(runners, list(range(10)), [40 + i] * 10, [i] * 10)
    for i in range(3, 6):  # slot 0 sits out; nine rows stay: compaction once eight of them leave
        step_both(runners, [9], [50 + i], [i])
    assert runners[1].row_of_slot[0] == -1 and 0 in runners[1].parked
    step_both(runners, [0, 9], [60, 61], [3, 6])  # slot 0 goes on from its position 3
    assert runners[1].row_of_slot[0] >= 0 and 0 not in runners[1].parked
    runners[1].copy_slots([0], [5])  # slot 5's row is parked or reused: the copy still reads slot 0
    runners[0].copy_slots([0], [5])
    step_both(runners, [5, 0], [70, 71], [4, 4])
    for i in range(5, 8):  # slot 0 sits out again while slots 5 and 9 go on
        step_both(runners, [5, 9], [80 + i, 81 + i], [i, i + 2])
    runners[1]._park(int(runners[1].row_of_slot[0]))  # as a compaction would
    for r in runners:  # a copy from a parked slot beside one from a slot in the batch, and a swap
        r.copy_slots([9, 0, 5], [0, 6, 9])
    step_both(runners, [0, 6, 9], [90, 91, 92], [10, 5, 8])


def test_the_cross_feed_grows_shrinks_and_grows_again_with_the_longest_source_stepped(variant: Path) -> None:
    """A long source widens the cross feed (new buffers), sitting out shrinks it (the same buffers, laid out
    again), and stepping again widens it inside them: every row fetched again, equal to the slot buffers."""
    runners = pair(variant, 6)
    long_source = [4 + i % 30 for i in range(59)] + [3]
    for r in runners:
        r.encode([EncodeItem(SOURCES[0], [0]), EncodeItem(SOURCES[1], [1])])
    step_both(runners, [0, 1], [40, 41], [0, 0])
    for r in runners:
        r.encode([EncodeItem(long_source, [2])])
    buffers = None
    for i in range(1, 4):
        step_both(runners, [0, 1, 2], [42 + i, 43 + i, 44 + i], [i, i, i - 1])
        buffers = buffers or [id(b) for b in runners[1].cross.buffers]
    assert runners[1].cross.mask.shape[1] == 64
    step_both(runners, [0, 1], [50, 51], [4, 4])  # the long source sits out: the feed shrinks
    assert runners[1].cross.mask.shape[1] == 16 and [id(b) for b in runners[1].cross.buffers] == buffers
    step_both(runners, [2, 0, 1], [52, 53, 54], [3, 5, 5])
    assert runners[1].cross.mask.shape[1] == 64 and [id(b) for b in runners[1].cross.buffers] == buffers


def test_a_slot_restepped_at_an_earlier_position_forgets_later_tokens(variant: Path) -> None:
    runners = pair(variant, 2)
    for r in runners:
        r.encode([EncodeItem(SOURCES[1], [0])])
    for i in range(4):
        step_both(runners, [0], [40 + i], [i])
    step_both(runners, [0], [70], [2])  # again from position 2, as the slot buffers allow
    step_both(runners, [0], [71], [3])
    with pytest.raises(RuntimeError, match="slot 0 stepped at position 9 holds 4 tokens"):
        runners[1].step_log_probs([0], [72], [9])


@pytest.mark.parametrize("beam", [1, 3])
def test_whole_decodes_equal_the_slot_buffers(variant: Path, beam: int) -> None:
    """Few slots for many sentences: rows are reused, parked and compacted all along."""
    sources = [[*SOURCES[i % 4][:-1], 7 + i % 5, 3] for i in range(24)]
    slots, working = pair(variant, 4 * beam)
    expected = translate_ids(slots, sources, beam, 1.0, None)
    got = translate_ids(working, sources, beam, 1.0, None)
    assert [[h.tokens for h in hyps] for hyps in got] == [[h.tokens for h in hyps] for hyps in expected]
    for mine, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose([h.score for h in mine], [h.score for h in theirs], rtol=0, atol=1e-4)
    assert working.width <= working.max_slots


def test_a_step_that_raised_leaves_the_batch_as_it_was(variant: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine reruns the requests of a step whose runner call raised: their slots must step again from
    where they were, new rows included."""
    runners = pair(variant, 4)
    for r in runners:
        r.encode([EncodeItem(SOURCES[0], [0]), EncodeItem(SOURCES[2], [1])])
    step_both(runners, [0], [40], [0])
    working = runners[1]
    real_run = working.decoder.run_with_iobinding

    def fail(*_: object) -> None:
        raise RuntimeError("onnxruntime failed")

    monkeypatch.setattr(working.decoder, "run_with_iobinding", fail)
    with pytest.raises(RuntimeError, match="onnxruntime failed"):
        working.step_log_probs([0, 1], [41, 50], [1, 0])  # slot 1 joins in the step that fails
    monkeypatch.setattr(working.decoder, "run_with_iobinding", real_run)
    step_both(runners, [0, 1], [41, 50], [1, 0])
    step_both(runners, [1, 0], [51, 42], [1, 2])


def test_a_row_left_with_nan_is_clean_for_its_next_sentence(variant: Path) -> None:
    """A former occupant's NaN sits in the entries past the new sentence's own, which the step never reads."""
    runners = pair(variant, 3)
    for r in runners:
        r.encode([EncodeItem(SOURCES[2], [0]), EncodeItem(SOURCES[0], [1])])
    for i in range(5):
        step_both(runners, [0, 1], [40 + i, 50 + i], [i, i])
    working = runners[1]
    row = int(working.row_of_slot[0])
    for array in working.kv_store:
        array[row] = np.nan  # what a sentence whose activations overflowed leaves behind
    for r in runners:
        r.encode([EncodeItem(SOURCES[1], [0])])  # a new sentence takes slot 0
    for j in range(3):
        step_both(runners, [0, 1], [60 + j, 55 + j], [j, 5 + j])


def bound_step(
    runner: WorkingBatchRunner, feeds: dict[str, np.ndarray], bound: Iterable[tuple[str, str, np.ndarray]]
) -> np.ndarray:
    """One decoder step of `feeds`, each (input, output, buffer) of `bound` bound as both; its top_scores."""
    binding = runner.decoder.io_binding()
    binding.bind_output("top_scores", "cpu")
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    for name, updated, buffer in bound:
        binding.bind_cpu_input(name, buffer)
        binding.bind_output(updated, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
    runner.decoder.run_with_iobinding(binding)
    scores: np.ndarray = binding.copy_outputs_to_cpu()[0]
    return scores


def step_feeds(positions: np.ndarray, src_mask: np.ndarray) -> dict[str, np.ndarray]:
    """Two rows' non-buffer inputs: tokens 5 and 6 at `positions` over `src_mask` (a row's source each, or one
    source both rows read as one cross group), no bias, 5 candidates."""
    groups = np.arange(2, dtype=np.int64).reshape(len(src_mask), -1)  # two masks: a group per row; one: one group
    return {"tokens": np.asarray([5, 6]), "positions": positions, "src_mask": src_mask, "cross_rows": groups,
            "row_cross": np.arange(2, dtype=np.int64), "row_scores": np.zeros(2, np.float32),
            "bias_ids": np.zeros((2, 1), np.int64), "bias_values": np.zeros((2, 1), np.float32),
            "top_k": np.asarray([5])}  # fmt: skip


def filled_beyond(
    base: list[np.ndarray], lengths: np.ndarray, fill: float
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Copies of the (rows, H, n, Dh) `base` buffers with each row's entries from lengths[row] on set to `fill`, and
    a second copy of them as they were before a step."""
    buffers = [array.copy() for array in base]
    for buffer in buffers:
        for row, length in enumerate(lengths):
            buffer[row, :, length:] = fill
    return buffers, [buffer.copy() for buffer in buffers]


def test_the_step_writes_each_rows_key_and_value_at_its_position_and_reads_nothing_past_it(variant: Path) -> None:
    """The export's contract with the buffers bound as past_* and present_*: each row's new key and value land at
    that row's position, every other entry stays as it was, and entries past a row's position are never read
    (NaN there leaves every score finite and equal to the same step over zeros)."""
    runner = WorkingBatchRunner(variant, 2, intra_op_threads=1)
    rng = np.random.default_rng(1)
    heads, head_dim, n = runner.metadata.n_heads, runner.metadata.head_dim, runner.n_layers
    positions = np.asarray([3, 1])
    cross = [rng.standard_normal((2, heads, 4, head_dim)).astype(np.float32) for _ in range(2 * n)]
    feeds = step_feeds(positions, np.ones((2, 4), bool)) | dict(zip(runner.cross_names, cross, strict=True))

    base = [rng.standard_normal((2, heads, 6, head_dim)).astype(np.float32) for _ in range(2 * n)]

    def step(past_fill: float) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        buffers, before = filled_beyond(base, positions, past_fill)
        scores = bound_step(runner, feeds, zip(runner.past_names, runner.present_names, buffers, strict=True))
        return before, buffers, scores

    before, after, scores = step(np.nan)
    for old, new in zip(before, after, strict=True):
        written = np.zeros(old.shape, bool)
        written[[0, 1], :, positions] = True
        assert np.isfinite(new[written]).all()
        np.testing.assert_array_equal(new[~written], old[~written])
    np.testing.assert_array_equal(scores, step(0.0)[2])


def test_the_cross_feed_is_read_only_within_each_rows_own_source(variant: Path) -> None:
    """The step reads a row's cross keys/values up to its own source length and no further, which is why the
    working batch fetches only those entries into a row and leaves the rest as a former occupant left them:
    NaN past each row's source leaves every score equal to the same step over zeros, and the feed unchanged."""
    runner = WorkingBatchRunner(variant, 2, intra_op_threads=1)
    rng = np.random.default_rng(2)
    heads, head_dim, n = runner.metadata.n_heads, runner.metadata.head_dim, runner.n_layers
    lengths = np.asarray([5, 2])
    width = buffer_head_dim(head_dim)
    feeds = step_feeds(np.asarray([1, 1]), np.arange(6)[None, :] < lengths[:, None])
    base = [rng.standard_normal((2, heads, 6, width)).astype(np.float32) for _ in range(2 * n)]
    past = [rng.standard_normal((2, heads, 4, width)).astype(np.float32) for _ in range(2 * n)]

    def step(fill: float) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        cross, before = filled_beyond(base, lengths, fill)
        buffers = [array.copy() for array in past]
        bound = (*zip(runner.past_names, runner.present_names, buffers, strict=True),
                 *zip(runner.cross_names, runner.cross_present_names, cross, strict=True))  # fmt: skip
        return before, cross, bound_step(runner, feeds, bound)

    before, after, scores = step(np.nan)
    assert np.isfinite(scores).all()
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(new, old)  # NaN compares equal here: the past-source entries stay NaN
    np.testing.assert_array_equal(scores, step(0.0)[2])


def test_a_groups_rows_read_one_copy_of_its_source_as_each_would_read_its_own(variant: Path) -> None:
    """Two rows of one source fed as one cross group (G = 2) score as the same rows fed a copy each: the kernel
    writes its G - 1 entries past the source before any query reads, and the bias keeps every query off them and
    off whatever lies beyond (NaN there changes nothing)."""
    runner = WorkingBatchRunner(variant, 2, intra_op_threads=1)
    assert runner.metadata.cross_groups
    rng = np.random.default_rng(3)
    heads, width, n = runner.metadata.n_heads, buffer_head_dim(runner.metadata.head_dim), runner.n_layers
    length, span = 3, 6
    base = [rng.standard_normal((1, heads, span, width)).astype(np.float32) for _ in range(2 * n)]
    past = [rng.standard_normal((2, heads, 4, width)).astype(np.float32) for _ in range(2 * n)]

    def step(cross: list[np.ndarray], sources: int) -> np.ndarray:
        feeds = step_feeds(np.asarray([1, 2]), np.repeat(np.arange(span)[None, :] < length, sources, axis=0))
        buffers = [array.copy() for array in past]
        bound = (*zip(runner.past_names, runner.present_names, buffers, strict=True),
                 *zip(runner.cross_names, runner.cross_present_names, cross, strict=True))  # fmt: skip
        return bound_step(runner, feeds, bound)

    apart = step([np.repeat(array, 2, axis=0) for array in base], 2)
    shared = step(filled_beyond(base, np.asarray([length]), np.nan)[0], 1)
    assert np.isfinite(shared).all()
    np.testing.assert_allclose(shared, apart, rtol=0, atol=1e-5)


def test_an_export_without_present_outputs_is_refused_with_the_fix(variant: Path, tmp_path: Path) -> None:
    old = tmp_path / "fp32"
    shutil.copytree(variant, old)
    model = onnx.load(str(old / "decoder_step.onnx"))
    kept = [output for output in model.graph.output if not output.name.startswith("present_")]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    onnx.save(model, str(old / "decoder_step.onnx"))
    CapturedRunner(old, 2)  # the captured runner steps its own graph
    with pytest.raises(MetadataError, match=r"predates the decoder step that writes.*python -m export"):
        WorkingBatchRunner(old, 2)
