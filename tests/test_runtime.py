"""Both runners (the working batch, and the captured runner on the CPU provider over the capturable fp32 graphs)
against PyTorch on the tiny model: encoder, per-step logits, cache semantics, int8; and how `open_runner`
chooses between them (tests/test_captured.py steps one against the other)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from model.directory import FUSED_DECODER_FILE, FUSED_ENCODER_FILE, METADATA_FILE, MetadataError
from model.training.artifact import load_artifact
from server.backend.captured import CapturedRunner
from server.backend.runners import auto_cache_place, open_runner
from server.backend.runtime import OnnxRunner, make_session
from server.backend.working_batch import WorkingBatchRunner
from server.core.beam import row_candidates
from server.core.runner import EncodeItem

SOURCES = [[4, 10, 11, 12, 3], [5, 20, 21, 3], [4, 30, 31, 32, 33, 34, 3]]


@pytest.fixture(scope="module")
def model_dir(tiny_exported_dir: Path) -> Path:
    return tiny_exported_dir


RUNNERS = {"working": WorkingBatchRunner, "fused": CapturedRunner}  # by --kv-cache, each on the CPU provider


@pytest.fixture(params=list(RUNNERS))
def runner(model_dir: Path, request: pytest.FixtureRequest) -> OnnxRunner:
    return RUNNERS[request.param](model_dir / "onnx" / "fp32", max_slots=8, intra_op_threads=1)


def host(cache: object) -> np.ndarray:
    """A cache as numpy, wherever the runner keeps it."""
    return cache.numpy() if isinstance(cache, ort.OrtValue) else np.asarray(cache)


def torch_full_logprobs(model_dir: Path, src: list[int], tgt_in: list[int]) -> np.ndarray:
    """Full recomputation (no cache) of every target position: (T, V)."""
    model = load_artifact(model_dir)
    s = torch.tensor([src])
    with torch.no_grad():
        logits = model(s, s != 0, torch.tensor([tgt_in]))
    return logits[0].log_softmax(-1).numpy()


def test_encoder_matches_pytorch(model_dir: Path, runner: OnnxRunner) -> None:
    model = load_artifact(model_dir)
    runner.encode([EncodeItem(SOURCES[2], [3])])
    s = torch.tensor([SOURCES[2]])
    with torch.no_grad():
        cross = model.cross_kv(model.encode(s, s != 0))
    for i, (k, v) in enumerate(cross):
        assert np.abs(host(runner.cross_kv[2 * i])[3, :, :7] - k[0].numpy()).max() <= 1e-4
        assert np.abs(host(runner.cross_kv[2 * i + 1])[3, :, :7] - v[0].numpy()).max() <= 1e-4


def test_incremental_equals_full_recomputation(model_dir: Path, runner: OnnxRunner) -> None:
    tgt_in = [2, 40, 41, 42, 43]
    runner.encode([EncodeItem(SOURCES[0], [0])])
    steps = np.stack([runner.step_log_probs([0], [t], [i])[0] for i, t in enumerate(tgt_in)])
    assert np.abs(steps - torch_full_logprobs(model_dir, SOURCES[0], tgt_in)).max() <= 1e-4


def test_rows_at_different_steps_equal_alone(model_dir: Path, runner: OnnxRunner) -> None:
    tgt = [[2, 40, 41, 42, 43, 44], [2, 50, 51]]
    runner.encode([EncodeItem(SOURCES[0], [0]), EncodeItem(SOURCES[1], [5])])
    for i in range(3):  # row 0 runs alone for three steps, then row 1 joins at position 0
        runner.step_log_probs([0], [tgt[0][i]], [i])
    for j in range(3):
        both = runner.step_log_probs([5, 0], [tgt[1][j], tgt[0][3 + j]], [j, 3 + j])
        expected_1 = torch_full_logprobs(model_dir, SOURCES[1], tgt[1][: j + 1])[j]
        expected_0 = torch_full_logprobs(model_dir, SOURCES[0], tgt[0][: 4 + j])[3 + j]
        assert np.abs(both[0] - expected_1).max() <= 1e-4
        assert np.abs(both[1] - expected_0).max() <= 1e-4


def poison(runner: OnnxRunner, slot: int, self_len: int, cross_len: int) -> None:
    """NaN over what a sentence wrote into `slot`: what one whose activations overflowed leaves behind."""
    for caches, length in ((runner.self_kv, self_len), (runner.cross_kv, cross_len)):
        for cache in caches:
            if isinstance(cache, ort.OrtValue):
                values = cache.numpy()
                values[slot, :, :length] = np.nan
                cache.update_inplace(values)
            else:
                cache[slot, :, :length] = np.nan


def test_a_slot_left_with_nan_is_clean_for_its_next_sentence(model_dir: Path) -> None:
    """Masked entries are multiplied by a weight of 0, and 0 x NaN = NaN: a freed slot must be zeroed. The
    captured runner zeroes every slot a new sentence takes, whatever it holds."""
    runner = CapturedRunner(model_dir / "onnx" / "fp32", max_slots=8, intra_op_threads=1)
    long_source, short_source, neighbour = SOURCES[2], SOURCES[1], SOURCES[0]  # 7, 4 and 5 tokens
    runner.encode([EncodeItem(long_source, [0]), EncodeItem(neighbour, [1])])
    for i in range(6):
        runner.step_log_probs([0, 1], [40 + i, 50 + i], [i, i])
    poison(runner, slot=0, self_len=6, cross_len=len(long_source))
    runner.encode([EncodeItem(short_source, [0])])  # a new sentence takes the failed one's slot
    assert_exact_beside_a_row_further_on(model_dir, runner, short_source)


class NaNOutputs:
    """A session whose outputs come back NaN while `on`: what a request whose activations overflow
    gets from the real graphs."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session, self.on = session, False

    def run(self, names: list[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        outputs = self.session.run(names, feeds)
        return [np.full_like(out, np.nan) if self.on and out.dtype.kind == "f" else out for out in outputs]

    def __getattr__(self, name: str) -> object:
        return getattr(self.session, name)


def test_the_working_batch_zeroes_a_slot_only_after_a_nan_went_into_it(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The working batch checks every block it writes into its slot caches: a slot that got a NaN is zeroed for
    its next sentence, which then decodes exactly; a slot that held a healthy sentence is not zeroed (stale
    finite values are masked to exactly 0). Its self-attention rows are zeroed whenever a slot takes one
    (tests/test_working_batch.py), so here the NaN comes from the encoder."""
    runner = WorkingBatchRunner(model_dir / "onnx" / "fp32", max_slots=8, intra_op_threads=1)
    zeroed: list[tuple[str, list[int]]] = []
    real_zero = runner._zero

    def zero(kind: str, slots: np.ndarray, length: int) -> None:
        zeroed.append((kind, slots.tolist()))
        real_zero(kind, slots, length)

    monkeypatch.setattr(runner, "_zero", zero)
    encoder = NaNOutputs(runner.encoder)
    monkeypatch.setattr(runner, "encoder", encoder)
    long_source, short_source, neighbour = SOURCES[2], SOURCES[1], SOURCES[0]  # 7, 4 and 5 tokens
    runner.encode([EncodeItem(neighbour, [1]), EncodeItem(long_source, [2])])
    for i in range(6):
        runner.step_log_probs([1, 2], [50 + i, 40 + i], [i, i])
    runner.encode([EncodeItem(short_source, [2])])  # a healthy sentence's slot: nothing to zero
    assert zeroed == []
    encoder.on = True  # slot 0's sentence overflows: NaN in its cross cache
    runner.encode([EncodeItem(long_source, [0])])
    for i in range(6):
        runner.step_log_probs([0], [40 + i], [i])
    encoder.on = False
    assert runner.non_finite.tolist() == [True] + [False] * 7
    runner.encode([EncodeItem(short_source, [0])])  # a new sentence takes the failed one's slot
    assert zeroed == [("cross", [0])]
    assert_exact_beside_a_row_further_on(model_dir, runner, short_source)


def assert_exact_beside_a_row_further_on(model_dir: Path, runner: OnnxRunner, short_source: list[int]) -> None:
    """Slot 0's new sentence decodes as the reference does beside slot 1 six positions further on, so the
    step reads slot 0 past its own span (masked)."""
    target = [2, 60, 61]
    for j, token in enumerate(target):  # beside a row further on: reads slot 0 past its own span, masked
        both = runner.step_log_probs([0, 1], [token, 56 + j], [j, 6 + j])
        expected = torch_full_logprobs(model_dir, short_source, target[: j + 1])[j]
        assert np.isfinite(both).all()
        assert np.abs(both[0] - expected).max() <= 1e-4


def self_entries(runner: OnnxRunner, slot: int) -> list[np.ndarray]:
    """The self-attention keys/values `slot` holds, (H, tokens fed, Dh) per cache, wherever they live."""
    if isinstance(runner, WorkingBatchRunner):
        row = int(runner.row_of_slot[slot])
        return [array[row, :, : runner.row_len[row]].copy() for array in runner.kv_store]
    return [host(cache)[slot, :, : int(runner.tgt_len[slot])].copy() for cache in runner.self_kv]


def test_copy_slots_is_a_gather(runner: OnnxRunner) -> None:
    runner.encode([EncodeItem(SOURCES[0], [0]), EncodeItem(SOURCES[2], [1])])
    runner.step_log_probs([0, 1], [2, 2], [0, 0])
    before = [self_entries(runner, slot) for slot in (0, 1)]
    cross_before = [host(c).copy() for c in runner.cross_kv]
    runner.copy_slots([0, 1], [1, 0])  # swap: each destination reads the pre-call source
    for slot, was in ((0, before[1]), (1, before[0])):
        for entries, old_entries in zip(self_entries(runner, slot), was, strict=True):
            np.testing.assert_array_equal(entries, old_entries)
    # Different sources: the cross keys/values move too (beam rows of one source share theirs and skip this).
    longer = len(SOURCES[2])
    for cache, old in zip(runner.cross_kv, cross_before, strict=True):
        np.testing.assert_array_equal(host(cache)[0, :, :longer], old[1, :, :longer])
        np.testing.assert_array_equal(host(cache)[1, :, : len(SOURCES[0])], old[0, :, : len(SOURCES[0])])
    assert runner.src_mask[0].sum() == len(SOURCES[2]) and runner.src_mask[1].sum() == len(SOURCES[0])


def test_int8_runs_and_stays_close(model_dir: Path) -> None:
    runner = WorkingBatchRunner(model_dir / "onnx" / "int8", max_slots=2, intra_op_threads=1)
    assert runner.provider == "CPUExecutionProvider" and runner.metadata.variant == "int8"
    runner.encode([EncodeItem(SOURCES[0], [0])])
    logp = runner.step_log_probs([0], [2], [0])
    assert logp.shape == (1, runner.spec.vocab_size) and np.isfinite(logp).all()
    reference = torch_full_logprobs(model_dir, SOURCES[0], [2])[:1]
    assert np.abs(logp - reference).max() < 0.2  # this CPU's recipe (tests/test_export.py checks it step by step)


def test_the_captured_runner_refuses_an_export_without_kv_graphs_naming_the_command(
    model_dir: Path, tmp_path: Path
) -> None:
    variant = tmp_path / "onnx" / "fp32"
    shutil.copytree(model_dir / "onnx" / "fp32", variant)
    (variant / "kv_move.onnx").unlink()
    with pytest.raises(MetadataError, match=r"no kv_move\.onnx .*export again with python -m export --capturable-fp32"):
        CapturedRunner(variant, 2)
    WorkingBatchRunner(variant, 2, intra_op_threads=1)  # the working batch does not need them


def test_open_runner_places_caches(model_dir: Path) -> None:
    for gone in ("gpu", "host", "device", "static"):
        with pytest.raises(ValueError, match="unknown kv_cache"):
            open_runner(Path("/nonexistent"), 2, kv_cache=gone)
    variant = model_dir / "onnx" / "fp32"
    assert type(open_runner(variant, 2, kv_cache="auto", intra_op_threads=1)) is WorkingBatchRunner
    assert type(open_runner(variant, 2, kv_cache="working", intra_op_threads=1)) is WorkingBatchRunner
    with pytest.raises(MetadataError, match=r"--kv-cache fused is the CUDA path.*--kv-cache working or auto"):
        open_runner(variant, 2, kv_cache="fused", intra_op_threads=1)


def test_auto_places_caches_on_cuda_only_where_they_can_be_captured(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On CUDA the fused captured step where the variant can take it; the working batch, with a warning saying
    why, everywhere else."""
    variant = model_dir / "onnx" / "fp32"
    assert (variant / FUSED_DECODER_FILE).is_file()
    assert auto_cache_place(variant, "cpu") == "working"
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    # float32: onnxruntime's CUDA GroupQueryAttention takes float16 only, so its step cannot be captured there
    assert auto_cache_place(variant, "cuda") == "working"
    assert "takes a float16 variant: fp32 is float32" in caplog.text
    with pytest.raises(MetadataError, match=r"takes a float16 variant: fp32 is float32.*--variant fp16"):
        open_runner(variant, 2, "cuda", kv_cache="fused")
    half = tmp_path / "fp16"  # the metadata of a float16 variant over the same files
    shutil.copytree(variant, half)
    metadata = json.loads((half / METADATA_FILE).read_text())
    (half / METADATA_FILE).write_text(json.dumps({**metadata, "dtype": "float16", "variant": "fp16"}))
    assert auto_cache_place(half, "cuda") == "fused"
    (half / FUSED_ENCODER_FILE).unlink()
    caplog.clear()
    assert auto_cache_place(half, "cuda") == "working"  # an export without the whole fused build
    assert f"the export has no {FUSED_ENCODER_FILE}" in caplog.text
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert auto_cache_place(variant, "cuda") == "working"
    assert "no CUDA provider" in caplog.text


@pytest.mark.parametrize("spin", [True, False])
def test_spin_setting_reaches_every_session(model_dir: Path, spin: bool) -> None:
    working = WorkingBatchRunner(model_dir / "onnx" / "fp32", 2, intra_op_threads=1, spin_threads=spin)
    captured = CapturedRunner(model_dir / "onnx" / "fp32", 2, intra_op_threads=1, spin_threads=spin)
    sessions = [working.encoder, working.decoder, captured.encoder, captured.decoder]
    sessions += [captured.caches.kv_move, captured.caches.kv_write]
    for session in sessions:
        entry = session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
        assert entry == ("1" if spin else "0")


def test_cuda_sessions_compute_float32_without_tf32(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TF32 (onnxruntime's CUDA default) moves fp32 log-probs by ~4e-3, beyond parity: a CUDA session turns
    it off, and keeps the CPU provider behind it. A CPU session leaves out the fusions that run slower there."""
    asked: dict[str, object] = {}

    def capture(
        path: str, sess_options: ort.SessionOptions, providers: list[object], disabled_optimizers: list[str]
    ) -> None:
        asked["providers"], asked["disabled"] = providers, disabled_optimizers

    monkeypatch.setattr(ort, "InferenceSession", capture)
    make_session(model_dir / "onnx" / "fp32" / "encoder.onnx", "cuda", 1)
    assert asked == {
        "providers": [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"],
        "disabled": [],
    }
    make_session(model_dir / "onnx" / "fp32" / "encoder.onnx", "cpu", 1)
    assert asked == {"providers": ["CPUExecutionProvider"], "disabled": ["SkipLayerNormFusion"]}


def test_the_graph_ranks_candidates_as_the_reference_does(runner: OnnxRunner) -> None:
    """The decoder's TopK equals `row_candidates` on its own log-probabilities, for mixed k and row scores.

    A step is idempotent (it rewrites the same cache entry), so both outputs come from one runner. The captured
    step ranks at most its graph's fixed number of candidates.
    """
    widest = runner.graph_k if isinstance(runner, CapturedRunner) else runner.spec.vocab_size + 5
    runner.encode([EncodeItem(SOURCES[0], [0, 1]), EncodeItem(SOURCES[1], [2])])
    row_scores = [0.0, -1.25, -3.5]
    for position, token in enumerate([2, 40, 41]):
        args = ([0, 1, 2], [token, token + 1, token + 2], [position] * 3)
        log_probs = runner.step_log_probs(*args)
        for k in (1, 8, widest):
            ranked = runner.step(*args, row_scores, k)
            scores, ids = row_candidates(log_probs, np.asarray(row_scores, dtype=np.float32), k)
            np.testing.assert_array_equal(ranked.ids, ids)
            np.testing.assert_array_equal(ranked.scores, scores)  # the same float32 add, bit for bit


def test_an_export_without_candidate_ranking_is_refused_with_the_fix(model_dir: Path, tmp_path: Path) -> None:
    variant = tmp_path / "fp32"
    shutil.copytree(model_dir / "onnx" / "fp32", variant)
    graph_path = variant / "decoder_step.onnx"
    model = onnx.load(str(graph_path))
    graph = model.graph
    ranking = ((graph.input, "row_scores bias_ids bias_values top_k"), (graph.output, "top_scores top_ids bias_scores"))
    for field, keep in ranking:
        for value in [v for v in field if v.name in keep.split()]:
            field.remove(value)
    for node in [n for n in graph.node if n.name.startswith("/ranking/")]:
        graph.node.remove(node)
    onnx.save(model, str(graph_path))
    with pytest.raises(MetadataError, match="export again with python -m export"):
        WorkingBatchRunner(variant, 2, intra_op_threads=1)
