"""An imported model's fp16 graphs gated against its fp32 graphs on the provider that serves them
(export/fp16_gate.py): what lets `--variant auto` serve a model fetched by hub id in float16 on CUDA, where
the BLEU gate has no test set. On the CPU provider onnxruntime computes most float16 ops in float32, so these
tests run the gate's code and rules there; what it measures on CUDA is its reason to exist."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnxruntime as ort
import pytest
from safetensors.numpy import load_file, save_file

from bench.marian_random import build_marian_dir
from export.__main__ import main as export_main
from export.fetch import HubSettings
from export.fp16_gate import AGREEMENT, Agreement, measure, probe_sources, record_gate
from export.fp16_gate import main as gate_main
from export.hf import main as import_main
from export.hub import BuildError, BuildPlan, ensure_model
from model.directory import AGREEMENT_GATE, VARIANTS_FILE, choose_variant, passed_gate
from model.marian_tokenizer import MarianTokenizer
from tests.hub_cache import REPO, block_network, hub_cache, tiny_marian


def imported(root: Path, layout: str) -> Path:
    out = root / f"opus-mt-de-en-{layout}"
    assert import_main(["--model", str(build_marian_dir(root / f"hf-{layout}", layout=layout)), "--out", str(out)]) == 0
    assert export_main(["--model-dir", str(out), "--variants", "fp32,fp16"]) == 0
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gate")
    return {layout: imported(root, layout) for layout in ("classic", "tc-big")}


@pytest.mark.parametrize("layout", ["classic", "tc-big"])
def test_fp16_that_agrees_passes_and_auto_serves_it_on_cuda(
    layouts: dict[str, Path], layout: str, tmp_path: Path
) -> None:
    model = shutil.copytree(layouts[layout], tmp_path / "model")
    assert choose_variant(model, "auto", "cuda") == "fp32"  # no gate measured yet
    found = measure(model, "cpu")
    assert found.finite and found.agreement >= AGREEMENT and found.positions >= 24 and found.passed
    record_gate(model, "cuda", found)  # the CPU's measurement standing in for CUDA's
    record = json.loads((model / VARIANTS_FILE).read_text())["cuda"]
    assert record["gate"] == AGREEMENT_GATE and record["variants"]["fp16"]["passed"] is True
    assert choose_variant(model, "auto", "cuda") == "fp16"
    assert choose_variant(model, "auto", "cpu") == "fp32"  # a CUDA record says nothing of the CPU
    assert not passed_gate(model, "int8", "cuda")  # agreement vouches for float16's arithmetic alone


def test_the_probes_are_the_source_languages_words_with_the_models_tag(layouts: dict[str, Path]) -> None:
    model = layouts["tc-big"]
    tokenizer = MarianTokenizer(model)
    probes = probe_sources(model, count=5)
    assert probes == probe_sources(model, count=5) and len({tuple(p) for p in probes}) == 5  # seeded, distinct
    for ids in probes:
        assert ids[-1] == tokenizer.eos_id and tokenizer.unk_id not in ids and len(ids) >= 6
        assert (ids[0] in tokenizer.tag_ids.values()) == bool(tokenizer.tag_ids)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the point of the test
def test_fp16_that_overflows_fails_and_auto_serves_fp32(layouts: dict[str, Path], tmp_path: Path) -> None:
    """A weight past float16's 65,504 turns into inf, and the fp16 graphs' log-probabilities into NaN."""
    model = shutil.copytree(layouts["classic"], tmp_path / "model", ignore=shutil.ignore_patterns("onnx"))
    weights = load_file(model / "model.safetensors")
    weights["decoder.0.ff.w2.weight"] = weights["decoder.0.ff.w2.weight"] * 1e6
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    assert export_main(["--model-dir", str(model), "--variants", "fp32,fp16"]) == 0
    found = measure(model, "cpu")
    assert not found.finite and not found.passed
    record_gate(model, "cuda", found)
    assert choose_variant(model, "auto", "cuda") == "fp32"


def test_a_record_of_other_weights_or_graphs_is_not_trusted(layouts: dict[str, Path], tmp_path: Path) -> None:
    model = shutil.copytree(layouts["classic"], tmp_path / "model")
    record_gate(model, "cuda", Agreement(positions=100, agreement=1.0, finite=True))
    assert choose_variant(model, "auto", "cuda") == "fp16"
    path = model / VARIANTS_FILE
    good = json.loads(path.read_text())
    for key, value in (
        ("weights_sha256", "0" * 64),
        ("variants", {"fp16": {**good["cuda"]["variants"]["fp16"], "recipe": "another recipe"}}),
    ):
        path.write_text(json.dumps({"cuda": {**good["cuda"], key: value}}))
        assert choose_variant(model, "auto", "cuda") == "fp32"


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="CUDA is here")
def test_without_cuda_the_gate_records_nothing_and_a_gated_build_publishes_nothing(
    layouts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gated build whose gate could not run is not published (its key would hold no record for good): the start
    fails in one line and the next one measures again."""
    model = shutil.copytree(layouts["classic"], tmp_path / "model")
    assert gate_main(["--model-dir", str(model), "--provider", "cuda", "--record"]) == 2
    assert not (model / VARIANTS_FILE).exists() and choose_variant(model, "auto", "cuda") == "fp32"
    hub = hub_cache(tmp_path / "hub", tiny_marian(tmp_path / "marian" / "opus-mt-de-en"))
    block_network(monkeypatch.setattr)
    with pytest.raises(BuildError, match="the fp16 gate could not run on cuda"):
        ensure_model(REPO, BuildPlan(("fp32", "fp16"), fp16_gate="cuda"), tmp_path / "cache", HubSettings(hub, True))
    assert not list((tmp_path / "cache").rglob("MANIFEST.json"))


def test_a_gated_hub_build_publishes_the_record_with_the_graphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record is written before the build is published, so the manifest vouches for it too."""
    hub = hub_cache(tmp_path / "hub", tiny_marian(tmp_path / "marian" / "opus-mt-de-en"))
    block_network(monkeypatch.setattr)
    plan = BuildPlan(("fp32", "fp16"), fp16_gate="cpu")
    built = ensure_model(REPO, plan, tmp_path / "cache", HubSettings(hub, offline=True))
    record = json.loads((built.directory / VARIANTS_FILE).read_text())["cpu"]
    assert record["gate"] == AGREEMENT_GATE and record["variants"]["fp16"]["passed"] is True
    manifest = json.loads((built.directory / "MANIFEST.json").read_text())
    assert VARIANTS_FILE in json.dumps(manifest)
    again = ensure_model(REPO, plan, tmp_path / "cache", HubSettings(hub, offline=True))
    assert again.directory == built.directory and not again.built


def test_the_fused_build_served_on_cuda_is_gated_too(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The gate steps the fused encoder and capturable fused step over static buffers bound as past and present,
    as the server binds them: fed fp32's greedy tokens, its best tokens agree and stay finite."""
    from export.fp16_gate import _FusedGraphs, _Graphs

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    assert export_main(["--model-dir", str(model), "--variants", "fp32,fp16"]) == 0
    sources = [[4, 10, 11, 12, 3], [5, 20, 21, 3], [4, 30, 31, 32, 33, 34, 3], [6, 7, 8, 9, 13, 14, 15, 3]]
    reference, finite = _Graphs(model / "onnx" / "fp32", "cpu").decode(sources, 8, forced=None)
    fused = _FusedGraphs(model / "onnx" / "fp16", "cpu")
    candidate, fused_finite = fused.decode(sources, 8, forced=reference)
    assert finite and fused_finite and (candidate == reference).mean() >= AGREEMENT
    greedy, _ = fused.decode(sources, 8, forced=None)  # its own choices fed back: the buffers carry the past
    assert (greedy == reference).mean() >= AGREEMENT


def test_a_forced_code_models_gate_decodes_the_served_greedy_ids(tmp_path: Path) -> None:
    """M2M100 (the target's code forced first): the gate's fp32 decode of its probes is the server's greedy decode
    (broken once on purpose, the code not forced: the rows began with the model's own first choice)."""
    from export.fp16_gate import STEPS, _Graphs, forced_first, probe_direction
    from model.directory import read_metadata
    from model.m2m_tokenizer import M2MTokenizer
    from server.core.offline import translate_ids
    from tests.m2m_tiny import build_m2m100_dir
    from tests.serving import onnx_model, runner_of
    from tests.test_m2m_served import sharpened

    model = tmp_path / "ours"
    assert import_main(["--model", str(sharpened(build_m2m100_dir(tmp_path / "hf"))), "--out", str(model)]) == 0
    assert export_main(["--model-dir", str(model), "--variants", "fp32,fp16"]) == 0
    meta = read_metadata(model / "onnx" / "fp32")
    sources, first = probe_sources(model), forced_first(model, meta)
    assert first == M2MTokenizer(model).tag_ids[probe_direction(model)[1]]
    gate, finite = _Graphs(model / "onnx" / "fp32", "cpu").decode(sources, STEPS, forced=None, first=first)
    served = translate_ids(runner_of(onnx_model(model)), sources, 1, 1.0, STEPS, forced_first=first)
    for row, (best,) in zip(gate.tolist(), served, strict=True):
        ended = row.index(meta.eos_id) if meta.eos_id in row else STEPS
        assert row[:ended] == list(best.tokens)
    assert finite and max(len(best.tokens) for (best,) in served) > 2  # more than the code and one token
    found = measure(model, "cpu")
    assert found.passed and found.positions >= len(sources)  # the forced first position not among them
