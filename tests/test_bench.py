"""The benchmark's own correctness: CTranslate2 conversion parity, load generator math, pipeline smoke."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import ctranslate2
import grpc
import numpy as np
import pytest
import torch

from bench.burst import FLOOR_MARGIN_MS, judge_round
from bench.ct2_convert import convert, piece_list, translate_ids
from bench.engines import Unavailable
from bench.loadgen import Query, Record, closed_loop, open_loop, percentile, send_times, summarize
from model.data import Pair, write_tsv
from model.tokenizer import Tokenizer
from model.training.artifact import load_artifact
from model.training.decode import beam_search
from tests.tiny import TINY_PAIRS


@pytest.fixture(scope="module")
def ct2_translator(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ctranslate2.Translator:
    out = convert(tiny_model_dir, tmp_path_factory.mktemp("ct2") / "model")
    return ctranslate2.Translator(str(out), device="cpu", inter_threads=1, intra_threads=1)


def tiny_sources(model_dir: Path) -> list[list[int]]:
    tok = Tokenizer(model_dir / "tokenizer.model")
    return [tok.encode_source(de, "en") for de, _ in TINY_PAIRS] + [tok.encode_source(en, "de") for _, en in TINY_PAIRS]


@pytest.mark.parametrize("beam_size", [1, 4])
def test_ct2_ids_equal_pytorch(tiny_model_dir: Path, ct2_translator: ctranslate2.Translator, beam_size: int) -> None:
    model, sources = load_artifact(tiny_model_dir), tiny_sources(tiny_model_dir)
    got = translate_ids(ct2_translator, piece_list(tiny_model_dir), sources, beam_size, max_len=12)
    want = [list(beam_search(model, src, beam_size, max_len=12)[0].tokens) for src in sources]
    assert got == want


def test_ct2_token_log_probs_equal_pytorch(tiny_model_dir: Path, ct2_translator: ctranslate2.Translator) -> None:
    """Teacher-forced log-probs of random targets: checks every weight, not just the argmax a random model picks."""
    model, vocab = load_artifact(tiny_model_dir), piece_list(tiny_model_dir)
    sources = tiny_sources(tiny_model_dir)[:6]
    gen = torch.Generator().manual_seed(0)
    targets = [torch.randint(5, len(vocab), (7,), generator=gen).tolist() for _ in sources]
    scored = ct2_translator.score_batch(
        [[vocab[i] for i in s] for s in sources], [[vocab[i] for i in t] for t in targets]
    )
    for src, tgt, result in zip(sources, targets, scored, strict=True):
        src_t = torch.tensor([src])
        tgt_in = torch.tensor([[model.cfg.bos_id, *tgt]])
        with torch.no_grad():
            logp = model(src_t, src_t != model.cfg.pad_id, tgt_in).log_softmax(-1)[0]
        want = [float(logp[i, tok]) for i, tok in enumerate([*tgt, model.cfg.eos_id])]
        assert result.log_probs == pytest.approx(want, abs=1e-3)


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # unsorted on purpose
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile(values, 0) == 1.0
    assert percentile([7.0], 95) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_send_times_are_poisson_arrivals_at_rate_and_repeatable() -> None:
    times = send_times(rate=50, duration_s=200)
    gaps = np.diff(times)
    assert times[0] == 0.0 and max(times) < 200 and (gaps > 0).all()
    assert len(times) == pytest.approx(50 * 200, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential gaps: bursts and lulls, not a grid
    assert send_times(rate=50, duration_s=200) == times  # seeded: a rerun offers the same load
    assert send_times(rate=50, duration_s=200, seed=1) != times
    assert send_times(rate=0.1, duration_s=1) == [0.0]  # at least one request
    with pytest.raises(ValueError):
        send_times(rate=0, duration_s=1)


def test_queries_take_consecutive_sentences_of_one_direction(tmp_path: Path) -> None:
    from bench.loadgen import load_queries

    tsv = tmp_path / "pairs.tsv"
    write_tsv([Pair(f"de{i}", f"en{i}") for i in range(5)], tsv)
    assert [q.texts for q in load_queries(tsv)][:4] == [("de0",), ("en0",), ("de1",), ("en1",)]
    grouped = load_queries(tsv, texts_per_request=2)
    assert [(q.texts, q.source_language) for q in grouped] == [
        (("de0", "de1"), "de"), (("en0", "en1"), "en"), (("de2", "de3"), "de"), (("en2", "en3"), "en"),
        (("de4",), "de"), (("en4",), "en"),
    ]  # fmt: skip


def test_a_capped_closed_loop_sends_exactly_the_first_queries_in_order() -> None:
    sent: list[str] = []

    async def send(query: Query) -> int:
        sent.append(query.texts[0])
        return 1

    queries = [Query((str(i),), "de", "en") for i in range(10)]
    records = asyncio.run(closed_loop(send, queries, concurrency=1, duration_s=60, max_requests=4))
    assert sent == ["0", "1", "2", "3"] and len(records) == 4


def test_summarize_counts_errors_and_rates() -> None:
    records = [
        Record(start=0.0, latency=0.1, code="OK", output_tokens=10),
        Record(start=0.5, latency=0.3, code="OK", output_tokens=20),
        Record(start=1.0, latency=1.0, code="DEADLINE_EXCEEDED", output_tokens=0),
        Record(start=1.5, latency=0.5, code="OK", output_tokens=30),
    ]
    s = summarize(records, "open", offered_rate=2.0)
    assert (s.requests, s.ok, s.errors) == (4, 3, {"DEADLINE_EXCEEDED": 1})
    assert s.elapsed_s == pytest.approx(2.0)  # first send at 0, last response at 2.0
    assert s.achieved_rps == pytest.approx(1.5)
    assert s.tokens_per_s == pytest.approx(30.0)
    assert (s.p50_ms, s.p95_ms) == (pytest.approx(300.0), pytest.approx(500.0))  # errors excluded
    assert math.isnan(s.p99_ms)  # from 3 samples a p99 would only be the maximum
    many = summarize([Record(start=i, latency=i / 1000, code="OK", output_tokens=1) for i in range(1, 201)], "closed")
    assert many.p99_ms == pytest.approx(198.0)


def test_open_loop_offers_fixed_rate_and_records_failures() -> None:
    """A slow server must not slow the offered rate down (no coordinated omission): no response comes back
    until every request has been sent, so a loop that waited for answers would never send the second."""
    calls: list[str] = []

    async def send(query: Query) -> int:
        calls.append(query.texts[0])
        while len(calls) < 10:  # the server answers nothing before the last request is sent
            await asyncio.sleep(0.01)
        if query.texts == ("bad",):
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down", None
            )
        return 3

    queries = [Query(("good",), "de", "en"), Query(("bad",), "de", "en")]
    offsets = [i * 0.05 for i in range(10)]  # 20 per second for 0.5 s
    records = asyncio.run(asyncio.wait_for(open_loop(send, queries, offsets), 60))
    assert len(records) == 10 and calls == ["good", "bad"] * 5
    assert sorted(r.code for r in records) == ["OK"] * 5 + ["UNAVAILABLE"] * 5
    assert [r.start for r in records] == pytest.approx(offsets)  # each counted from when it was due
    assert all(r.sent >= r.start for r in records)  # never sent early


def test_open_loop_latency_counts_from_when_a_request_was_due() -> None:
    """A client that falls behind its schedule must not hide the delay (coordinated omission)."""

    async def send(query: Query) -> int:
        if query.texts == ("stall",):
            time.sleep(0.3)  # blocks the client's event loop: the next requests leave late
        return 1

    queries = [Query(("stall",), "de", "en"), Query(("fast",), "de", "en")]
    records = asyncio.run(open_loop(send, queries, [0.0, 0.05, 0.1, 0.15]))
    assert [r.start for r in records] == pytest.approx([0.0, 0.05, 0.1, 0.15], abs=0.02)
    assert records[1].latency >= 0.2  # due at 0.05 s, could only leave after the stall ended at 0.3 s
    assert records[1].sent >= 0.25 and records[1].sent - records[1].start >= 0.2  # and the record says so


def test_bench_pipeline_end_to_end_quick(tiny_exported_dir: Path, tmp_path: Path) -> None:
    """--quick on the tiny model: results.json, results.md and both plots; CT2 agrees with PyTorch; the served
    path runs once per precision with the server's CPU layout and is compared precision for precision."""
    from bench.run import main

    out = tmp_path / "results"
    main(["--model-dir", str(tiny_exported_dir), "--out", str(out), "--quick", "--sentences", "4", "--max-len", "6"])
    results = json.loads((out / "results.json").read_text())
    ct2 = results["offline"]["ctranslate2-float32"]["beam1"]
    assert ct2["throughput"]["sentences"] == 4 and ct2["throughput"]["tokens_per_s"] > 0
    assert ct2["agreement_with_pytorch"]["rate"] == 1.0
    for variant in ("fp32", "int8"):
        served = results["served"][variant]
        assert (served["engines"], served["threads_per_engine"]) == (2, 1)
        assert served["beam4"]["saturation_tokens_per_s"] > 0
        assert not any(run["errors"] for run in served["beam4"]["closed"])
    assert set(results["ratios_to_ctranslate2"]["float32"]["beam1"]) == {"ctranslate2", "onnx-fp32", "served-fp32"}
    markdown = (out / "results.md").read_text()
    assert "ctranslate2-float32" in markdown and "served-int8" in markdown
    for png in ("throughput_vs_concurrency.png", "latency_vs_load.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_a_bench_stopped_midway_keeps_what_it_measured(
    tiny_exported_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """results.json holds the offline figures as soon as they are measured, and each served run's as it ends: a
    run stopped at a GPU node's time limit keeps them."""
    import bench.run

    def stopped(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # the node's time limit, arriving during the served runs

    monkeypatch.setattr(bench.run, "bench_served", stopped)
    out = tmp_path / "results"
    with pytest.raises(KeyboardInterrupt):
        bench.run.main([
            "--model-dir", str(tiny_exported_dir), "--out", str(out), "--quick", "--sentences", "4",
            "--max-len", "6", "--engines", "onnx-fp32",
        ])  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert list(results["offline"]) == ["onnx-fp32"] and results["served"] == {}
    assert results["offline"]["onnx-fp32"]["beam1"]["throughput"]["tokens_per_s"] > 0
    assert not (out / "results.md").exists()  # the table comes with the whole run


def test_bench_arms_record_the_engines_step_figures_and_survive_a_failing_arm(
    tiny_exported_dir: Path, tmp_path: Path
) -> None:
    """--engines picks offline engines, --served-arm adds served runs with their own flags (one that cannot start
    is recorded and the next still runs), and each closed-loop run carries the engines' step figures read from
    the server's /metrics over that run."""
    from bench.run import main

    out = tmp_path / "results"
    main([
        "--model-dir", str(tiny_exported_dir), "--out", str(out), "--quick", "--sentences", "4", "--max-len", "6",
        "--engines", "onnx-fp32", "--served-variants", "fp32", "--concurrency", "2", "--load-fractions", "1.0",
        "--served-arm", "broken=fp32 --no-such-flag", "--served-arm", "one=fp32 --engines 1",
    ])  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert list(results["offline"]) == ["onnx-fp32"]
    assert results["budget"]["load_fractions"] == [1.0]
    assert results["served"]["broken"]["skipped"].startswith("failed: server did not become SERVING")
    assert list(results["served"]) == ["fp32", "broken", "one"] and results["served"]["one"]["server_args"] == [
        "--engines",
        "1",
    ]
    for label in ("fp32", "one"):
        for beam in (1, 4):
            engine = results["served"][label][f"beam{beam}"]["closed"][0]["engine"]
            assert engine["steps"] > 0 and engine["step_ms"] > 0 and engine["encode_ms"] > 0
            assert 1 <= engine["rows_per_step"] <= 2 * beam  # two sentences in flight, `beam` rows each
            assert engine["busy_share"] > 0  # engine-seconds per second: a figure, bounded by no test
            assert engine["engine_mb"] > 10  # an interpreter with onnxruntime and a model loaded
            assert engine["queue_wait_ms"] >= 0 and engine["server_call_ms"] > 0
    assert "Engines during each closed-loop run" in (out / "results.md").read_text()
    with pytest.raises(SystemExit):
        main(["--model-dir", str(tiny_exported_dir), "--engines", "onnx-fp16-fused"])  # a CUDA engine on CPU
    with pytest.raises(SystemExit):
        main(["--model-dir", str(tiny_exported_dir), "--served-arm", "no-variant="])


def test_loadgen_against_real_server_loses_no_request(tiny_model_dir: Path) -> None:
    """Closed and open loop through real gRPC on loopback (fake runner): every request OK, tokens counted."""
    from bench.loadgen import run_grpc, servable
    from tests.serving import fake_model, running_server

    queries = [Query((de,), "de", "en") for de, _ in TINY_PAIRS[:6]]
    batched = [Query(tuple(de for de, _ in TINY_PAIRS[i : i + 3]), "de", "en") for i in (0, 3)]
    with running_server(fake_model(tiny_model_dir, max_slots=8)) as server:
        closed = asyncio.run(run_grpc(server.address, queries, beam_size=2, duration_s=0.5, concurrency=4))
        opened = asyncio.run(run_grpc(server.address, queries, beam_size=1, duration_s=0.5, rate=20))
        one_by_one = partial(run_grpc, server.address, beam_size=1, duration_s=60, concurrency=1)
        alone = asyncio.run(one_by_one(queries, max_requests=6))
        together = asyncio.run(one_by_one(batched, max_requests=2))
        french = Query(("Bonjour.",), "fr", "de")
        assert servable(server.address, [*queries[:2], french]) == queries[:2]  # the CLI's filter
        with pytest.raises(SystemExit, match="translates none of the test set's directions"):
            servable(server.address, [french])
    assert closed.ok == closed.requests > 4 and not closed.errors and closed.tokens_per_s > 0
    # the same six sentences, one or three per request: every text of a request is translated and counted
    assert (alone.ok, together.ok) == (6, 2)
    tokens = [summary.tokens_per_s * summary.elapsed_s for summary in (alone, together)]
    assert tokens[0] > 0 and tokens[1] == pytest.approx(tokens[0])
    offered = len(send_times(rate=20, duration_s=0.5))  # Poisson arrivals: about 10
    assert (opened.requests, opened.ok, opened.errors) == (offered, offered, {})
    assert opened.p50_ms <= opened.p95_ms


def test_loadgen_matches_directions_as_the_server_matches_codes() -> None:
    from bench.loadgen import translates
    from server.proto.translation.v1 import translation_pb2 as pb

    pairwise = [pb.ModelInfo(pairs=[pb.LanguagePair(source="deu", target="eng", source_bcp47="de", target_bcp47="en")])]
    codes = ("deu_Latn", "de-Latn"), ("eng_Latn", "en-Latn"), ("zho_Hans", "zh-Hans")
    languages = [pb.Language(code=code, bcp47=tag) for code, tag in codes]
    many = [pb.ModelInfo(any_to_any=pb.AnyToAny(sources=languages, targets=languages))]
    assert translates(pairwise, "de", "en") and translates(pairwise, "deu", "eng")
    assert not translates(pairwise, "en", "de")
    assert translates(many, "de", "en") and translates(many, "en", "de") and translates(many, "en", "zh-Hans")
    assert not translates(many, "fr", "en") and not translates(many, "en", "zh-Hant")


def _offline(tps: float, p50: float) -> dict[str, Any]:
    return {f"beam{b}": {"throughput": {"tokens_per_s": tps * b}, "latency": {"p50_ms": p50 * b}} for b in (1, 4)}


def test_ratios_compare_equal_precisions_with_ctranslate2_in_its_best_layout() -> None:
    """Throughput against CTranslate2's faster layout, latency against its quicker one, precision for precision."""
    from bench.run import ratios

    offline = {
        "ctranslate2-float32": _offline(100, 10),  # the quicker layout for one sentence
        "ctranslate2-float32-workers": _offline(200, 20),  # the faster one under load
        "ctranslate2-int8": _offline(300, 5),
        "onnx-fp32": _offline(50, 15),
        "onnx-int8": _offline(150, 10),
    }
    served = {
        "fp32": {f"beam{b}": {"saturation_tokens_per_s": 400.0 * b, "single": {"p50_ms": 12.0 * b}} for b in (1, 4)},
        "int8": {"skipped": "no int8 export"},
    }
    result = ratios(offline, served)
    beam1 = result["float32"]["beam1"]
    assert beam1["ctranslate2"]["throughput_layout"] == "ctranslate2-float32-workers"
    assert beam1["ctranslate2"]["latency_layout"] == "ctranslate2-float32"
    assert beam1["served-fp32"] == pytest.approx({"throughput": 2.0, "latency_p50": 1.2})
    assert beam1["onnx-fp32"] == pytest.approx({"throughput": 0.25, "latency_p50": 1.5})
    int8 = result["int8"]["beam4"]
    assert set(int8) == {"ctranslate2", "onnx-int8"}  # the skipped served int8 has no ratio
    assert int8["onnx-int8"] == pytest.approx({"throughput": 0.5, "latency_p50": 2.0})


def test_a_node_without_ctranslate2_is_measured_with_its_rows_skipped(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU node may lack CTranslate2 (or a build for its CUDA): its engines are skipped with the reason,
    the machine record omits it, and the report says no ratio was measured instead of an empty table."""
    from bench import engines
    from bench.plots import _ratio_rows
    from bench.run import machine

    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` raises ImportError
    with pytest.raises(Unavailable, match="ctranslate2 is not installed"):
        engines.create("ctranslate2-float32", engines.EngineSettings(tiny_model_dir, "cpu", 1, 8, 4))
    monkeypatch.setattr("importlib.metadata.version", _not_installed)
    assert "ctranslate2" not in machine()["versions"]
    assert "not measured" in "\n".join(_ratio_rows({"ratios_to_ctranslate2": {}}))


def _not_installed(name: str) -> str:
    import importlib.metadata

    raise importlib.metadata.PackageNotFoundError(name)


def test_a_run_over_several_server_processes_waits_for_each_to_serve() -> None:
    from bench.run import every_process_serving, free_port

    nobody = free_port()  # nothing listens there
    assert every_process_serving(nobody, ["--engines", "2"])  # one process: the health probe before decides
    assert not every_process_serving(nobody, ["--processes", "2"])


def test_served_layout_is_one_single_threaded_engine_per_thread_on_cpu(tiny_model_dir: Path) -> None:
    from bench.engines import EngineSettings
    from bench.run import served_layout, served_variants

    assert served_layout(EngineSettings(tiny_model_dir, "cpu", 2, 8, 4)) == (2, 1)
    assert served_layout(EngineSettings(tiny_model_dir, "cuda", 2, 8, 4)) == (0, 2)  # the server's CUDA default
    assert served_variants("auto", "cpu") == ["fp32", "int8"] and served_variants("fp32", "cpu") == ["fp32"]


def test_ctranslate2_from_its_own_converter_decodes_an_import_as_our_model_does(tmp_path: Path) -> None:
    """The OPUS-MT-size comparison's footing on a tiny random Marian model: CTranslate2 converts the transformers
    directory itself and decodes the same ids as our import under PyTorch, greedy and beam 4 (our beam search
    stopping at K finished as CTranslate2's does, not patient as the import's `generate` default makes it)."""
    from bench.engines import CTranslate2Engine, EngineSettings, PyTorchEngine
    from bench.marian_random import build_marian_dir
    from export.hf import main as import_main
    from model.marian_tokenizer import MarianTokenizer

    hf_dir = build_marian_dir(tmp_path / "hf")
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "ours")]) == 0
    settings = EngineSettings(tmp_path / "ours", "cpu", 1, 12, 4, hf_dir=hf_dir)
    tok = MarianTokenizer(tmp_path / "ours")
    sources = [tok.encode_source(de, "en") for de, _ in TINY_PAIRS[:8]]
    ct2 = CTranslate2Engine(settings, "float32", tmp_path / "ct2")
    reference = PyTorchEngine(settings)
    reference.model.cfg = replace(reference.model.cfg, patient_beam=False)
    for beam in (1, 4):
        assert ct2.translate(sources, beam) == reference.translate(sources, beam)
    with pytest.raises(Unavailable, match="--hf-dir"):
        CTranslate2Engine(replace(settings, hf_dir=None), "float32", tmp_path / "ct2-none")


def test_opus_size_pipeline_builds_imports_exports_and_serves_an_opus_mt_model(tmp_path: Path) -> None:
    """bench.opus_size end to end at the tiny shape: a transformers directory, its import and export, and
    bench.run over it with CTranslate2 from its own converter and the server routing de -> en to it."""
    from bench.opus_size import main

    out = tmp_path / "results"
    main(["--shape", "tiny", "--work", str(tmp_path / "work"), "--out", str(out), "--quick", "--sentences", "4"])
    results = json.loads((out / "results.json").read_text())
    assert results["command"].startswith("python -m bench.opus_size --shape tiny")
    assert results["settings"]["max_len"] == 16 and results["sentences"] == 4
    assert results["offline"]["ctranslate2-float32"]["beam1"]["agreement_with_pytorch"]["rate"] == 1.0
    for variant in ("fp32", "int8"):
        closed = results["served"][variant]["beam1"]["closed"]
        assert closed and all(run["ok"] == run["requests"] > 0 for run in closed)


def test_opus_size_pipeline_measures_an_nllb_model_against_ctranslate2s_m2m100_converter(tmp_path: Path) -> None:
    """bench.opus_size at the NLLB family's tiny shape: CTranslate2 converts the transformers directory with its
    M2M100 loader, its ids are ours (the same outputs as the reference), and the server routes de -> en to it."""
    from bench.opus_size import main

    out = tmp_path / "results"
    main(["--shape", "nllb-tiny", "--work", str(tmp_path / "work"), "--out", str(out), "--quick", "--sentences", "4",
          "--engines", "ctranslate2-float32,pytorch-eager,onnx-int8", "--served-variants", "int8"])  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert results["sentences"] == 4
    for beam in ("beam1", "beam4"):
        assert results["offline"]["ctranslate2-float32"][beam]["agreement_with_pytorch"]["rate"] == 1.0
    assert results["offline"]["onnx-int8"]["beam1"]["throughput"]["tokens"] > 0
    closed = results["served"]["int8"]["beam1"]["closed"]
    assert closed and all(run["ok"] == run["requests"] > 0 for run in closed)


def test_the_served_path_runs_with_the_server_flags_it_is_given(tiny_exported_dir: Path) -> None:
    """`--server-args "--engine-nice 10"` serves with that flag, and the results say so."""
    from bench.engines import EngineSettings
    from bench.plots import served_rows
    from bench.run import QUICK, bench_served_variant, load_workload

    settings = EngineSettings(tiny_exported_dir, "cpu", 2, 6, 4)
    work = load_workload(tiny_exported_dir, Path("data/test.tsv"), 4)
    budget = replace(QUICK, load_s=1.0, latency_requests=2, concurrency=(4,), load_fractions=(1.0,))
    served = bench_served_variant(settings, work, budget, "fp32", ["--engine-nice", "10"])
    assert served["server_args"] == ["--engine-nice", "10"]
    assert served["beam1"]["saturation_tokens_per_s"] > 0 and served["beam4"]["saturation_tokens_per_s"] > 0
    assert not any(run["errors"] for beam in (1, 4) for run in served[f"beam{beam}"]["closed"])
    assert any("--engine-nice 10" in row for row in served_rows({"served": {"fp32": served}}))


def test_a_burst_round_passes_when_its_refusals_p95_is_within_the_margin_of_its_floor() -> None:
    floor = [("OK", 0.001 * i, 0) for i in range(1, 101)]  # p95 95 ms
    ok = [("OK", 5.0, 6)] * 10

    def refused(p95_ms: float) -> list[tuple[str, float, int]]:
        return [("RESOURCE_EXHAUSTED", p95_ms / 1000, 0)] * 20

    near, far = refused(95 + FLOOR_MARGIN_MS), refused(95 + FLOOR_MARGIN_MS + 1)
    assert judge_round(ok + near, [], floor, floor, 6.0).passed
    assert not judge_round(ok + far, [], floor, floor, 6.0).passed
    unrefused = judge_round(ok, [], floor, floor, 6.0)
    assert not unrefused.passed and unrefused.codes == {"OK": 10}  # no refusal proves nothing
    assert judge_round(ok + near, [], floor, floor, 6.0).ok_sentences_per_s == 12.0  # 60 sentences by 5 s


def test_front_capacity_serves_every_call_through_a_sleeping_device_stand_in(
    tiny_exported_dir: Path, tmp_path: Path
) -> None:
    """`python -m bench.front_capacity`: the server's front over engines whose runner only sleeps answers
    every call of a short closed loop, greedy and beam 4, with a rate and latencies to report."""
    from bench.front_capacity import main

    data = tmp_path / "pairs.tsv"
    write_tsv([Pair(de, en) for de, en in TINY_PAIRS], data)  # sentences the tiny model's source length takes
    for beam in ("1", "4"):
        result = main([
            "--model-dir", str(tiny_exported_dir), "--data", str(data), "--step-ms", "0.5", "--encode-ms", "1",
            "--concurrency", "8", "--duration", "1.5", "--beam", beam, "--max-len", "6", "--slots", "16",
        ])  # fmt: skip
        assert result["achieved_rps"] > 0 and result["tokens_per_s"] > 0 and not result["errors"]
        assert 0 < result["p50_ms"] <= result["p99_ms"]
