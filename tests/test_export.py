"""Exporter: graphs are valid, have no If node, carry metadata; bad input exits non-zero clearly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from export.__main__ import main
from model.directory import (
    FORMAT_VERSION,
    GATE_BEAM_SIZE,
    INT8_DOT_FLAGS,
    MetadataError,
    available_variants,
    choose_variant,
    int8_kernels,
    read_length_penalties,
    read_metadata,
)
from model.files import CONFIG_FILE, WEIGHTS_FILE, weights_sha256
from tests.conftest import int8_args_for_this_cpu
from tests.int8_check import teacher_forced_log_probs


@pytest.fixture(scope="module")
def exported(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("export") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    assert main(["--model-dir", str(model_dir), "--variants", "fp32,int8,fp16", *int8_args_for_this_cpu()]) == 0
    return model_dir


def test_all_variants_exported_without_if(exported: Path) -> None:
    assert available_variants(exported) == ["fp32", "int8", "fp16"]
    for variant in ("fp32", "int8", "fp16"):
        for name in ("encoder.onnx", "decoder_step.onnx"):
            graph = onnx.load(str(exported / "onnx" / variant / name))
            assert "If" not in {n.op_type for n in graph.graph.node}


ORT_FLOOR_IR_VERSION = 10  # the newest ONNX IR that onnxruntime 1.20 (pyproject's floor) loads


def test_every_graph_loads_in_the_oldest_onnxruntime_we_support(exported: Path) -> None:
    """A newer onnx package stamps its own IR version on graphs it builds (IR 14 with onnx 1.23), which
    older onnxruntime releases refuse: every exported graph keeps to the IR that the floor reads."""
    graphs = sorted((exported / "onnx").glob("*/*.onnx"))
    assert len(graphs) >= 10  # 3 variants x (encoder, decoder step); fp16's fused step, encoder, 2 cache graphs
    for path in graphs:
        assert onnx.load(str(path), load_external_data=False).ir_version <= ORT_FLOOR_IR_VERSION, path


def test_metadata_records_source(exported: Path) -> None:
    meta = read_metadata(exported / "onnx" / "fp16")
    assert meta.variant == "fp16" and meta.dtype == "float16" and meta.opset == 18
    assert meta.source_sha256 == weights_sha256(exported)
    assert meta.tag_ids == {"en": 4, "de": 5}
    assert meta.spec().vocab_size == meta.model_config["vocab_size"]


@pytest.mark.parametrize("seven_bit", [False, True])
def test_int8_recipes_quantize_as_their_metadata_says(exported: Path, tmp_path: Path, seven_bit: bool) -> None:
    """8-bit per tensor (the default) or 7-bit per output channel (`--int8-7bit`, for CPUs without VNNI,
    where full-range u8 x s8 products can saturate); the recipe is recorded for the BLEU gate. The embedding
    tables take a scale per row in both."""
    from onnx import numpy_helper

    from export.quantize import export_int8, int8_recipe

    out = export_int8(exported, tmp_path / "int8", per_channel=seven_bit, reduce_range=seven_bit)
    assert read_metadata(out).recipe == int8_recipe(seven_bit, seven_bit)
    for name in ("encoder.onnx", "decoder_step.onnx"):
        graph = onnx.load(str(out / name)).graph
        weights = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        quantized = {n: w for n, w in weights.items() if n.endswith("_quantized")}
        assert quantized, "the MatMul weights are quantized"
        for weight_name, weight in quantized.items():
            assert weight.dtype == np.int8, weight_name
            assert (max(-weight.min(), weight.max()) <= 64) == seven_bit, weight_name
            if weight_name in ("embed.weight_quantized", "src_embed.weight_quantized"):  # a table the encoder gathers
                assert weights[weight_name.removesuffix("_quantized") + "_row_scale"].shape == (weight.shape[0], 1)
                continue
            scale = weights[weight_name.removesuffix("_quantized") + "_scale"]
            assert scale.shape == ((weight.shape[1],) if seven_bit else ()), weight_name
        floats = [n for n, w in weights.items() if w.dtype == np.float32 and w.ndim == 2 and min(w.shape) > 1]
        assert not [n for n in floats if "embed" in n], "no float32 embedding table is left"


@pytest.mark.parametrize(("variant", "tolerance"), [("int8", 0.2), ("fp16", 0.01)])
def test_quantized_variants_stay_close_to_fp32(exported: Path, variant: str, tolerance: float) -> None:
    """Teacher-forced steps of two rows: each variant's log-probabilities within `tolerance` of fp32's,
    and the same best token wherever fp32's lead is wider than the tolerance allows to flip.

    int8 is exported with the recipe for this CPU's int8 class (tests/test_int8_cpu_classes.py runs the
    other class under emulation). fp32 lies up to 3.7 from a flat distribution: a broken quantization
    (zeroed scales, constant logits, garbage weights) cannot pass.
    The BLEU gate cannot catch that here: every variant of a random model scores about 0.

    Broken once on purpose (every weight scale halved after quantizing, as a 7-bit scale on 8-bit
    weights would be), int8 lay over ten times the tolerance from fp32.
    """
    reference = teacher_forced_log_probs(exported / "onnx" / "fp32")
    quantized = teacher_forced_log_probs(exported / "onnx" / variant)
    assert np.abs(reference + np.log(reference.shape[-1])).max() > 10 * tolerance, "fp32 must differ from flat"
    assert np.abs(quantized - reference).max() <= tolerance
    top2 = np.sort(reference, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * tolerance
    assert clear.sum() >= 4, "enough rows with a clear best token to compare"
    np.testing.assert_array_equal(quantized.argmax(-1)[clear], reference.argmax(-1)[clear])


def test_the_gate_is_not_recorded_for_a_provider_onnxruntime_did_not_give(exported: Path) -> None:
    """Asked for CUDA where there is none, onnxruntime falls back to CPU with only a warning."""
    import onnxruntime as ort

    from server.gates.variants import main as variants_main

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA: the fallback cannot happen")
    with pytest.raises(SystemExit, match="onnxruntime gave CPUExecutionProvider"):
        variants_main(["--model-dir", str(exported), "--provider", "cuda", "--limit", "1", "--beam-size", "1"])
    assert not (exported / "variants.json").exists()


def test_choose_variant_respects_bleu_gate(exported: Path) -> None:
    """Broken once on purpose, twice: `passed_gate` reading the CPU record for every provider served fp16
    on CUDA from a CPU measurement; without the recipe check, int8 graphs of an unmeasured recipe were
    served."""
    assert choose_variant(exported, "auto", "cpu") == "fp32"  # no variants.json: nothing passed
    recipes = {v: read_metadata(exported / "onnx" / v).recipe for v in ("int8", "fp16")}
    assert "bit" in recipes["int8"] and "float16" in recipes["fp16"]
    both = {v: {"passed": True, "recipe": recipe} for v, recipe in recipes.items()}
    gate: dict[str, Any] = {
        "weights_sha256": weights_sha256(exported),
        "limit": None,
        "variants": both,
        "cpu_int8": int8_kernels(),
        "beam_size": 4,
        "length_penalty": {"de-en": 1.0, "en-de": 1.0},  # no decoding.json: 1.0 both ways
    }
    path = exported / "variants.json"
    try:
        path.write_text(json.dumps({"cpu": gate}))
        assert choose_variant(exported, "auto", "cpu") == "int8"
        assert choose_variant(exported, "auto", "cuda") == "fp32"  # fp16 passed on CPU, which computes it in fp32
        assert choose_variant(exported, "fp16", "cpu") == "fp16"  # named explicitly: served as asked
        path.write_text(json.dumps({"cpu": gate, "cuda": gate}))
        assert choose_variant(exported, "auto", "cuda") == "fp16"
        for stale in ({"weights_sha256": "0" * 64}, {"weights_sha256": None}, {"limit": 3}):
            path.write_text(json.dumps({"cpu": gate | stale}))  # other weights, a file from before the hash, a subset
            assert choose_variant(exported, "auto", "cpu") == "fp32"
        for other_search in ({"beam_size": 1}, {"length_penalty": {"de-en": 1.2, "en-de": 1.0}}, {"beam_size": None}):
            path.write_text(json.dumps({"cpu": gate | other_search}))  # not the search the server runs
            assert choose_variant(exported, "auto", "cpu") == "fp32"
        other_cpu = next(kind for kind in ("vnni", "plain") if kind != int8_kernels())
        path.write_text(json.dumps({"cpu": gate | {"cpu_int8": other_cpu}, "cuda": gate | {"cpu_int8": other_cpu}}))
        assert choose_variant(exported, "auto", "cpu") == "fp32"  # int8 measured on another class of CPU
        assert choose_variant(exported, "auto", "cuda") == "fp16"  # the CPU's int8 kernels do not matter there
        for recipe in ("int8 dynamic quantization of MatMul weights (7-bit, a scale per output channel)", None):
            other = gate | {"variants": both | {"int8": {"passed": True, "recipe": recipe}}}
            path.write_text(json.dumps({"cpu": other}))  # measured on graphs quantized another way, or unrecorded
            assert choose_variant(exported, "auto", "cpu") == "fp32"
        path.write_text(json.dumps(gate))  # one record from before gates were kept per provider
        assert choose_variant(exported, "auto", "cpu") == "fp32"
    finally:
        path.unlink()


@pytest.mark.parametrize(
    ("lines", "kind"),
    [
        ("flags\t\t: fpu sse2 avx2 avx512f avx512_vnni amx_int8\n", "vnni"),
        ("flags\t\t: fpu sse2 avx2 avx_vnni\n", "vnni"),
        ("flags\t\t: fpu sse2 avx2 avx512f avx512bw\n", "plain"),
        ("Features\t: fp asimd asimddp\n", "dotprod"),
        ("processor\t: 0\n", "plain"),
    ],
)
def test_int8_kernels_classifies_cpus_by_their_int8_dot_products(tmp_path: Path, lines: str, kind: str) -> None:
    (tmp_path / "cpuinfo").write_text("processor\t: 0\n" + lines)
    assert int8_kernels(tmp_path / "cpuinfo") == kind
    assert int8_kernels(tmp_path / "missing") == "unknown"


def test_mismatched_metadata_is_rejected(exported: Path, tmp_path: Path) -> None:
    bad = tmp_path / "fp32"
    shutil.copytree(exported / "onnx" / "fp32", bad)
    data = json.loads((bad / "metadata.json").read_text())
    data["n_heads"] += 1
    (bad / "metadata.json").write_text(json.dumps(data))
    with pytest.raises(MetadataError, match="disagrees"):
        read_metadata(bad)
    (bad / "encoder.onnx").unlink()
    with pytest.raises(MetadataError, match=r"missing encoder\.onnx"):
        read_metadata(bad)


def test_missing_weights_exit_nonzero(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    (tmp_path / "m" / WEIGHTS_FILE).unlink()
    assert main(["--model-dir", str(tmp_path / "m")]) == 2
    assert f"missing {WEIGHTS_FILE}" in capsys.readouterr().err


def test_a_tokenizer_other_than_the_models_is_refused(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same vocabulary size, other pieces: every shape check passes and the model would translate garbage."""
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / CONFIG_FILE).read_text())
    assert len(cfg["tokenizer_sha256"]) == 64  # the tiny model records its tokenizer, as training does
    (tmp_path / "m" / CONFIG_FILE).write_text(json.dumps(cfg | {"tokenizer_sha256": "0" * 64}))
    assert main(["--model-dir", str(tmp_path / "m")]) == 2
    assert "is not the tokenizer the model was trained with" in capsys.readouterr().err


def test_mismatched_config_exit_nonzero(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / CONFIG_FILE).read_text())
    cfg["vocab_size"] += 3
    (tmp_path / "m" / CONFIG_FILE).write_text(json.dumps(cfg))
    assert main(["--model-dir", str(tmp_path / "m")]) == 2
    assert "does not match the tokenizer" in capsys.readouterr().err


def test_unsupported_opset_exit_nonzero(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model-dir", str(tiny_model_dir), "--opset", "9"]) == 2
    assert "unsupported opset 9" in capsys.readouterr().err


def test_bleu_gate_scores_and_times_every_variant(exported: Path) -> None:
    from server.gates.variants import main as variants_main

    (exported / "variants.json").write_text(json.dumps({"cuda": {"kept": True}}))  # another provider's record
    assert variants_main(["--model-dir", str(exported), "--limit", "3", "--beam-size", "2"]) == 0
    try:
        by_provider = json.loads((exported / "variants.json").read_text())
    finally:
        (exported / "variants.json").unlink()
    assert by_provider["cuda"] == {"kept": True}
    record = by_provider["cpu"]
    variants = record["variants"]
    assert set(variants) == {"fp32", "int8", "fp16"} and variants["fp32"]["passed"] is True
    assert record["weights_sha256"] == weights_sha256(exported) and record["limit"] == 3
    assert (record["beam_size"], record["cpu_int8"]) == (2, int8_kernels())  # what the server compares with
    for name, scores in variants.items():
        assert scores["step_ms_1_rows"] > 0 and scores["step_ms_64_rows"] > 0
        assert isinstance(scores["passed"], bool)
        assert scores["recipe"] == read_metadata(exported / "onnx" / name).recipe != ""


def test_the_shipped_gate_was_measured_on_graphs_the_export_makes_today() -> None:
    """A changed export recipe (say, a new quantization scheme) must come with a new variants.json:
    otherwise `auto` silently falls back to fp32 on every node."""
    from export.builder.build import FLOAT_RECIPES
    from export.quantize import int8_recipe

    expected = FLOAT_RECIPES | {"int8": int8_recipe()}
    shipped = Path(__file__).resolve().parents[1] / "model" / "shipped" / "variants.json"
    for provider, record in json.loads(shipped.read_text()).items():
        assert record["beam_size"] == GATE_BEAM_SIZE and record["limit"] is None, provider
        assert provider != "cpu" or record.get("cpu_int8") in INT8_DOT_FLAGS, "re-run server.gates.variants"
        for variant, scores in record["variants"].items():
            assert scores.get("recipe") == expected[variant], (provider, variant)


def test_the_gate_passes_a_variant_within_half_a_bleu_of_fp32_in_every_direction() -> None:
    from server.gates.variants import BLEU_GATE, mark_passed

    results: dict[str, dict[str, Any]] = {
        "fp32": {"de-en": 10.0, "en-de": 8.0},
        "edge": {"de-en": 9.5, "en-de": 7.5},  # exactly 0.5 below: passes
        "below": {"de-en": 9.49, "en-de": 8.0},  # one direction 0.51 below: fails
        "better": {"de-en": 11.0, "en-de": 7.25},  # better in one, 0.75 below in the other: fails
    }
    mark_passed(results, BLEU_GATE, [("de", "en"), ("en", "de")])
    assert BLEU_GATE == 0.5
    assert {name: scores["passed"] for name, scores in results.items()} == {
        "fp32": True, "edge": True, "below": False, "better": False,
    }  # fmt: skip


VALID_PAIRS = [("Ich habe keine Ahnung.", "I have no idea."), ("Das Haus ist alt.", "The house is old.")]


def test_length_penalty_sweep_scores_each_value_and_writes_nothing(
    exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from model.data import Pair, write_tsv
    from server.gates.length_penalty import main as sweep_main

    data = tmp_path / "valid.tsv"
    write_tsv([Pair(de, en) for de, en in VALID_PAIRS], data)
    assert (
        sweep_main(["--model-dir", str(exported), "--data", str(data), "--values", "0.5,1.5", "--beam-size", "2"]) == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["length_penalty"] for r in rows] == [0.5, 1.5]
    assert all(set(r) == {"length_penalty", "de-en", "en-de"} for r in rows)
    assert not (exported / "decoding.json").exists()  # only --write changes what the server defaults to


def test_length_penalty_write_records_each_direction_and_the_weights_and_the_server_reads_it(
    exported: Path, tmp_path: Path
) -> None:
    from model.data import Pair, write_tsv
    from server.gates.length_penalty import main as sweep_main

    model_dir = tmp_path / "model"
    shutil.copytree(exported, model_dir)
    data = tmp_path / "valid.tsv"
    write_tsv([Pair(de, en) for de, en in VALID_PAIRS], data)
    args = ["--model-dir", str(model_dir), "--data", str(data), "--values", "0.5,1.0", "--beam-size", "2", "--write"]
    assert sweep_main(args) == 0
    record = json.loads((model_dir / "decoding.json").read_text())
    weights = weights_sha256(model_dir)
    assert record["weights_sha256"] == weights
    assert record["tuned_on"]["sentences"] == 2 and record["tuned_on"]["beam_size"] == 2
    assert set(record["directions"]) == {"de-en", "en-de"}
    for name, evidence in record["directions"].items():
        assert set(evidence["bleu_by_length_penalty"]) == {"0.5", "1.0"}
        assert record["length_penalty"][name] == evidence["length_penalty"]
    assert read_length_penalties(model_dir, ["de-en", "en-de"], weights) == record["length_penalty"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data", "data/test.tsv", "--write"], "never on the test set"),
        (["--values", "0.6,1.4", "--write"], "include it in --values"),
        (["--values", "0.6,2.5"], "must be in 0..2.0"),
    ],
)
def test_length_penalty_refuses_what_would_tune_badly(
    exported: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from server.gates.length_penalty import TEST_FILE
    from server.gates.length_penalty import main as sweep_main

    args = [str(TEST_FILE) if a == "data/test.tsv" else a for a in args]
    with pytest.raises(SystemExit) as exit_info:
        sweep_main(["--model-dir", str(exported), *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (exported / "decoding.json").exists()


def test_best_length_penalty_and_ties() -> None:
    from server.gates.length_penalty import best_penalty

    assert best_penalty({0.8: 10.0, 1.0: 10.5, 1.4: 11.0}) == 1.4
    assert best_penalty({0.5: 5.0, 1.2: 5.0}) == 1.2  # a tie goes to the one nearest 1.0
    assert best_penalty({0.6: 5.0, 1.4: 5.0}) == 0.6  # equally near (0.4 vs 0.3999...): the smaller


def test_a_penalty_replaces_one_only_when_it_wins_significantly() -> None:
    from server.gates.length_penalty import choose

    references = [f"the {w} house is very old and it stands on the hill ." for w in ("red", "big", "new", "tall")] * 40
    truncated = [r.rsplit(" ", 4)[0] for r in references]  # short outputs: brevity penalty and lost n-grams
    clear_win = choose({1.0: truncated, 1.4: references}, references)
    assert (clear_win.length_penalty, clear_win.best) == (1.4, 1.4) and clear_win.p_value < 0.05
    one_sentence = truncated[:]
    one_sentence[0] = references[0]  # better by a single sentence of 160: noise, not evidence
    noise = choose({1.0: truncated, 1.4: one_sentence}, references)
    assert (noise.length_penalty, noise.best) == (1.0, 1.4) and noise.p_value >= 0.05


@pytest.mark.parametrize(("form", "vocab"), [("plain", 40), ("chunked", 40), ("chunked", 600)])
def test_graph_ranking_breaks_ties_as_the_reference(tmp_path: Path, form: str, vocab: int) -> None:
    """Both rankings appended to the decoder graphs, on inputs full of ties: exact ties within and across rows,
    and ties that only the float32 add of a large row score creates (values an ulp apart), within one chunk and
    across several. Broken once on purpose (the add and TopK in float64), the values one ulp apart no longer tied
    and the ids came out in another order; ranking the chunks before adding the row score failed the same way."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto

    from export.builder.graph import GraphBuilder
    from export.builder.ranking import RANKING_CHUNK, add_candidate_selection, add_chunked_selection
    from server.core.beam import row_candidates

    b = GraphBuilder("ranking", np.dtype(np.float32))
    scores_in = b.add_input("x", TensorProto.FLOAT, ["B", "V"])
    if form == "plain":
        add_candidate_selection(b, scores_in)
    else:
        add_chunked_selection(b, scores_in, 18)
    path = tmp_path / "ranking.onnx"
    onnx.save(b.model(18), str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    width = vocab if form == "plain" else -(-vocab // RANKING_CHUNK) * RANKING_CHUNK
    rng = np.random.default_rng(0)
    tiny = np.float32(-2.0) + np.arange(4, dtype=np.float32) * np.spacing(np.float32(2.0))  # 4 values, 1 ulp apart
    for trial in range(50):
        logprobs = rng.choice(np.concatenate([np.linspace(-5, 0, 3, dtype=np.float32), tiny]), size=(4, vocab))
        if trial % 2:  # a few near-ties over a floor: the best entries in different chunks
            logprobs = np.full((4, vocab), -5.0, np.float32)
            for row in logprobs:
                row[rng.integers(0, vocab, 6)] = rng.choice(tiny, 6)
        row_scores = rng.choice(np.asarray([0.0, -1.5, -1000.0], dtype=np.float32), size=4)
        k = int(rng.integers(1, min(vocab, 40) + 1))  # the runner caps k at V
        padded = np.full((4, width), -np.inf, np.float32)
        padded[:, :vocab] = logprobs
        feeds = {"x": padded, "row_scores": row_scores, "top_k": np.asarray([k], np.int64),
                 "bias_ids": np.zeros((4, 1), np.int64), "bias_values": np.zeros((4, 1), np.float32)}  # fmt: skip
        scores, ids = session.run(["top_scores", "top_ids"], feeds)
        want_scores, want_ids = row_candidates(logprobs.astype(np.float32), row_scores, k)
        np.testing.assert_array_equal(ids, want_ids, err_msg=f"trial {trial}")
        np.testing.assert_array_equal(scores, want_scores, err_msg=f"trial {trial}")


def test_length_penalties_are_optional_checked_and_tied_to_the_weights(tmp_path: Path) -> None:
    directions = ["de-en", "en-de"]
    weights = "ab" * 32
    assert read_length_penalties(tmp_path, directions, weights) == {"de-en": 1.0, "en-de": 1.0}  # no file: 1.0
    path = tmp_path / "decoding.json"
    path.write_text(json.dumps({"length_penalty": {"en-de": 1.2}, "weights_sha256": weights}))
    assert read_length_penalties(tmp_path, directions, weights) == {"de-en": 1.0, "en-de": float(np.float32(1.2))}
    with pytest.raises(MetadataError, match="tuned on other weights"):
        read_length_penalties(tmp_path, directions, "cd" * 32)
    bad_records = [
        ({"length_penalty": {"de-fr": 1.0}, "weights_sha256": weights}, r"for \['de-fr'\]"),
        ({"length_penalty": {"de-en": 2.5}, "weights_sha256": weights}, "0..2.0"),
        ({"length_penalty": {"de-en": -0.1}, "weights_sha256": weights}, "0..2.0"),
        ({"length_penalty": {"de-en": True}, "weights_sha256": weights}, "0..2.0"),
        ({"length_penalty": {"de-en": "1.0"}, "weights_sha256": weights}, "0..2.0"),
        ({"length_penalty": [1.0], "weights_sha256": weights}, "expected"),
        ({"lenght_penalty": {"de-en": 1.2}, "weights_sha256": weights}, "expected"),
        ([1.0], "expected"),
    ]
    for record, message in bad_records:
        path.write_text(json.dumps(record))
        with pytest.raises(MetadataError, match=message):
            read_length_penalties(tmp_path, directions, weights)


@pytest.mark.parametrize("version", [None, FORMAT_VERSION - 1, FORMAT_VERSION + 1])
def test_an_export_of_another_format_version_is_refused_naming_the_command(
    exported: Path, tmp_path: Path, version: int | None
) -> None:
    """Broken once on purpose (only newer formats refused), an export without a version failed on a
    missing field instead, without the message naming the rebuild command."""
    variant = tmp_path / "model" / "onnx" / "fp32"
    shutil.copytree(exported / "onnx" / "fp32", variant)
    meta = json.loads((variant / "metadata.json").read_text())
    meta.pop("format_version") if version is None else meta.update(format_version=version)
    (variant / "metadata.json").write_text(json.dumps(meta))
    refusal = rf"format {version}, not {FORMAT_VERSION}: export it again with python -m export"
    with pytest.raises(MetadataError, match=refusal):
        read_metadata(variant)


def test_an_export_missing_a_graph_is_refused(exported: Path, tmp_path: Path) -> None:
    variant = tmp_path / "model" / "onnx" / "fp32"
    shutil.copytree(exported / "onnx" / "fp32", variant)
    (variant / "encoder.onnx").unlink()
    with pytest.raises(MetadataError, match=r"missing encoder\.onnx"):
        read_metadata(variant)
