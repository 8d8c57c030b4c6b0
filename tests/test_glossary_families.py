"""Glossary terms forced on tiny random checkpoints of every family served, imported and exported as a user's would
be: OPUS-MT (classic, separate vocabularies, `>>xx<<` target tags), NLLB-200 and M2M100 (the target's code forced
first). Random weights never write a term on their own: each is in the output because the search put it there,
once per mention, in greedy and beam 4."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from export.hf import main as import_main
from server.core.offline import translate_ids
from server.text.terms import target_ids
from tests.hub_cache import tiny_marian
from tests.m2m_tiny import build_m2m100_dir, build_nllb_dir
from tests.marian_tiny import build_marian_dir
from tests.serving import export_tiny_onnx, onnx_model, runner_of

TEXT = "Das Haus ist klein"
CANDIDATE_TERMS = ["house", "the city", "station", "Haus", "house is small", "la", "a"]

# name -> (builder, source language, target language): the model's own codes
FAMILIES: dict[str, tuple[Callable[[Path], Path], str, str]] = {
    "opus-mt-classic": (tiny_marian, "de", "en"),
    "opus-mt-separate-vocabularies": (lambda out: build_marian_dir(out, separate_vocabs=True), "de", "en"),
    "opus-mt-target-tags": (lambda out: build_marian_dir(out, tags=("fra", "spa")), "de", "spa"),
    "nllb-200": (build_nllb_dir, "deu_Latn", "fra_Latn"),
    "m2m100": (build_m2m100_dir, "de", "fr"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    build, source, target = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = build(root / "hf")
    assert import_main(["--model", str(hf_dir), "--out", str(root / "ours")]) == 0
    export_tiny_onnx(root / "ours")
    return root / "ours", source, target


def count(tokens: tuple[int, ...], term: tuple[int, ...]) -> int:
    return sum(tokens[i : i + len(term)] == term for i in range(len(tokens) - len(term) + 1))


@pytest.mark.parametrize("beam_size", [1, 4])
def test_terms_are_forced_once_per_mention(family: tuple[Path, str, str], beam_size: int) -> None:
    directory, source, target = family
    model = onnx_model(directory)
    runner, tokenizer = runner_of(model), model.tokenizer
    sources = [tokenizer.encode_source(TEXT, target, source)] * 2
    forced = runner.spec.tag_ids[target] if runner.spec.forced_bos else None
    [[plain]] = translate_ids(runner, sources[:1], beam_size, 1.0, 24, forced_first=forced)
    spellable = [ids for term in CANDIDATE_TERMS if (ids := target_ids(tokenizer, term))]
    absent = [ids for ids in spellable if count(plain.tokens, ids) == 0]  # what the model does not write unasked
    assert len(absent) >= 2, "the tiny vocabulary spells too few of the terms"
    one, other = absent[0], absent[1]
    results = translate_ids(
        runner, sources, beam_size, 1.0, 24, forced_first=forced, terms=((one,), (one, other, other))
    )
    first, second = results[0][0].tokens, results[1][0].tokens
    assert count(first, one) == 1, (plain, first)
    assert count(second, one) >= 1 and count(second, other) >= 2, second
    if not set(one) & set(other):
        assert (count(second, one), count(second, other)) == (1, 2), second
    if forced is not None:
        assert first[0] == forced and second[0] == forced
