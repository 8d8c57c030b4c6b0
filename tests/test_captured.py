"""The fused capturable decoder step (decoder_step_fused.onnx), the fused encoder and the runner that steps them
(`--kv-cache fused`), on the CPU provider: the graphs' shape contract, step-for-step log-probabilities and whole
greedy and beam-4 decodes against the working batch, in fp32 (`python -m export --capturable-fp32`) and fp16.
CUDA capture itself is measured by `python -m bench.gpu_check` (its static step)."""

from __future__ import annotations

import random
import re
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest

from bench import engines, static_parity
from bench.engines import EngineSettings
from export.__main__ import main as export_main
from export.builder.fused_step import HOST_READ_OPS, check_capturable
from model.directory import (
    DECODER_FILE,
    ENCODER_FILE,
    FUSED_DECODER_FILE,
    FUSED_ENCODER_FILE,
    KV_MOVE_FILE,
    KV_WRITE_FILE,
    MAX_BIAS_PER_ROW,
    STATIC_TOP_K,
    MetadataError,
    read_metadata,
)
from server.backend.captured import CapturedRunner, buckets
from server.backend.runtime import make_session
from server.backend.working_batch import WorkingBatchRunner
from server.core.batch import Batch
from server.core.events import EngineLimits
from server.core.offline import translate_ids
from server.core.runner import Candidates, EncodeItem
from server.core.scheduler import Scheduler
from server.core.work import DecodeOptions
from server.edge.config import EnginesConfig
from server.edge.loading import LoadedModel, describe_model
from server.text.documents import RequestLimits
from server.text.splitter import join, split
from tests.serving import request, running_server, server_config, status_of
from tests.tiny import TINY_CONFIG, TINY_PAIRS, build_tiny_artifact

SERVED_SLOTS = 6  # two beams of 3 at once: sentences join a running batch as slots free
SOURCES = [[4, 10, 11, 12, 3], [5, 20, 21, 3], [4, 30, 31, 32, 33, 34, 3], [6, 7, 8, 9, 13, 14, 15, 16, 17, 3]]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its fp32 and fp16 graphs."""
    out = tmp_path_factory.mktemp("static") / "model"
    shutil.copytree(tiny_model_dir, out)
    assert export_main(["--model-dir", str(out), "--variants", "fp32,fp16", "--capturable-fp32"]) == 0
    return out


@pytest.fixture(scope="module")
def narrow_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of head_dim 4 (d_model 16 over 4 heads), a size GroupQueryAttention does not take: exported
    as the capturable graphs are asked for, it has none."""
    out = build_tiny_artifact(tmp_path_factory.mktemp("narrow") / "model", config=replace(TINY_CONFIG, d_model=16))
    assert export_main(["--model-dir", str(out), "--variants", "fp32,fp16", "--capturable-fp32"]) == 0
    assert read_metadata(out / "onnx" / "fp16").head_dim == 4
    return out


def graph_of(model: Path, variant: str, name: str = FUSED_DECODER_FILE) -> onnx.ModelProto:
    return onnx.load(str(model / "onnx" / variant / name))


def captured_model(model_dir: Path, max_slots: int) -> LoadedModel:
    """The tiny model's fp32 graphs served in this process by the captured runner on the CPU provider, which
    `--kv-cache fused` refuses there (it is the CUDA path): opened by class, as the tests of its arithmetic do."""
    runner = CapturedRunner(model_dir / "onnx" / "fp32", max_slots, intra_op_threads=1)
    return describe_model(model_dir, model_dir.name, "", "fp32", runner)


def dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


@pytest.mark.parametrize("variant", ["fp32", "fp16"])
def test_the_graph_has_static_buffers_and_reads_nothing_on_the_host(model: Path, variant: str) -> None:
    graph = graph_of(model, variant).graph
    meta = read_metadata(model / "onnx" / variant)
    inputs, outputs = {v.name: dims(v) for v in graph.input}, {v.name: dims(v) for v in graph.output}
    buffer = ["B", meta.n_heads, meta.max_target_len, meta.head_dim]
    for i in range(meta.n_decoder_layers):
        for kind in "kv":
            assert inputs[f"past_{kind}_{i}"] == outputs[f"present_{kind}_{i}"] == buffer
            assert inputs[f"cross_{kind}_{i}"] == ["B", meta.n_heads, "S", meta.head_dim]
    assert inputs["tokens"] == inputs["positions"] == inputs["row_scores"] == ["B"]
    assert inputs["bias_ids"] == inputs["bias_values"] == outputs["bias_scores"] == ["B", MAX_BIAS_PER_ROW]
    assert inputs["src_mask"] == ["B", "S"] and "top_k" not in inputs and "past_keep" not in inputs
    assert outputs["top_ids"] == outputs["top_scores"] == ["B", min(STATIC_TOP_K, meta.vocab_size)]
    ops = [node.op_type for node in graph.node]
    assert ops.count("GroupQueryAttention") == meta.n_decoder_layers
    assert not set(ops) & HOST_READ_OPS
    # every residual and norm, and the cross-attention, one op each
    assert ops.count("SkipLayerNormalization") == 3 * meta.n_decoder_layers
    assert ops.count("MultiHeadAttention") == meta.n_decoder_layers


@pytest.mark.parametrize("variant", ["fp32", "fp16"])
def test_the_fused_encoder_keeps_the_encoders_contract_in_fewer_kernels(model: Path, variant: str) -> None:
    plain, fused = (graph_of(model, variant, name).graph for name in (ENCODER_FILE, FUSED_ENCODER_FILE))
    for kind in ("input", "output"):
        signature = [{v.name: dims(v) for v in getattr(graph, kind)} for graph in (plain, fused)]
        assert signature[0] == signature[1], kind
    layers = int(read_metadata(model / "onnx" / variant).model_config["n_encoder_layers"])
    ops = [node.op_type for node in fused.node]
    assert ops.count("MultiHeadAttention") == layers  # one per layer, and the cross K/V of all in one MatMul:
    assert ops.count("MatMul") == 4 * layers + 1  # qkv, out, w1, w2 per layer
    assert len(ops) < 0.7 * len(plain.node)


def test_a_graph_that_reads_shapes_on_the_host_is_refused(model: Path) -> None:
    ordinary = onnx.load(str(model / "onnx" / "fp32" / "decoder_step.onnx"))  # its own-step mask reads a Shape
    with pytest.raises(RuntimeError, match="not capturable: it contains Shape"):
        check_capturable(ordinary, "decoder_step.onnx")


def test_buckets_double_up_to_the_pool() -> None:
    assert buckets(256) == [8, 16, 32, 64, 128, 256]
    assert buckets(20) == [8, 16, 20]
    assert buckets(5) == [5]


@pytest.mark.parametrize(("variant", "tolerance"), [("fp32", 1e-5), ("fp16", 2e-2)])
def test_step_for_step_equal_to_the_working_batch(model: Path, variant: str, tolerance: float) -> None:
    """Rows at different positions, beam copies across sources, a slot re-encoded, steps in two buckets, and
    the warm-up's capture runs repeated before some steps (on CPU they run every bucket uncaptured)."""
    path = model / "onnx" / variant
    working, captured = WorkingBatchRunner(path, 12, intra_op_threads=1), CapturedRunner(path, 12, intra_op_threads=1)
    assert captured.buckets == [8, 12]
    rng = np.random.default_rng(0)
    position = dict.fromkeys(range(12), 0)

    def encode(slots: list[int], source: int) -> None:
        for r in (working, captured):
            r.encode([EncodeItem(SOURCES[source], slots)])
        position.update(dict.fromkeys(slots, 0))

    encode([0, 1, 2], 0)
    encode([3], 2)
    live = [0, 1, 2, 3]
    for step in range(14):
        if step == 3:
            encode([9, 10], 3)  # rows past the first bucket: the step takes the larger one
            live += [9, 10]
        if step == 6:
            live = [0, 1, 2, 3]
        if step == 8:
            encode([3], 1)
        tokens = [int(t) for t in rng.integers(4, 60, len(live))]
        positions = [position[s] for s in live]
        captured._captured = step % 3 != 0  # the capture runs (every bucket, this step's inputs) change nothing
        got, expected = (r.step_log_probs(live, tokens, positions) for r in (captured, working))
        np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance)
        assert np.array_equal(got.argmax(axis=1), expected.argmax(axis=1))
        for s in live:
            position[s] += 1
        if step % 2:
            parents = [int(p) for p in rng.choice([0, 1, 2, 3], size=3)]
            for r in (working, captured):
                r.copy_slots(parents, [0, 1, 2])
            position.update({d: position[p] for p, d in zip(parents, [0, 1, 2], strict=True)})


@pytest.mark.parametrize("variant", ["fp32", "fp16"])
@pytest.mark.parametrize("beam", [1, 4])
def test_whole_decodes_equal_the_working_batch(model: Path, variant: str, beam: int) -> None:
    """Few slots for many sentences, so rows join and leave at different lengths: identical ids."""
    sources = [[*SOURCES[i % 4][:-1], 7 + i % 5, 3] for i in range(16)]
    path = model / "onnx" / variant
    working = WorkingBatchRunner(path, 2 * beam + 1, intra_op_threads=1)
    captured = CapturedRunner(path, 2 * beam + 1, intra_op_threads=1)
    expected = translate_ids(working, sources, beam, 1.0, 24)
    got = translate_ids(captured, sources, beam, 1.0, 24)
    assert [[h.tokens for h in hyps] for hyps in got] == [[h.tokens for h in hyps] for hyps in expected]
    tolerance = 1e-4 if variant == "fp32" else 5e-2
    for mine, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose([h.score for h in mine], [h.score for h in theirs], rtol=0, atol=tolerance)


def test_more_candidates_than_the_graph_ranks_are_refused(model: Path) -> None:
    captured = CapturedRunner(model / "onnx" / "fp32", 2, intra_op_threads=1)
    captured.encode([EncodeItem(SOURCES[0], [0])])
    with pytest.raises(ValueError, match=f"ranks {captured.graph_k} candidates per row"):
        captured.step([0], [1], [0], [0.0], captured.graph_k + 1)


def test_a_beam_wider_than_the_captured_step_ranks_for_is_refused_naming_the_caches_that_take_it(model: Path) -> None:
    """A beam of K ranks 2K candidates per row; the captured step ranks STATIC_TOP_K. Offline callers may ask
    for any beam their slots hold: a wider one is refused with the limit and the caches that decode it."""
    runner = CapturedRunner(model / "onnx" / "fp32", 24, intra_op_threads=1)
    widest = STATIC_TOP_K // 2
    refusal = rf"beams up to {widest} .*--kv-cache working"
    with pytest.raises(ValueError, match=refusal):
        translate_ids(runner, SOURCES[:2], widest + 1, 1.0, 4)
    assert len(translate_ids(runner, SOURCES[:2], widest, 1.0, 4)) == 2  # the widest it ranks for decodes


def test_the_served_beam_limit_fits_the_captured_step(tiny_exported_dir: Path) -> None:
    """The edge refuses a beam over the documented limit before anything reaches the runner; that limit is
    what the captured step ranks for, so the widest served beam decodes there."""
    assert 2 * RequestLimits().max_beam_size <= STATIC_TOP_K
    slots = 2 * RequestLimits().max_beam_size  # more slots than the widest beam: the beam limit, not the slots'
    model = captured_model(tiny_exported_dir, slots)
    with running_server(model, server_config(engines=EnginesConfig(max_slots=slots))) as running:
        widest = RequestLimits().max_beam_size
        message = request(["Das Haus ist groß."], beam_size=widest, max_output_len=6)
        assert running.stub.Translate(message, timeout=60).results[0].sentences == 1
        wider = request(["Das Haus ist groß."], beam_size=widest + 1, max_output_len=6)
        status = status_of(lambda: running.stub.Translate(wider, timeout=60))
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"beam_size must be in 1..{widest}" in status.details


def test_the_captured_runner_never_opens_the_dynamic_graphs(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Their weights would take device memory for nothing: the captured runner opens the fused graphs alone."""
    from server.backend import runtime

    opened: list[str] = []

    def recording(path: Path, *args: object, **kwargs: object) -> object:
        opened.append(path.name)
        return make_session(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runtime, "make_session", recording)
    captured = CapturedRunner(model / "onnx" / "fp32", 8, intra_op_threads=1)
    assert FUSED_DECODER_FILE in opened and FUSED_ENCODER_FILE in opened, opened
    assert DECODER_FILE not in opened and ENCODER_FILE not in opened, opened
    captured.encode([EncodeItem(SOURCES[0], [0])])
    assert captured.step([0], [1], [0], [0.0], 4).ids.shape == (1, 4)


def test_a_variant_without_the_fused_graphs_is_refused_with_the_fix(tiny_exported_dir: Path) -> None:
    with pytest.raises(MetadataError, match=f"no {FUSED_ENCODER_FILE} .*python -m export"):
        CapturedRunner(tiny_exported_dir / "onnx" / "int8", 2, intra_op_threads=1)


@pytest.mark.parametrize("provider", ["cpu", "cuda"])
@pytest.mark.parametrize("variant", ["fp32", "fp16"])
def test_a_head_size_the_attention_kernel_does_not_take_is_refused_with_the_caches_that_serve_it(
    narrow_heads: Path, variant: str, provider: str
) -> None:
    """No export builds the capturable step at head_dim 4: the refusal says why and what serves the model, not
    to export again, on CUDA too (checked before any session opens, so no GPU is needed here)."""
    with pytest.raises(MetadataError) as refused:
        CapturedRunner(narrow_heads / "onnx" / variant, 2, provider, intra_op_threads=1)
    message = str(refused.value)
    assert "no capturable decoder step" in message and "head_dim 4 is not a multiple of 8" in message, message
    assert "serve with --kv-cache working" in message, message
    assert "python -m export" not in message and "float16" not in message, message


def test_the_parity_command_skips_a_model_without_a_capturable_step(
    narrow_heads: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert static_parity.main(["--model-dir", str(narrow_heads), "--limit", "2", "--slots", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("skipped, head size 4 has no capturable step") == 2 and "static parity: PASS" in printed


def test_float32_builds_the_capturable_graphs_only_when_asked(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Each capturable or fused graph is another copy of the weights, and CUDA captures float16 only: a default
    export builds them for fp16 alone (docs/decisions.md gives what that saves at opus-mt's size)."""
    out = shutil.copytree(tiny_model_dir, tmp_path / "model")
    assert export_main(["--model-dir", str(out), "--variants", "fp32,fp16"]) == 0
    capturable = {FUSED_DECODER_FILE, FUSED_ENCODER_FILE, KV_MOVE_FILE, KV_WRITE_FILE}
    assert capturable <= {p.name for p in (out / "onnx" / "fp16").iterdir()}
    assert not capturable & {p.name for p in (out / "onnx" / "fp32").iterdir()}
    with pytest.raises(MetadataError, match="export again with python -m export --capturable-fp32"):
        CapturedRunner(out / "onnx" / "fp32", 2, intra_op_threads=1)


def test_the_benchmark_arm_reproduces_its_uncaptured_twin(model: Path, tiny_exported_dir: Path) -> None:
    """bench.run's `onnx-fp16-fused` engine (CUDA only there) against `onnx-fp16`, here on CPU."""
    settings = EngineSettings(model, "cpu", threads=1, max_len=12, max_batch=3)
    sources = [[*SOURCES[i % 4][:-1], 7 + i, 3] for i in range(10)]
    for beam in (1, 4):
        captured = engines.create("onnx-fp16-fused", settings).translate(sources, beam)
        assert captured == engines.create(engines.UNCAPTURED["onnx-fp16-fused"], settings).translate(sources, beam)
    with pytest.raises(engines.Unavailable, match="no capturable decoder step"):
        engines.OnnxEngine(replace(settings, model_dir=tiny_exported_dir), "int8", kv_cache="fused")


def test_the_prepared_parity_command_passes_on_cpu(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m bench.static_parity`, the step bench.gpu_check runs on CUDA, here on the CPU provider."""
    assert static_parity.main(["--model-dir", str(model), "--limit", "20", "--slots", "5", "--max-len", "10"]) == 0
    printed = capsys.readouterr().out
    lines = re.findall(r"(fp\d+) (fused) beam \d: identical token ids (\d+)/(\d+)", printed)
    assert len(lines) == 4  # fp32, fp16 x greedy, beam 4
    for variant, _, same, total in lines:
        exact = variant == "fp32"
        assert int(same) == int(total) > 0 if exact else int(same) >= static_parity.FUSED_FP16_AGREEMENT * int(total)
    assert "static parity: PASS" in printed


def test_served_answers_equal_the_working_batch(tiny_exported_dir: Path) -> None:
    """The captured runner served over gRPC (warm-up, then three clients at once, greedy and beam 3, both
    directions, sentences joining a running batch) answers what the working batch decodes offline."""
    model = captured_model(tiny_exported_dir, SERVED_SLOTS)
    answers: dict[tuple[str, str, str, int], set[str]] = {}
    lock = threading.Lock()
    with running_server(model, server_config(engines=EnginesConfig(max_slots=SERVED_SLOTS, max_queue=512))) as running:

        def client(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(4):
                side, beam = rng.randint(0, 1), rng.choice([1, 3])
                source, target = ("de", "en") if side == 0 else ("en", "de")
                texts = [rng.choice(TINY_PAIRS)[side] for _ in range(3)]
                message = request(texts, source, target, beam_size=beam, length_penalty=1.0, max_output_len=20)
                for result in running.stub.Translate(message, timeout=120).results:
                    with lock:
                        answers.setdefault((texts[result.index], source, target, beam), set()).add(result.translation)

        threads = [threading.Thread(target=client, args=(seed,)) for seed in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    working = WorkingBatchRunner(tiny_exported_dir / "onnx" / "fp32", SERVED_SLOTS, intra_op_threads=1)
    tokenizer = model.tokenizer
    assert len(answers) >= 8, "too few distinct texts were asked"
    for (text, source, target, beam), got in answers.items():
        parts = split(text, source)
        ids = [tokenizer.encode_source(piece, target) for piece in parts.pieces]
        best = [hyps[0].tokens for hyps in translate_ids(working, ids, beam, 1.0, 20)]
        assert got == {join([tokenizer.decode(list(t)) for t in best], parts.separators)}, (text, beam)


def test_the_scheduler_hands_out_the_lowest_free_slots(model: Path) -> None:
    """Freed slots are reused lowest first, so the rows in use stay in the smallest bucket that holds them."""
    spec = read_metadata(model / "onnx" / "fp32").spec()
    scheduler = Scheduler(spec, EngineLimits(max_slots=6))
    for request_id, length in enumerate((1, 3, 2)):  # greedy sentences that stop after 1, 3 and 2 tokens
        scheduler.add(request_id, [SOURCES[0]], DecodeOptions(beam_size=1, max_output_len=length), None, now=0.0)

    def step() -> Batch:
        batch = scheduler.schedule(now=0.0)
        rows, k = batch.candidate_shape(spec.vocab_size)
        never_eos = Candidates(np.zeros((rows, k), np.float32), np.full((rows, k), spec.eos_id + 1, np.int64))
        scheduler.update(batch, never_eos)
        return batch

    assert [item.slots for item in step().encode] == [[0], [1], [2]]
    step()  # slot 0 was freed after the first step, slot 2 after this one
    scheduler.add(3, [SOURCES[1]], DecodeOptions(beam_size=1, max_output_len=4), None, now=0.0)
    assert [item.slots for item in step().encode] == [[0]]
