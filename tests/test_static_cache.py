"""The capturable decoder step (decoder_step_static.onnx) and the runner that steps it (`--kv-cache static`),
on the CPU provider: the graph's shape contract, step-for-step log-probabilities and whole greedy and beam-4
decodes against the slot cache and the working batch, in fp32 and fp16. CUDA capture itself is measured by
`python -m bench.gpu_check` (its static arm)."""

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
import onnxruntime
import pytest

from bench import engines, static_parity
from bench.engines import EngineSettings
from bench.run import QUICK, bench_served_cache, load_workload
from export.__main__ import main as export_main
from export.builder.static_step import HOST_READ_OPS, check_capturable
from model.directory import (
    DECODER_FILE,
    ENCODER_FILE,
    FUSED_DECODER_FILE,
    FUSED_ENCODER_FILE,
    MAX_BIAS_PER_ROW,
    STATIC_DECODER_FILE,
    STATIC_TOP_K,
    MetadataError,
    read_metadata,
)
from server.backend.runners import auto_cache_place, open_runner
from server.backend.runtime import PROVIDERS, OnnxRunner, make_session
from server.backend.static_cache import FusedStaticRunner, StaticCacheRunner, buckets
from server.core.batch import Batch
from server.core.events import EngineLimits
from server.core.offline import translate_ids
from server.core.runner import Candidates, EncodeItem
from server.core.scheduler import Scheduler
from server.core.work import DecodeOptions
from server.text.documents import RequestLimits
from server.text.splitter import join, split
from tests.serving import onnx_model, request, runner_of, running_server, server_config, status_of
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


def static_graph(model: Path, variant: str, name: str = STATIC_DECODER_FILE) -> onnx.ModelProto:
    return onnx.load(str(model / "onnx" / variant / name))


def dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


@pytest.mark.parametrize("name", [STATIC_DECODER_FILE, FUSED_DECODER_FILE])
@pytest.mark.parametrize("variant", ["fp32", "fp16"])
def test_the_graph_has_static_buffers_and_reads_nothing_on_the_host(model: Path, variant: str, name: str) -> None:
    graph = static_graph(model, variant, name).graph
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
    if name == FUSED_DECODER_FILE:  # every residual and norm, and the cross-attention, one op each
        assert ops.count("SkipLayerNormalization") == 3 * meta.n_decoder_layers
        assert ops.count("MultiHeadAttention") == meta.n_decoder_layers
        assert len(ops) < len([n for n in static_graph(model, variant).graph.node]) * 0.7


@pytest.mark.parametrize("variant", ["fp32", "fp16"])
def test_the_fused_encoder_keeps_the_encoders_contract_in_fewer_kernels(model: Path, variant: str) -> None:
    plain, fused = (static_graph(model, variant, name).graph for name in (ENCODER_FILE, FUSED_ENCODER_FILE))
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


@pytest.mark.parametrize("runner_class", [StaticCacheRunner, FusedStaticRunner], ids=["static", "fused"])
@pytest.mark.parametrize(("variant", "tolerance"), [("fp32", 1e-5), ("fp16", 2e-2)])
def test_step_for_step_equal_to_the_slot_cache(
    model: Path, variant: str, tolerance: float, runner_class: type[StaticCacheRunner]
) -> None:
    """Rows at different positions, beam copies across sources, a slot re-encoded, steps in two buckets, and
    the warm-up's capture runs repeated before some steps (on CPU they run every bucket uncaptured)."""
    path = model / "onnx" / variant
    slot, static = OnnxRunner(path, 12, intra_op_threads=1), runner_class(path, 12, intra_op_threads=1)
    assert static.buckets == [8, 12]
    rng = np.random.default_rng(0)
    position = dict.fromkeys(range(12), 0)

    def encode(slots: list[int], source: int) -> None:
        for r in (slot, static):
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
        static._captured = step % 3 != 0  # the capture runs (every bucket, this step's inputs) change nothing
        got, expected = (r.step_log_probs(live, tokens, positions) for r in (static, slot))
        np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance)
        assert np.array_equal(got.argmax(axis=1), expected.argmax(axis=1))
        for s in live:
            position[s] += 1
        if step % 2:
            parents = [int(p) for p in rng.choice([0, 1, 2, 3], size=3)]
            for r in (slot, static):
                r.copy_slots(parents, [0, 1, 2])
            position.update({d: position[p] for p, d in zip(parents, [0, 1, 2], strict=True)})


@pytest.mark.parametrize("kv_cache", ["static", "fused"])
@pytest.mark.parametrize("variant", ["fp32", "fp16"])
@pytest.mark.parametrize("beam", [1, 4])
def test_whole_decodes_equal_the_working_batch(model: Path, variant: str, beam: int, kv_cache: str) -> None:
    """Few slots for many sentences, so rows join and leave at different lengths: identical ids."""
    sources = [[*SOURCES[i % 4][:-1], 7 + i % 5, 3] for i in range(16)]
    path = model / "onnx" / variant
    working = open_runner(path, 2 * beam + 1, kv_cache="working", intra_op_threads=1)
    static = open_runner(path, 2 * beam + 1, kv_cache=kv_cache, intra_op_threads=1)
    assert isinstance(static, StaticCacheRunner) and static.kv_cache == kv_cache
    expected = translate_ids(working, sources, beam, 1.0, 24)
    got = translate_ids(static, sources, beam, 1.0, 24)
    assert [[h.tokens for h in hyps] for hyps in got] == [[h.tokens for h in hyps] for hyps in expected]
    tolerance = 1e-4 if variant == "fp32" else 5e-2
    for mine, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose([h.score for h in mine], [h.score for h in theirs], rtol=0, atol=tolerance)


def test_more_candidates_than_the_graph_ranks_are_refused(model: Path) -> None:
    static = StaticCacheRunner(model / "onnx" / "fp32", 2, intra_op_threads=1)
    static.encode([EncodeItem(SOURCES[0], [0])])
    with pytest.raises(ValueError, match=f"ranks {static.graph_k} candidates per row"):
        static.step([0], [1], [0], [0.0], static.graph_k + 1)


@pytest.mark.parametrize("kv_cache", ["static", "fused"])
def test_a_beam_wider_than_the_captured_step_ranks_for_is_refused_naming_the_caches_that_take_it(
    model: Path, kv_cache: str
) -> None:
    """A beam of K ranks 2K candidates per row; the captured step ranks STATIC_TOP_K. Offline callers may ask
    for any beam their slots hold: a wider one is refused with the limit and the caches that decode it."""
    runner = open_runner(model / "onnx" / "fp32", 24, kv_cache=kv_cache, intra_op_threads=1)
    widest = STATIC_TOP_K // 2
    refusal = rf"beams up to {widest} .*--kv-cache device, working or host"
    with pytest.raises(ValueError, match=refusal):
        translate_ids(runner, SOURCES[:2], widest + 1, 1.0, 4)
    assert len(translate_ids(runner, SOURCES[:2], widest, 1.0, 4)) == 2  # the widest it ranks for decodes


def test_the_served_beam_limit_fits_the_captured_step(tiny_exported_dir: Path) -> None:
    """The edge refuses a beam over the documented limit before anything reaches the runner; that limit is
    what the captured step ranks for, so the widest served beam decodes there."""
    assert 2 * RequestLimits().max_beam_size <= STATIC_TOP_K
    slots = 2 * RequestLimits().max_beam_size  # more slots than the widest beam: the beam limit, not the slots'
    model = onnx_model(tiny_exported_dir, max_slots=slots, kv_cache="static")
    assert isinstance(runner_of(model), StaticCacheRunner)
    with running_server(model, server_config(max_slots=slots)) as running:
        widest = RequestLimits().max_beam_size
        message = request(["Das Haus ist groß."], beam_size=widest, max_output_len=6)
        assert running.stub.Translate(message, timeout=60).results[0].sentences == 1
        wider = request(["Das Haus ist groß."], beam_size=widest + 1, max_output_len=6)
        status = status_of(lambda: running.stub.Translate(wider, timeout=60))
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"beam_size must be in 1..{widest}" in status.details


def test_the_static_runner_never_opens_the_dynamic_step(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its weights would take device memory for nothing: the static runner steps decoder_step_static alone."""
    from server.backend import runtime

    opened: list[str] = []

    def recording(path: Path, *args: object, **kwargs: object) -> object:
        opened.append(path.name)
        return make_session(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runtime, "make_session", recording)
    static = StaticCacheRunner(model / "onnx" / "fp32", 8, intra_op_threads=1)
    assert STATIC_DECODER_FILE in opened and DECODER_FILE not in opened, opened
    static.encode([EncodeItem(SOURCES[0], [0])])
    assert static.step([0], [1], [0], [0.0], 4).ids.shape == (1, 4)


def test_a_variant_without_the_static_step_is_refused_with_the_fix(tiny_exported_dir: Path) -> None:
    with pytest.raises(MetadataError, match=f"no {STATIC_DECODER_FILE} .*python -m export"):
        open_runner(tiny_exported_dir / "onnx" / "int8", 2, kv_cache="static", intra_op_threads=1)


@pytest.mark.parametrize("provider", ["cpu", "cuda"])
@pytest.mark.parametrize("kv_cache", ["static", "fused"])
@pytest.mark.parametrize("variant", ["fp32", "fp16"])
def test_a_head_size_the_attention_kernel_does_not_take_is_refused_with_the_caches_that_serve_it(
    narrow_heads: Path, variant: str, kv_cache: str, provider: str
) -> None:
    """No export builds the capturable step at head_dim 4: the refusal says why and what serves the model, not
    to export again, on CUDA too (checked before any session opens, so no GPU is needed here)."""
    with pytest.raises(MetadataError) as refused:
        open_runner(narrow_heads / "onnx" / variant, 2, provider, kv_cache=kv_cache, intra_op_threads=1)
    message = str(refused.value)
    assert "no capturable decoder step" in message and "head_dim 4 is not a multiple of 8" in message, message
    assert "use --kv-cache device or --kv-cache working" in message, message
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
    capturable = {STATIC_DECODER_FILE, FUSED_DECODER_FILE, FUSED_ENCODER_FILE}
    assert capturable <= {p.name for p in (out / "onnx" / "fp16").iterdir()}
    assert not capturable & {p.name for p in (out / "onnx" / "fp32").iterdir()}
    for kv_cache in ("static", "fused"):
        with pytest.raises(MetadataError, match="export again with python -m export --capturable-fp32"):
            open_runner(out / "onnx" / "fp32", 2, kv_cache=kv_cache, intra_op_threads=1)


def test_the_benchmark_arm_reproduces_its_uncaptured_twin(model: Path, tiny_exported_dir: Path) -> None:
    """bench.run's `onnx-fp16-static` and `onnx-fp16-fused` engines (CUDA only there) against `onnx-fp16`, here
    on CPU."""
    settings = EngineSettings(model, "cpu", threads=1, max_len=12, max_batch=3)
    sources = [[*SOURCES[i % 4][:-1], 7 + i, 3] for i in range(10)]
    for name in ("onnx-fp16-static", "onnx-fp16-fused"):
        for beam in (1, 4):
            captured = engines.create(name, settings).translate(sources, beam)
            assert captured == engines.create(engines.UNCAPTURED[name], settings).translate(sources, beam)
    with pytest.raises(engines.Unavailable, match="no capturable decoder step"):
        engines.OnnxEngine(replace(settings, model_dir=tiny_exported_dir), "int8", kv_cache="static")


def test_the_prepared_parity_command_passes_on_cpu(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m bench.static_parity`, the step bench.gpu_check runs on CUDA, here on the CPU provider."""
    assert static_parity.main(["--model-dir", str(model), "--limit", "20", "--slots", "5", "--max-len", "10"]) == 0
    printed = capsys.readouterr().out
    lines = re.findall(r"(fp\d+) (static|fused) beam \d: identical token ids (\d+)/(\d+)", printed)
    assert len(lines) == 8  # fp32, fp16 x plain, fused x greedy, beam 4
    for variant, build, same, total in lines:
        exact = (variant, build) != ("fp16", "fused")
        assert int(same) == int(total) > 0 if exact else int(same) >= static_parity.FUSED_FP16_AGREEMENT * int(total)
    assert "static parity: PASS" in printed


def test_the_parity_reference_is_the_uncaptured_step_whatever_the_provider(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA `--kv-cache auto` opens a captured step (the fused build, where the export has it): a reference
    chosen by it would compare the fused step with itself. Here onnxruntime claims CUDA, and each runner the
    command asks for opens on the CPU at the place it names, reporting the CUDA provider."""
    cuda = [PROVIDERS["cuda"], PROVIDERS["cpu"]]
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: cuda)
    variant_dir = model / "onnx" / "fp16"
    assert auto_cache_place(variant_dir, "cuda") == "fused"
    places: list[str] = []

    def on_cpu(variant_dir: Path, max_slots: int, provider: str, kv_cache: str = "auto") -> OnnxRunner:
        place = kv_cache if kv_cache != "auto" else auto_cache_place(variant_dir, provider)
        places.append(place)
        runner = open_runner(variant_dir, max_slots, "cpu", intra_op_threads=1, kv_cache=place)
        runner.provider = PROVIDERS[provider]
        return runner

    monkeypatch.setattr(static_parity, "open_runner", on_cpu)
    assert static_parity.compare(variant_dir, "cuda", SOURCES, 5, 8)
    assert places == ["device", *static_parity.CAPTURED]


def test_served_answers_equal_the_working_batch(tiny_exported_dir: Path) -> None:
    """`--kv-cache static` served over gRPC (warm-up, then three clients at once, greedy and beam 3, both
    directions, sentences joining a running batch) answers what the working batch decodes offline."""
    model = onnx_model(tiny_exported_dir, max_slots=SERVED_SLOTS, kv_cache="static")
    assert isinstance(runner_of(model), StaticCacheRunner)
    answers: dict[tuple[str, str, str, int], set[str]] = {}
    lock = threading.Lock()
    with running_server(model, server_config(max_slots=SERVED_SLOTS, max_queue=512)) as running:

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
    working = open_runner(tiny_exported_dir / "onnx" / "fp32", SERVED_SLOTS, kv_cache="working", intra_op_threads=1)
    tokenizer = model.tokenizer
    assert len(answers) >= 8, "too few distinct texts were asked"
    for (text, source, target, beam), got in answers.items():
        parts = split(text, source)
        ids = [tokenizer.encode_source(piece, target) for piece in parts.pieces]
        best = [hyps[0].tokens for hyps in translate_ids(working, ids, beam, 1.0, 20)]
        assert got == {join([tokenizer.decode(list(t)) for t in best], parts.separators)}, (text, beam)


def test_the_served_benchmark_arm_serves_the_static_step(model: Path, tiny_exported_dir: Path) -> None:
    """bench.run's `fp16-static` served arm (CUDA only there): a server with `--kv-cache static`, here on CPU;
    an export without the step is reported skipped."""
    settings = EngineSettings(model, "cpu", 1, 6, 4)
    work = load_workload(model, Path("data/test.tsv"), 4)
    budget = replace(QUICK, load_s=1.0, latency_requests=2, concurrency=(4,), load_fractions=(1.0,))
    served = bench_served_cache(settings, work, budget, [], "static")
    assert served["variant"] == "fp16" and served["server_args"] == ["--kv-cache", "static"]
    assert not any(run["errors"] for beam in (1, 4) for run in served[f"beam{beam}"]["closed"])
    assert served["beam4"]["saturation_tokens_per_s"] > 0
    skipped = bench_served_cache(replace(settings, model_dir=tiny_exported_dir), work, budget, [], "static")
    assert skipped == {"skipped": f"no {STATIC_DECODER_FILE} in the fp16 export"}


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
