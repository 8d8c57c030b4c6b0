"""OPUS-MT (Marian) import: tiny random MarianMTModel checkpoints, shared and separate vocabularies, imported,
checked equal to transformers (logits, cached logits, greedy and beam ids, tokenizer ids), exported and served."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.hf_parity import LOGIT_TOLERANCE, compare, logit_diffs, transformers_ids
from export.hf import main as import_main
from model.directions import Directions
from model.marian_tokenizer import MarianTokenizer
from model.training.artifact import load_artifact
from model.training.transformer import Transformer
from tests.marian_tiny import build_marian_dir, marian_tokenizer
from tests.serving import export_tiny_onnx, onnx_model, request, running_server
from tests.tiny import TINY_PAIRS

LAYOUTS = ["shared", "separate"]


@pytest.fixture(scope="module", params=LAYOUTS)
def imported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(transformers directory, our artifact imported from it)."""
    root = tmp_path_factory.mktemp(f"marian_{request.param}")
    hf_dir = build_marian_dir(root / "hf", separate_vocabs=request.param == "separate")
    assert import_main(["--model", str(hf_dir), "--out", str(root / "ours")]) == 0
    return hf_dir, root / "ours"


def varied_texts() -> list[str]:
    """A few hundred texts: the tiny corpus and variations of case, digits, spacing, punctuation, scripts."""
    base = [text for pair in TINY_PAIRS for text in pair]
    variants = [
        lambda t: t.upper(), lambda t: t.lower(), lambda t: f"  {t}  ", lambda t: t.replace(" ", "  "),
        lambda t: f"{t} 1234, 5.6%", lambda t: f"«{t}»", lambda t: f"{t} \u2013 ¿qué? 東京 😀",
        lambda t: t[: len(t) // 2], lambda t: f"{t} >>fr<<", lambda t: f"{t}\t{t[::-1]}",
        lambda t: t.replace("e", "é"), lambda t: f"{t}\u00a0!",
    ]  # fmt: skip
    return base + [vary(text) for vary in variants for text in base] + ["", " ", "x"]


def test_tokenizer_ids_equal_marian_tokenizer(imported: tuple[Path, Path]) -> None:
    hf_dir, ours_dir = imported
    theirs, ours = marian_tokenizer(hf_dir), MarianTokenizer(ours_dir)
    texts = varied_texts()
    assert len(texts) >= 250
    for text in texts:
        assert ours.encode_source(text, "en") == theirs(text).input_ids, text
    # Deliberate differences: a typed special token or leading >>xx<< stays text here, where MarianTokenizer
    # would turn it into the control id (an early end of the source, or a steered target language).
    for typed in ("</s> Haus", ">>fr<< Haus", "<pad>"):
        assert ours.eos_id not in ours.encode_source(typed, "en")[:-1], typed


def test_logits_and_ids_equal_transformers(imported: tuple[Path, Path]) -> None:
    """Logits within 1e-4 (full and cached), greedy and beam-4 ids equal to generate."""
    hf_dir, ours_dir = imported
    tokenizer = MarianTokenizer(ours_dir)
    sources = [tokenizer.encode_source(de, "en") for de, _ in TINY_PAIRS[:10]]
    report = compare(hf_dir, ours_dir, sources, beam_size=4, max_len=16)
    assert report.max_logit_diff <= LOGIT_TOLERANCE and report.max_cached_logit_diff <= LOGIT_TOLERANCE, report
    assert report.passed, report


@pytest.mark.parametrize(
    "change",
    [{"activation": "relu"}, {"norm_placement": "pre"}, {"position_layout": "interleaved"}, {"scale_embedding": False}],
)
def test_each_marian_difference_shows_in_the_logits(imported: tuple[Path, Path], change: dict[str, Any]) -> None:
    """The parity above can fail: leaving out any modelled difference moves the logits far past 1e-4."""
    from transformers import MarianMTModel

    hf_dir, ours_dir = imported
    ours = load_artifact(ours_dir)
    other = Transformer(replace(ours.cfg, **change))
    other.load_state_dict(ours.state_dict(), strict=False)  # pre-norm adds final norms: left at identity
    hf = MarianMTModel.from_pretrained(hf_dir).eval()
    src = MarianTokenizer(ours_dir).encode_source(TINY_PAIRS[0][0], "en")
    with torch.no_grad():
        assert logit_diffs(ours, hf, src, [3, 4, 5])[0] <= LOGIT_TOLERANCE
        assert logit_diffs(other.eval(), hf, src, [3, 4, 5])[0] > 100 * LOGIT_TOLERANCE


def test_pad_is_never_produced(imported: tuple[Path, Path]) -> None:
    ours = load_artifact(imported[1])
    logits = torch.zeros(2, ours.cfg.vocab_size)
    logits[:, ours.cfg.pad_id] = 50.0  # pad would win by far
    log_probs = ours.log_probs(logits)
    assert (log_probs.argmax(-1) != ours.cfg.pad_id).all()
    others = torch.cat([log_probs[:, : ours.cfg.pad_id], log_probs[:, ours.cfg.pad_id + 1 :]], dim=1)
    torch.testing.assert_close(others, logits.log_softmax(-1)[:, : others.size(1)])  # not renormalised


def test_imported_artifact_records_languages_defaults_and_licence(imported: tuple[Path, Path]) -> None:
    _, ours_dir = imported
    assert json.loads((ours_dir / "languages.json").read_text()) == {"pairs": [["de", "en"]]}
    decoding = json.loads((ours_dir / "decoding.json").read_text())
    assert (decoding["beam_size"], decoding["max_output_len"], decoding["length_penalty"]) == (4, 23, {"de-en": 1.0})
    card = (ours_dir / "MODEL_CARD.md").read_text()
    assert "hf" in card and "Licence" in card and "de->en" in card


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"activation_function": "tanh"}, "activation_function 'tanh'"),
        ({"normalize_embedding": True}, "normalize_embedding"),
        ({"model_type": "bart"}, "model_type is 'bart'; the importer carries m2m_100 (NLLB-200, M2M100), marian"),
        ({"decoder_ffn_dim": 8}, "encoder_ffn_dim != decoder_ffn_dim"),
        ({"pad_token_id": 5}, "</s>, <pad> ids"),
    ],
)
def test_unrepresentable_models_fail_the_import_clearly(
    imported: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    patch: dict[str, object],
    message: str,
) -> None:
    hf_dir = tmp_path / "hf"
    shutil.copytree(imported[0], hf_dir)
    config = json.loads((hf_dir / "config.json").read_text()) | patch
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


def patched_generation(imported: tuple[Path, Path], tmp_path: Path, patch: dict[str, object]) -> Path:
    """A copy of the tiny checkpoint whose generation_config.json is `patch`ed (None removes a key)."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(imported[0], hf_dir)
    gen = json.loads((hf_dir / "generation_config.json").read_text()) | patch
    (hf_dir / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}))
    return hf_dir


@pytest.mark.parametrize(
    "patch",
    [{"no_repeat_ngram_size": 2}, {"repetition_penalty": 1.3}, {"do_sample": True}, {"min_length": 5},
     {"begin_suppress_tokens": [7]}, {"watermarking_config": {"greenlist_ratio": 0.25}},
     {"guidance_scale": 1.5}, {"length_penalty": 2.5}, {"length_penalty": -0.5}, {"eos_token_id": "EOS and 5"},
     {"eos_token_id": 5}, {"decoder_start_token_id": 5}],
)  # fmt: skip
def test_generation_settings_the_decoder_does_not_apply_fail_the_import(
    imported: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], patch: dict[str, object]
) -> None:
    """generate() applies them from the same file, so serving the model without them would translate otherwise.
    Broken once on purpose (the keys not read, as before), no_repeat_ngram_size 2 and repetition_penalty 1.3
    imported with exit 0 and every served greedy and beam-4 translation of a probe differed from generate()'s; and
    once, ids of the generation config's own unchecked: an `eos_token_id` other than config.json's, or a list of
    several, imported, served text went on where generate() stopped. A length penalty outside what the server
    serves is refused at import too, not at the first start after a build was published."""
    config = json.loads((imported[0] / "config.json").read_text())
    if patch.get("eos_token_id") == "EOS and 5":
        patch = {"eos_token_id": [config["eos_token_id"], 5]}
    hf_dir = patched_generation(imported, tmp_path, patch)
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "out")]) == 2
    (key,) = patch
    err = capsys.readouterr().err
    assert key in err and "its generation config" in err, err


def test_the_pad_ban_and_the_new_token_limit_come_from_the_generation_config(
    imported: tuple[Path, Path], tmp_path: Path
) -> None:
    """Without bad_words_ids generate() may produce pad (transformers bans it through that setting alone)."""
    hf_dir = patched_generation(imported, tmp_path, {"bad_words_ids": None, "max_new_tokens": 17})
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["ban_pad"] is False
    assert json.loads((tmp_path / "out" / "decoding.json").read_text())["max_output_len"] == 17
    assert json.loads((imported[1] / "config.json").read_text())["ban_pad"] is True


def test_served_translations_equal_transformers(imported: tuple[Path, Path], tmp_path: Path) -> None:
    """Export, load in the server, translate over gRPC: the text of generate()'s ids, greedy and beam 4."""
    from transformers import MarianMTModel

    hf_dir, ours_dir = imported
    model_dir = tmp_path / "model"
    shutil.copytree(ours_dir, model_dir)
    export_tiny_onnx(model_dir)
    hf = MarianMTModel.from_pretrained(hf_dir).eval()
    tokenizer = MarianTokenizer(model_dir)
    texts = [de for de, _ in TINY_PAIRS[:6]]
    model = onnx_model(model_dir)
    assert model.runner.spec.directions == Directions.of_pairs((("de", "en"),))
    with running_server(model) as served:
        for beam, max_len in ((1, 12), (4, 12), (0, 0)):
            options: dict[str, Any] = {"beam_size": beam, "max_output_len": max_len} if beam else {}
            reply = served.stub.Translate(request(texts, **options))
            # unset: the model's generation defaults (num_beams 4, max_length 24 with the start token)
            beam, max_len = beam or 4, max_len or 23
            for text, result in zip(texts, reply.results, strict=True):
                ids = transformers_ids(hf, tokenizer.encode_source(text, "en"), beam, max_len)
                assert result.translation == tokenizer.decode(ids), (beam, text)


# Per layout, a random model whose beams need the patience on TINY_PAIRS (seed 0's separate-vocabulary model
# needs it on none of 473 sources; seed 1's on 11 of these 40)
PATIENCE_SEEDS = {"shared": 0, "separate": 1}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_beam_search_goes_on_past_k_finished_as_generate_does_by_default(layout: str, tmp_path: Path) -> None:
    """generate()'s default `early_stopping=False` decodes on while a live beam could still beat the K-th
    finished one: the import carries it (`patient_beam`), and the reference and the served path follow it.
    Stopping at K finished instead, as both did before, gives other ids on some of these sources (the probe
    that found it: 2-5 of 12 beam-4 inputs per tiny model), in each layout.

    Deliberate break: the import carrying `patient_beam` only for a shared vocabulary (`and not cfg.src_vocab_size`
    in the importers' `ending`) fails it for "separate"."""
    from transformers import MarianMTModel

    from model.training.decode import beam_search

    hf_dir = build_marian_dir(tmp_path / "hf", separate_vocabs=layout == "separate", seed=PATIENCE_SEEDS[layout])
    ours_dir = tmp_path / "ours"
    assert import_main(["--model", str(hf_dir), "--out", str(ours_dir)]) == 0
    assert json.loads((ours_dir / "config.json").read_text())["patient_beam"] is True
    hf = MarianMTModel.from_pretrained(hf_dir).eval()
    tokenizer, ours = MarianTokenizer(ours_dir), load_artifact(ours_dir)
    impatient = load_artifact(ours_dir)
    impatient.cfg = dataclasses.replace(impatient.cfg, patient_beam=False)
    texts = [text for pair in TINY_PAIRS for text in pair]  # the English too: more sources, random weights
    expected, differs = [], 0
    for text in texts:
        src = tokenizer.encode_source(text, "en")
        ids = transformers_ids(hf, src, 4, 23)
        assert list(beam_search(ours, src, 4, 23)[0].tokens) == ids, text
        differs += list(beam_search(impatient, src, 4, 23)[0].tokens) != ids
        expected.append(tokenizer.decode(ids))
    assert differs, "no source where patience matters: the test would pass without it"
    model_dir = tmp_path / "model"
    shutil.copytree(ours_dir, model_dir)
    export_tiny_onnx(model_dir)
    with running_server(onnx_model(model_dir)) as served:
        reply = served.stub.Translate(request(texts, beam_size=4, max_output_len=23))
    single = [(r.translation, e) for r, e in zip(reply.results, expected, strict=True) if r.sentences == 1]
    assert len(single) >= len(texts) - 2 and all(got == want for got, want in single)  # one sentence: one decode


def test_beam_search_that_stops_at_k_finished_keeps_the_k_best_as_generate_does(tmp_path: Path) -> None:
    """A generation config with `early_stopping: true` stops at K finished, as generate() does: every EOS among a
    step's K best candidates joins the pool however many finished before it in that step, and at the output limit
    the live candidates among the K best finish too, the K best of all kept. (Broken once on purpose, as both
    paths were: the step stopped reading candidates at the K-th finished one, and at the limit dropped the live
    ones if the pool was full: other n-best lists, and other best outputs where the limit binds.)"""
    from transformers import MarianMTModel

    from model.training.decode import beam_search

    hf_dir = build_marian_dir(tmp_path / "hf")
    config = json.loads((hf_dir / "generation_config.json").read_text())
    (hf_dir / "generation_config.json").write_text(json.dumps(config | {"early_stopping": True}))
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "ours")]) == 0
    hf = MarianMTModel.from_pretrained(hf_dir).eval()
    tokenizer, ours = MarianTokenizer(tmp_path / "ours"), load_artifact(tmp_path / "ours")
    assert not ours.cfg.patient_beam
    texts = [text for pair in TINY_PAIRS for text in pair]
    cases = [(text, beam, limit) for text in texts for beam in (2, 4) for limit in (3, 5, 12)]
    for text, beam, limit in cases:
        src = tokenizer.encode_source(text, "en")
        out = hf.generate(
            input_ids=torch.tensor([src]), attention_mask=torch.ones(1, len(src), dtype=torch.long),
            num_beams=beam, max_new_tokens=limit, length_penalty=1.0, num_return_sequences=beam,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
        eos = hf.config.eos_token_id
        want = [[t for t in row[1:] if t not in (eos, hf.config.pad_token_id)] for row in out.sequences.tolist()]
        got = beam_search(ours, src, beam, limit)[:beam]
        assert [list(h.tokens) for h in got] == want, (text, beam, limit)
        assert [h.normalized for h in got] == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)
    model_dir = tmp_path / "model"
    shutil.copytree(tmp_path / "ours", model_dir)
    export_tiny_onnx(model_dir)
    with running_server(onnx_model(model_dir)) as served:
        for beam, limit in ((2, 5), (4, 12)):
            reply = served.stub.Translate(request(texts, beam_size=beam, max_output_len=limit, num_hypotheses=beam))
            for text, result in zip(texts, reply.results, strict=True):
                if result.sentences != 1:  # several sentences: several decodes, no one generate() to compare
                    continue
                src = tokenizer.encode_source(text, "en")
                expected = [tokenizer.decode(list(h.tokens)) for h in beam_search(ours, src, beam, limit)[:beam]]
                assert [h.text for h in result.hypotheses] == expected, (text, beam, limit)


def test_reference_targets_equal_marian_tokenizer(imported: tuple[Path, Path]) -> None:
    hf_dir, ours_dir = imported
    theirs, ours = marian_tokenizer(hf_dir), MarianTokenizer(ours_dir)
    for _, en in TINY_PAIRS:
        assert ours.encode_target(en) == theirs(text_target=en).input_ids, en


def test_export_variants_gate_and_parity_run_on_an_imported_model(imported: tuple[Path, Path], tmp_path: Path) -> None:
    """The project's own pipeline on an import: fp32, int8 (this CPU's recipe) and fp16 graphs; ONNX parity
    against our PyTorch on the test set's de->en pairs; the BLEU gate recorded for the one direction it has."""
    from bench.parity import main as parity_main
    from export.__main__ import main as export_main
    from server.gates.variants import main as variants_main
    from tests.conftest import int8_args_for_this_cpu

    model_dir = tmp_path / "model"
    shutil.copytree(imported[1], model_dir)
    assert export_main(["--model-dir", str(model_dir), "--variants", "fp32,int8,fp16", *int8_args_for_this_cpu()]) == 0
    assert parity_main(["--model-dir", str(model_dir), "--limit", "12"]) == 0
    assert variants_main(["--model-dir", str(model_dir), "--limit", "2", "--beam-size", "2"]) == 0
    record = json.loads((model_dir / "variants.json").read_text())["cpu"]
    assert set(record["variants"]) == {"fp32", "int8", "fp16"}
    assert all("de-en" in scores and "en-de" not in scores for scores in record["variants"].values())


def test_ctranslate2_converter_on_the_same_directory_yields_the_same_ids(
    imported: tuple[Path, Path], tmp_path: Path
) -> None:
    """The peer's converter (`ct2-transformers-converter`) agrees with our import, greedy and beam 4, its beam
    search stopping as ours does without patience (at K finished: CTranslate2 reads no `early_stopping`).
    It handles the shared-vocabulary layout only (its MarianMTLoader has no second vocabulary)."""
    import subprocess
    import sys

    import ctranslate2

    from model.training.decode import beam_search

    hf_dir, ours_dir = imported
    if (hf_dir / "target_vocab.json").is_file():
        pytest.skip("CTranslate2's Marian converter does not handle separate vocabularies")
    converter = Path(sys.executable).parent / "ct2-transformers-converter"
    subprocess.run([str(converter), "--model", str(hf_dir), "--output_dir", str(tmp_path / "ct2")], check=True)
    vocabulary = json.loads((tmp_path / "ct2" / "shared_vocabulary.json").read_text())
    index = {piece: i for i, piece in enumerate(vocabulary)}
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    tokenizer, ours = MarianTokenizer(ours_dir), load_artifact(ours_dir)
    assert ours.cfg.patient_beam  # the import carries generate()'s default ...
    ours.cfg = dataclasses.replace(ours.cfg, patient_beam=False)  # ... which CTranslate2 does not follow
    sources = [tokenizer.encode_source(de, "en") for de, _ in TINY_PAIRS]
    for beam in (1, 4):
        results = translator.translate_batch(
            [[vocabulary[i] for i in src] for src in sources], beam_size=beam, max_decoding_length=20,
            min_decoding_length=0, length_penalty=1.0,
        )  # fmt: skip
        for src, result in zip(sources, results, strict=True):
            theirs = [index[piece] for piece in result.hypotheses[0]]
            assert theirs == list(beam_search(ours, src, beam, 20)[0].tokens), (beam, src)


@pytest.mark.parametrize(
    "field", [{"activation": "tanh"}, {"norm_placement": "sandwich"}, {"position_layout": "rotary"}]
)
def test_model_config_refuses_what_the_transformer_does_not_implement(field: dict[str, Any]) -> None:
    from model.config import ModelConfig

    with pytest.raises(ValueError, match=next(iter(field))):
        ModelConfig(**field)


def test_the_default_options_add_no_parameters() -> None:
    """This project's own model: the options off, its state dict is the one the shipped weights load into."""
    from model.config import ModelConfig

    names = set(Transformer(ModelConfig(vocab_size=32, d_model=16, n_heads=2, d_ff=32)).state_dict())
    assert "logits_bias" not in names and not any(n.startswith("src_embed") for n in names)
    assert {"encoder_norm.weight", "decoder_norm.weight", "embed.weight"} <= names
    post = Transformer(ModelConfig(vocab_size=32, d_model=16, n_heads=2, d_ff=32, norm_placement="post"))
    assert not any(n.startswith(("encoder_norm", "decoder_norm")) for n in post.state_dict())


def test_a_multilingual_model_translates_into_each_tagged_language(tmp_path: Path) -> None:
    """>>xx<< tags in the vocabulary: one pair per tag, and the request's target language becomes the tag in
    front of the source, as MarianTokenizer reads a text that starts with it."""
    hf_dir = build_marian_dir(tmp_path / "hf", tags=(">>fr<<", ">>es<<"))
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "ours"), "--source-lang", "de"]) == 0
    assert json.loads((tmp_path / "ours" / "languages.json").read_text()) == {"pairs": [["de", "es"], ["de", "fr"]]}
    ours, theirs = MarianTokenizer(tmp_path / "ours"), marian_tokenizer(hf_dir)
    for target in ("fr", "es"):
        for de, _ in TINY_PAIRS[:5]:
            assert ours.encode_source(de, target) == theirs(f">>{target}<< {de}").input_ids


def test_what_the_files_cannot_back_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Broken once on purpose (sizes and tags unchecked), a separate-vocabulary model without target_vocab.json
    imported and decoded its ids through the source's pieces, and --target-lang de on a model tagged >>deu<<
    imported with no tag at all."""
    separate = build_marian_dir(tmp_path / "separate", separate_vocabs=True)
    (separate / "target_vocab.json").unlink()
    assert import_main(["--model", str(separate), "--out", str(tmp_path / "a")]) == 2
    assert "keeps two vocabularies" in capsys.readouterr().err
    tagged = build_marian_dir(tmp_path / "opus-mt-en-mul", tags=(">>deu<<", ">>nld<<"))
    assert import_main(["--model", str(tagged), "--out", str(tmp_path / "b"), "--target-lang", "de"]) == 0
    assert json.loads((tmp_path / "b" / "languages.json").read_text())["pairs"][0][1] == "deu"  # the tag's own code
    assert import_main(["--model", str(tagged), "--out", str(tmp_path / "c"), "--target-lang", "fr"]) == 2
    assert "--target-lang fr is none of the model's target tags (deu, nld)" in capsys.readouterr().err


def test_a_separate_vocabulary_model_with_tags_decodes_every_target_piece(tmp_path: Path) -> None:
    """Tags live in the source vocabulary: a target id equal to a tag's source id is an ordinary target piece (once
    taken for a tag and dropped, so that "and" came back "nd"). Served translations are generate's ids read through
    the checkpoint's own target_vocab.json and target.spm, its </s>, <pad> and <unk> left out (transformers'
    tokenizer is no reference here: it reads target ids equal to the source's special ids as those specials)."""
    from transformers import MarianMTModel

    hf_dir = build_marian_dir(tmp_path / "hf", separate_vocabs=True, tags=(">>fr<<", ">>es<<"), layout="tc-big")
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "ours"), "--source-lang", "de"]) == 0
    ours = MarianTokenizer(tmp_path / "ours")
    shadowed = [ours.target_pieces[i] for i in ours.tag_ids.values()]
    assert not any(piece.startswith(">>") for piece in shadowed), "no target piece shares a tag's id: nothing tested"

    import sentencepiece as spm

    target_spm = spm.SentencePieceProcessor(model_file=str(hf_dir / "target.spm"))
    checkpoint_pieces = {i: p for p, i in json.loads((hf_dir / "target_vocab.json").read_text()).items()}

    def read(ids: list[int]) -> str:
        pieces = [checkpoint_pieces[i] for i in ids if checkpoint_pieces[i] not in ("</s>", "<pad>", "<unk>")]
        return str(target_spm.decode_pieces(pieces)).strip()

    for _, en in TINY_PAIRS[:8]:
        ids = ours.encode_target(en)[:-1]
        assert ours.decode(ids) == read(ids), en
    export_tiny_onnx(tmp_path / "ours")
    hf = MarianMTModel.from_pretrained(hf_dir).eval()
    sources = [de for de, _ in TINY_PAIRS[:4]]
    with running_server(onnx_model(tmp_path / "ours")) as served:
        reply = served.stub.Translate(request(sources, "de", "fr", beam_size=2, max_output_len=10))
    for de, result in zip(sources, reply.results, strict=True):
        ids = transformers_ids(hf, ours.encode_source(de, "fr"), 2, 10)
        assert result.translation == read(ids), de


def test_the_weights_are_written_one_tensor_at_a_time_as_safetensors_reads_them(tmp_path: Path) -> None:
    """`write_weights` (the import's writer, which holds one tensor at a time) against safetensors' own reader:
    float32 out of any float in, names and shapes kept, an empty tensor too; a tensor of another shape than the
    header announced is refused."""
    import numpy as np
    from safetensors.numpy import load_file

    from export.importers.files import UnsupportedModel, write_weights

    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {
        "decoder.0.ff.w1.weight": rng.normal(size=(3, 5)).astype(np.float32),
        "embed.weight": rng.normal(size=(7, 2)).astype(np.float16),
        "logits_bias": np.zeros((0,), np.float32),
        "encoder_norm.bias": rng.normal(size=(5,)).astype(np.float32),
    }
    shapes = {name: array.shape for name, array in tensors.items()}
    write_weights(tmp_path / "model.safetensors", tensors, shapes)
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert loaded.keys() == tensors.keys()
    for name, array in tensors.items():
        assert loaded[name].dtype == np.float32, name
        np.testing.assert_array_equal(loaded[name], array.astype(np.float32), err_msg=name)
    with pytest.raises(UnsupportedModel, match="where its header said"):
        write_weights(tmp_path / "other.safetensors", tensors, {**shapes, "embed.weight": (2, 7)})
