"""Token ids of ONNX greedy and beam-4 decoding equal the PyTorch reference (model/training/decode.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.parity import compare_decoding
from model.training.artifact import load_artifact
from server.backend.working_batch import WorkingBatchRunner
from tests.tiny import TINY_PAIRS


@pytest.fixture(scope="module")
def model_dir(tiny_exported_dir: Path) -> Path:
    return tiny_exported_dir


@pytest.mark.parametrize("beam_size", [1, 4])
def test_decoding_ids_identical(model_dir: Path, beam_size: int) -> None:
    from model.tokenizer import Tokenizer

    tok = Tokenizer(model_dir / "tokenizer.model")
    sources = [tok.encode_source(de, "en") for de, _ in TINY_PAIRS[:6]] + [
        tok.encode_source(en, "de") for _, en in TINY_PAIRS[:6]
    ]
    runner = WorkingBatchRunner(model_dir / "onnx" / "fp32", max_slots=12, intra_op_threads=1)
    report = compare_decoding(load_artifact(model_dir), runner, sources, beam_size=beam_size, max_len=20)
    assert report.identical == report.total == len(sources)


@pytest.mark.shipped
def test_shipped_parity(shipped_model_dir: Path, tmp_path: Path) -> None:
    """The shipped weights, exported afresh (graphs are never committed), agree with PyTorch."""
    import shutil

    from bench.parity import main as parity_main
    from export.__main__ import main as export_main

    model_dir = tmp_path / "shipped"
    shutil.copytree(shipped_model_dir, model_dir, ignore=shutil.ignore_patterns("onnx"))
    assert export_main(["--model-dir", str(model_dir), "--variants", "fp32"]) == 0
    assert parity_main(["--model-dir", str(model_dir), "--limit", "20"]) == 0


def test_a_divergence_is_located_and_its_reference_margin_measured(model_dir: Path) -> None:
    """The parity report's tie rule: the first differing position and PyTorch's log-prob gap there."""
    import torch

    from bench.parity import first_divergence

    model = load_artifact(model_dir)
    src = [5, 6, 7, 3]
    prefix = [model.cfg.bos_id, 11, 12]
    with torch.no_grad():
        s = torch.tensor([src])
        log_probs = model(s, s != model.cfg.pad_id, torch.tensor([prefix]))[0, -1].log_softmax(-1)
    best, second = (int(t) for t in log_probs.topk(2).indices)
    found = first_divergence(model, src, [11, 12, best, 9], [11, 12, second])
    assert (found.position, found.reference_token, found.onnx_token) == (2, best, second)
    assert found.margin == pytest.approx(float(log_probs[best] - log_probs[second]), abs=1e-6)
    ended = first_divergence(model, src, [11, 12], [11, 12, best])  # one stops where the other goes on
    assert (ended.position, ended.reference_token, ended.onnx_token) == (2, model.cfg.eos_id, best)


def test_a_tie_is_a_margin_within_the_implementations_difference() -> None:
    from bench.parity import TOLERANCE, DecodingReport, Divergence

    assert TOLERANCE == 1e-4
    near, far, reversed_ = (Divergence([5, 3], 0, 7, 8, margin) for margin in (5e-5, 2e-4, -5e-5))
    assert near.tie and reversed_.tie and not far.tie
    assert DecodingReport(9, 10, [near]).passed and not DecodingReport(8, 10, [near, far]).passed


def test_beam_divergences_compare_whole_hypotheses_as_the_reference_ranks_them(model_dir: Path) -> None:
    """Beam hypotheses can part at their first token with a wide token gap and still be a tie: the
    margin is the gap between normalised scores, which must equal what the reference search computed."""
    from bench.parity import first_divergence
    from model.training.decode import beam_search

    model = load_artifact(model_dir)
    src, limit = [5, 6, 7, 8, 3], 12
    ranked = beam_search(model, src, beam_size=4, max_len=limit)
    first, second = ranked[0], ranked[1]
    found = first_divergence(model, src, list(first.tokens), list(second.tokens), beam_size=4, limit=limit)
    assert found.margin == pytest.approx(first.normalized - second.normalized, abs=1e-5)
    assert found.margin >= -1e-5, "the reference ranks its best first"
    swapped = first_divergence(model, src, list(second.tokens), list(first.tokens), beam_size=4, limit=limit)
    assert swapped.margin == pytest.approx(-found.margin, abs=1e-6)


def test_the_logit_check_covers_both_directions_to_the_end_of_the_reference(model_dir: Path) -> None:
    """The 1e-4 check teacher-forces whole reference translations through the cached decoder, both ways."""
    from bench.parity import TOLERANCE, logit_cases, max_logit_difference
    from model.tokenizer import Tokenizer

    tok = Tokenizer(model_dir / "tokenizer.model")
    cases = [[(tok.encode_source(de, "en"), tok.encode_target(en)) for de, en in TINY_PAIRS[:4]]]
    cases += [[(tok.encode_source(en, "de"), tok.encode_target(de)) for de, en in TINY_PAIRS[:4]]]
    checked = logit_cases(cases, per_direction=2)
    assert [source[0] for source, _ in checked] == [tok.tag_ids["en"]] * 2 + [tok.tag_ids["de"]] * 2
    model = load_artifact(model_dir)
    runner = WorkingBatchRunner(model_dir / "onnx" / "fp32", max_slots=1, intra_op_threads=1)
    assert max(len(target) for _, target in checked) > 8  # past the first eight steps the old check stopped at
    assert max(max_logit_difference(model, runner, source, target) for source, target in checked) <= TOLERANCE
