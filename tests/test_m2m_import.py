"""NLLB-200 and M2M100 import: tiny random M2M100ForConditionalGeneration checkpoints with each family's
tokenizer files, fetched by hub id from a hand-built Hugging Face cache, imported, checked equal to transformers
(tokenizer ids for every piece and language code, logits, greedy and beam-4 ids of generate with
forced_bos_token_id for several targets); another family is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.hf_parity import LOGIT_TOLERANCE, logit_diffs
from export.fetch import FetchError, HubSettings, download, parse_name, resolve_commit
from export.hf import main as import_main
from model.m2m_tokenizer import M2MTokenizer
from model.training.artifact import load_artifact
from model.training.decode import beam_search
from tests.hub_cache import block_network, hub_cache
from tests.m2m_tiny import build_m2m100_dir, build_nllb_dir, m2m100_tokenizer, nllb_tokenizer
from tests.test_hf_import import varied_texts

FAMILIES = {  # repository -> (builder, transformers' tokenizer, source languages, target languages)
    "facebook/nllb-200-distilled-600M": (
        build_nllb_dir,
        nllb_tokenizer,
        ["deu_Latn", "zho_Hant", "yue_Hant"],
        ["fra_Latn", "srp_Cyrl", "eng_Latn"],
    ),
    "facebook/m2m100_418M": (build_m2m100_dir, m2m100_tokenizer, ["de", "zh", "sr"], ["fr", "en", "pt"]),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    """(hub id, the transformers directory, our artifact imported from its cached snapshot by hub id)."""
    repo = request.param
    root = tmp_path_factory.mktemp(repo.split("/")[1])
    hf_dir = FAMILIES[repo][0](root / "hf")
    hub = HubSettings(hub_cache(root / "hub", hf_dir, repo=repo), offline=True)
    name = parse_name(repo)
    snapshot = download(name, resolve_commit(name, hub), hub)
    assert import_main(["--model", str(snapshot), "--out", str(root / "ours")]) == 0
    return repo, hf_dir, root / "ours"


def test_tokenizer_ids_equal_transformers_for_every_piece_and_code(family: tuple[str, Path, Path]) -> None:
    repo, hf_dir, ours_dir = family
    ours = M2MTokenizer(ours_dir)
    sources = FAMILIES[repo][2]
    texts = [t for t in varied_texts() if ">>" not in t]
    for source in sources:
        theirs = FAMILIES[repo][1](hf_dir, source)
        for text in texts:
            assert ours.encode_source(text, sources[0], source) == theirs(text).input_ids, (source, text)
        codes = {lang: theirs.convert_tokens_to_ids(piece) for lang, piece in json.loads(
            (ours_dir / "language_codes.json").read_text()).items()}  # fmt: skip
        assert ours.tag_ids == codes
        assert len(codes) == (202 if "nllb" in repo else 100)
    vocab = json.loads((ours_dir / "vocab.json").read_text())
    theirs_vocab = FAMILIES[repo][1](hf_dir, sources[0]).get_vocab()
    assert {piece: theirs_vocab[piece] for piece in vocab if piece in theirs_vocab} == {
        piece: i for piece, i in vocab.items() if piece in theirs_vocab
    }


def test_nllb_without_tokenizer_json_gets_the_same_ids_by_the_fairseq_offset(tmp_path: Path) -> None:
    hf_dir = build_nllb_dir(tmp_path / "hf")
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "with")]) == 0
    (hf_dir / "tokenizer.json").unlink()
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "without")]) == 0
    read = [json.loads((tmp_path / side / "vocab.json").read_text()) for side in ("with", "without")]
    assert read[0] == read[1]


def test_logits_and_ids_equal_generate_with_a_forced_target_code(family: tuple[str, Path, Path]) -> None:
    """Logits within 1e-4 (full and cached); greedy and beam-4 ids equal to generate(forced_bos_token_id=...)."""
    from transformers import M2M100ForConditionalGeneration

    repo, hf_dir, ours_dir = family
    hf = M2M100ForConditionalGeneration.from_pretrained(hf_dir).eval()
    ours, tokenizer = load_artifact(ours_dir), M2MTokenizer(ours_dir)
    sources, targets = FAMILIES[repo][2], FAMILIES[repo][3]
    texts = [text for text in varied_texts()[:6] if text.strip()]
    for source, target in zip(sources, targets, strict=True):
        code = tokenizer.tag_ids[target]
        for text in texts:
            src = tokenizer.encode_source(text, target, source)
            for beam in (1, 4):
                theirs = generated(hf, src, code, beam, max_len=12)
                mine = list(beam_search(ours, src, beam, 12, forced_first=code)[0].tokens)
                assert mine == theirs, (target, beam, text)
            full, cached = logit_diffs(ours, hf, src, theirs)
            assert max(full, cached) <= LOGIT_TOLERANCE, (target, text, full, cached)


@torch.no_grad()
def generated(hf: object, src: list[int], code: int, beam: int, max_len: int) -> list[int]:
    """generate()'s best ids after the start token (the forced code first), up to and without EOS."""
    out = hf.generate(  # type: ignore[attr-defined]
        input_ids=torch.tensor([src]), attention_mask=torch.ones(1, len(src), dtype=torch.long),
        forced_bos_token_id=code, num_beams=beam, max_new_tokens=max_len, length_penalty=1.0, do_sample=False,
    )[0].tolist()  # fmt: skip
    ids = out[1:]
    return ids[: ids.index(2)] if 2 in ids else ids


def test_the_artifact_carries_the_family_and_generation_settings(family: tuple[str, Path, Path]) -> None:
    repo, _, ours_dir = family
    config = json.loads((ours_dir / "config.json").read_text())
    assert (config["position_layout"], config["position_offset"], config["norm_placement"]) == ("fairseq", 2, "pre")
    assert (config["forced_bos"], config["tokenizer"], config["bos_id"], config["eos_id"]) == (True, "m2m", 2, 2)
    decoding = json.loads((ours_dir / "decoding.json").read_text())
    # NLLB's generation config sets no num_beams; m2m100_418M's sets 5 and early_stopping
    assert decoding["beam_size"] == (1 if "nllb" in repo else 5)
    assert config["patient_beam"] is ("nllb" in repo)


def test_another_family_is_refused_by_its_model_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hf_dir = build_nllb_dir(tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text()) | {"model_type": "t5"}
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said == ("export.hf: error: model_type is 't5'; the importer carries m2m_100 (NLLB-200, M2M100), "
                    "marian (OPUS-MT)")  # fmt: skip
    block_network(monkeypatch.setattr)
    hub = HubSettings(hub_cache(tmp_path / "hub", hf_dir, repo="google/t5-small"), offline=True)
    name = parse_name("google/t5-small")
    with pytest.raises(FetchError, match="the importer cannot carry this model: model_type is 't5'; the importer"):
        download(name, resolve_commit(name, hub), hub)


def test_a_cached_nllb_snapshot_without_its_tokenizer_names_the_file(tmp_path: Path) -> None:
    hf_dir = build_nllb_dir(tmp_path / "hf")
    (hf_dir / "sentencepiece.bpe.model").unlink()
    hub = HubSettings(hub_cache(tmp_path / "hub", hf_dir, repo="facebook/nllb-200-distilled-600M"), offline=True)
    name = parse_name("facebook/nllb-200-distilled-600M")
    with pytest.raises(FetchError, match=r"lacks sentencepiece\.bpe\.model and HF_HUB_OFFLINE is set"):
        download(name, resolve_commit(name, hub), hub)
