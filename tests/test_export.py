"""Exporter: graphs are valid, have no If node, carry metadata; bad input exits non-zero clearly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest

from export.__main__ import main
from model.artifact import CONFIG_FILE, WEIGHTS_FILE, weights_sha256
from server.metadata import MetadataError, available_variants, choose_variant, read_metadata


@pytest.fixture(scope="module")
def exported(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("export") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    assert main(["--model-dir", str(model_dir), "--variants", "fp32,int8,fp16"]) == 0
    return model_dir


def test_all_variants_exported_without_if(exported: Path) -> None:
    assert available_variants(exported) == ["fp32", "int8", "fp16"]
    for variant in ("fp32", "int8", "fp16"):
        for name in ("encoder.onnx", "decoder_step.onnx"):
            graph = onnx.load(str(exported / "onnx" / variant / name))
            assert "If" not in {n.op_type for n in graph.graph.node}


def test_metadata_records_source(exported: Path) -> None:
    meta = read_metadata(exported / "onnx" / "fp16")
    assert meta.variant == "fp16" and meta.dtype == "float16" and meta.opset == 18
    assert meta.source_sha256 == weights_sha256(exported)
    assert meta.tag_ids == {"en": 4, "de": 5}
    assert meta.spec().vocab_size == meta.model_config["vocab_size"]


def test_choose_variant_respects_bleu_gate(exported: Path) -> None:
    assert choose_variant(exported, "auto", "cpu") == "fp32"  # no variants.json: nothing passed
    (exported / "variants.json").write_text(json.dumps({"variants": {"int8": {"passed": True}}}))
    try:
        assert choose_variant(exported, "auto", "cpu") == "int8"
        assert choose_variant(exported, "auto", "cuda") == "fp32"
        assert choose_variant(exported, "fp16", "cpu") == "fp16"
    finally:
        (exported / "variants.json").unlink()


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
    from export.variants import main as variants_main

    assert variants_main(["--model-dir", str(exported), "--limit", "3", "--beam-size", "2"]) == 0
    try:
        record = json.loads((exported / "variants.json").read_text())
    finally:
        (exported / "variants.json").unlink()
    variants = record["variants"]
    assert set(variants) == {"fp32", "int8", "fp16"} and variants["fp32"]["passed"] is True
    for scores in variants.values():
        assert scores["step_ms_1_rows"] > 0 and scores["step_ms_64_rows"] > 0
        within = all(scores[d] >= variants["fp32"][d] - record["gate_bleu"] for d in ("de-en", "en-de"))
        assert scores["passed"] == within


def test_length_penalty_sweep_scores_each_value_and_names_the_best(
    exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from export.length_penalty import main as sweep_main
    from model.data import Pair, write_tsv

    data = tmp_path / "valid.tsv"
    write_tsv([Pair("Ich habe keine Ahnung.", "I have no idea."), Pair("Das Haus ist alt.", "The house is old.")], data)
    assert (
        sweep_main(["--model-dir", str(exported), "--data", str(data), "--values", "0.5,1.5", "--beam-size", "2"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines[:2]]
    assert [r["length_penalty"] for r in rows] == [0.5, 1.5]
    assert all(set(r) == {"length_penalty", "de-en", "en-de"} for r in rows)
    best = {d: max(rows, key=lambda r: (r[d], -abs(r["length_penalty"] - 1.0)))["length_penalty"] for d in rows[0]}
    del best["length_penalty"]
    assert lines[2] == f"best on {data} (2 sentences), per direction: {best}"
    assert not (exported / "decoding.json").exists()  # only --write changes what the server defaults to


def test_length_penalty_write_records_the_best_per_direction_and_the_server_reads_it(
    exported: Path, tmp_path: Path
) -> None:
    from export.length_penalty import main as sweep_main
    from model.data import Pair, write_tsv
    from server.metadata import read_length_penalties

    model_dir = tmp_path / "model"
    shutil.copytree(exported, model_dir)
    data = tmp_path / "valid.tsv"
    write_tsv([Pair("Ich habe keine Ahnung.", "I have no idea."), Pair("Das Haus ist alt.", "The house is old.")], data)
    args = ["--model-dir", str(model_dir), "--data", str(data), "--values", "0.5,1.5", "--beam-size", "2", "--write"]
    assert sweep_main(args) == 0
    record = json.loads((model_dir / "decoding.json").read_text())
    sweep = record["bleu_by_length_penalty"]
    assert set(sweep) == {"0.5", "1.5"} and record["tuned_on"] == {"data": str(data), "sentences": 2, "beam_size": 2}
    for direction, chosen in record["length_penalty"].items():
        assert sweep[str(chosen)][direction] == max(scores[direction] for scores in sweep.values())
    assert read_length_penalties(model_dir) == record["length_penalty"]


def test_length_penalty_write_refuses_the_test_set(exported: Path) -> None:
    from export.length_penalty import main as sweep_main

    with pytest.raises(SystemExit):
        sweep_main(["--model-dir", str(exported), "--data", "data/test.tsv", "--write"])
    assert not (exported / "decoding.json").exists()


def test_best_length_penalty_is_chosen_per_direction_and_ties_keep_one() -> None:
    from export.length_penalty import best_per_direction

    sweep = {0.8: {"de-en": 10.0, "en-de": 6.0}, 1.0: {"de-en": 10.0, "en-de": 6.5}, 1.4: {"de-en": 9.0, "en-de": 7.0}}
    assert best_per_direction(sweep) == {"de-en": 1.0, "en-de": 1.4}
    assert best_per_direction({0.5: {"de-en": 5.0}, 1.2: {"de-en": 5.0}}) == {"de-en": 1.2}  # a tie: nearest 1.0
    assert best_per_direction({0.5: {"de-en": 5.0}, 1.5: {"de-en": 5.0}}) == {"de-en": 0.5}  # equally near: smaller


def test_graph_ranking_breaks_ties_as_the_reference(tmp_path: Path) -> None:
    """The TopK appended to every decoder graph, on inputs full of ties: exact ties within and across
    rows, and ties that only the float32 add of a large row score creates (values an ulp apart)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from export.onnx_export import add_candidate_selection
    from server.beam import row_candidates

    path = tmp_path / "ranking.onnx"
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["log_probs"])], "ranking",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "V"])],
        [helper.make_tensor_value_info("log_probs", TensorProto.FLOAT, ["B", "V"])],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    add_candidate_selection(path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    tiny = np.float32(-2.0) + np.arange(4, dtype=np.float32) * np.spacing(np.float32(2.0))  # 4 values, 1 ulp apart
    for trial in range(50):
        logprobs = rng.choice(np.concatenate([np.linspace(-5, 0, 3, dtype=np.float32), tiny]), size=(4, 40))
        row_scores = rng.choice(np.asarray([0.0, -1.5, -1000.0], dtype=np.float32), size=4)
        k = int(rng.integers(1, 41))  # the runner caps k at V
        feeds = {"x": logprobs.astype(np.float32), "row_scores": row_scores, "top_k": np.asarray([k], np.int64)}
        scores, ids = session.run(["top_scores", "top_ids"], feeds)
        want_scores, want_ids = row_candidates(feeds["x"], row_scores, k)
        np.testing.assert_array_equal(ids, want_ids, err_msg=f"trial {trial}")
        np.testing.assert_array_equal(scores, want_scores, err_msg=f"trial {trial}")


def test_length_penalties_are_optional_and_checked(tmp_path: Path) -> None:
    from server.metadata import read_length_penalties

    assert read_length_penalties(tmp_path) == {}  # no decoding.json: every direction gets the default
    path = tmp_path / "decoding.json"
    path.write_text(json.dumps({"length_penalty": {"de-en": 1.2, "en-de": 1}}))
    assert read_length_penalties(tmp_path) == {"de-en": 1.2, "en-de": 1.0}
    for bad in ({"de-en": 2.5}, {"de-en": -0.1}, {"de-en": "1.0"}, [1.0]):
        path.write_text(json.dumps({"length_penalty": bad}))
        with pytest.raises(MetadataError, match="length_penalty"):
            read_length_penalties(tmp_path)
