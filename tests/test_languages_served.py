"""Every language an OPUS-MT model serves works end to end: tiny random Marians in both release layouts
(classic and tc-big) whose sources have no pysbd rules (Latin script, Korean, Hebrew) or have them
(French), multilingual target tags as clients name them, and generate()'s ending at the output limit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench.hf_parity import transformers_ids
from bench.marian_random import Languages, build_marian_dir
from export.hf import main as import_main
from model.marian_tokenizer import MarianTokenizer
from model.training.artifact import load_artifact
from model.training.decode import beam_search
from server.proto.translation.v1 import translation_pb2 as pb
from server.text.splitter import PUNCTUATION, rule_for, split
from tests.serving import export_tiny_onnx, onnx_model, request, running_server

ENGLISH = [
    "The house is big.", "I have no time.", "Where is the station?", "The rain stopped.",
    "He waited nervously.", "They wrote a book together.", "So you think it is all over?", "Come here!",
]  # fmt: skip
SOURCES = {
    "fr": ["La maison est grande.", "Je n'ai pas le temps.", "Où est la gare ?", "La pluie a cessé.",
           "Il attendait nerveusement.", "Ils ont écrit un livre ensemble.", "Alors tu crois que c'est fini ?",
           "Viens ici !"],
    "sw": ["Nyumba ni kubwa.", "Sina muda.", "Kituo kiko wapi?", "Mvua ilikoma.", "Alisubiri kwa wasiwasi.",
           "Waliandika kitabu pamoja.", "Kwa hiyo unadhani yote yamekwisha?", "Njoo hapa!"],
    "ko": ["집이 큽니다.", "시간이 없어요.", "역이 어디에 있어요?", "비가 그쳤다.", "그는 초조하게 기다렸다.",
           "그들은 함께 책을 썼다.", "그래서 다 끝났다고 생각해?", "이리 와!"],
    "he": ["הבית גדול.", "אין לי זמן.", "איפה התחנה?", "הגשם פסק.", "הוא חיכה בעצבנות.", "הם כתבו ספר יחד.",
           "אז אתה חושב שהכול נגמר?", "בוא הנה!"],
}  # fmt: skip


def served_marian(root: Path, source: str, layout: str, tags: tuple[str, ...] = (), **build: Any) -> Path:
    """A tiny random Marian from `source` into English (or into its tags), imported and exported."""
    texts = tuple(zip(SOURCES.get(source, ENGLISH), ENGLISH, strict=True))
    hf_dir = build_marian_dir(root / "hf", layout=layout, languages=Languages(source, "en", texts), tags=tags, **build)
    assert import_main(["--model", str(hf_dir), "--out", str(root / "model")]) == 0
    export_tiny_onnx(root / "model")
    return hf_dir


@pytest.mark.parametrize(
    ("source", "layout"), [("sw", "classic"), ("ko", "tc-big"), ("he", "classic"), ("fr", "tc-big")]
)
def test_multi_sentence_texts_in_languages_with_and_without_pysbd_rules_are_translated(
    tmp_path: Path, source: str, layout: str
) -> None:
    """Each text splits by its language's rule and every sentence is translated: never INTERNAL."""
    served_marian(tmp_path, source, layout)
    sentences = SOURCES[source]
    texts = [" ".join(sentences[:3]), "\n".join(sentences[3:6]), f"{sentences[6]} {sentences[7]}"]
    assert (rule_for(source) == PUNCTUATION) == (source != "fr")
    model = onnx_model(tmp_path / "model")
    with running_server(model) as served:
        for call in (served.stub.Translate, lambda r: served.stub.TranslateStream(r)):
            reply = call(request(texts, source, "en", beam_size=2))
            results = reply.results if isinstance(reply, pb.TranslateResponse) else [m.result for m in reply]
            assert sorted(r.sentences for r in results) == [2, 3, 3]
            for result in results:
                assert result.sentences == len(split(texts[result.index], source).pieces)


@pytest.mark.parametrize(("layout", "forced_eos"), [("tc-big", None), ("classic", True)])
def test_outputs_at_the_limit_end_as_generate_ends_them(tmp_path: Path, layout: str, forced_eos: bool | None) -> None:
    """tc-big: EOS forced at the limit and the pad ban before normalising (renormalize_logits); classic
    with forced_eos_token_id alone. Greedy and beam 4, limits that bind and the model's own default."""
    from transformers import MarianMTModel

    hf_dir = served_marian(tmp_path, "fr", layout, forced_eos=forced_eos)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["forced_eos_at_limit"] and config["renormalize_logits"] == (layout == "tc-big")
    hf = MarianMTModel.from_pretrained(hf_dir).eval()
    reference = load_artifact(tmp_path / "model")  # the PyTorch reference decode ends them the same way
    tokenizer = MarianTokenizer(tmp_path / "model")
    texts = SOURCES["fr"]
    model = onnx_model(tmp_path / "model")
    at_limit = 0
    with running_server(model) as served:
        for beam, max_len in ((1, 3), (4, 3), (1, 6), (4, 6), (4, 0)):
            options = {"max_output_len": max_len} if max_len else {}
            reply = served.stub.Translate(request(texts, "fr", "en", beam_size=beam, **options))
            max_len = max_len or 23  # the model's generation default: max_length 24 with the start token
            for text, result in zip(texts, reply.results, strict=True):
                source = tokenizer.encode_source(text, "en")
                ids = transformers_ids(hf, source, beam, max_len)
                assert result.translation == tokenizer.decode(ids), (beam, max_len, text)
                assert list(beam_search(reference, source, beam, max_len)[0].tokens) == ids, (beam, max_len, text)
                at_limit += len(ids) == max_len - 1  # generate put EOS in the last place
    assert at_limit >= 8, "the limits must bind for the test to mean something"


MULTILINGUAL_TAGS = (">>por<<", ">>pob<<", ">>cmn_Hans<<", ">>zho_Hant<<", ">>arz<<", ">>ary<<")


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("multilingual")
    hf_dir = served_marian(root, "en", "tc-big", tags=MULTILINGUAL_TAGS)
    return hf_dir, root / "model"


@pytest.mark.parametrize(
    ("client", "tag"),
    [("pt", "por"), ("por", "por"), ("pt-PT", "por"), ("pt-BR", "pob"), ("pob", "pob"), ("zh", "cmn_Hans"),
     ("zh-CN", "cmn_Hans"), ("zh-TW", "zho_Hant"), ("zh-Hant", "zho_Hant"), ("cmn_Hans", "cmn_Hans")],
)  # fmt: skip
def test_client_language_codes_reach_the_right_target_tag(
    multilingual: tuple[Path, Path], client: str, tag: str
) -> None:
    """Translations equal generate() fed the tag the code means, for every spelling a client uses."""
    from transformers import MarianMTModel

    hf_dir, model_dir = multilingual
    hf = MarianMTModel.from_pretrained(hf_dir).eval()
    tokenizer = MarianTokenizer(model_dir)
    model = onnx_model(model_dir)
    with running_server(model) as served:
        reply = served.stub.Translate(request(ENGLISH[:4], "en-US", client, beam_size=2, max_output_len=8))
    for text, result in zip(ENGLISH[:4], reply.results, strict=True):
        ids = transformers_ids(hf, tokenizer.encode_source(text, tag), 2, 8)
        assert result.translation == tokenizer.decode(ids), (client, text)


def test_list_models_reports_each_pair_with_its_codes_and_tag(multilingual: tuple[Path, Path]) -> None:
    with running_server(onnx_model(multilingual[1])) as served:
        (info,) = served.stub.ListModels(pb.ListModelsRequest()).models
    pairs = {(p.source, p.target): (p.source_bcp47, p.target_bcp47, p.target_tag) for p in info.pairs}
    assert pairs[("en", "pob")] == ("en", "pt-BR", ">>pob<<")
    assert pairs[("en", "cmn_Hans")] == ("en", "zh-Hans", ">>cmn_Hans<<")
    assert pairs[("en", "arz")] == ("en", "arz", ">>arz<<")


@pytest.mark.parametrize(
    ("source", "target", "message"),
    [
        ("en", "ar", "'ar' could mean any of ary, arz: send one of them"),
        ("en", "fr", "unsupported language pair 'en' -> 'fr'; supported pairs: model: en-ary, en-arz"),
        ("klingon", "pt", "unsupported language pair 'klingon' -> 'pt'"),
        ("en", "", "options.target_language is required"),
    ],
)
def test_unknown_and_ambiguous_codes_are_invalid_argument_naming_what_is_served(
    multilingual: tuple[Path, Path], source: str, target: str, message: str
) -> None:
    with running_server(onnx_model(multilingual[1])) as served, pytest.raises(grpc.RpcError) as failed:
        served.stub.Translate(request(["Hello."], source, target))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (failed.value.details() or "")
    assert "en-pob (en-pt-BR)" in (failed.value.details() or "")


@pytest.mark.parametrize(
    ("card", "sources"),
    [("*  model: transformer\n* source language(s): bel bel_Latn orv_Cyrl rue rus ukr\n* raw source language(s): bel"
      " rus\n* target language(s): eng\n", ["bel", "bel_Latn", "orv_Cyrl", "rue", "rus", "ukr"]),
     ("## Model info\n\n- **Source Language(s):** bel rus ukr\n- **Target Language(s):** eng\n", ["bel", "rus", "ukr"]),
     ("### zle-eng\n\n* source group: East Slavic languages\n", ["zle"])],
)  # fmt: skip
def test_a_family_source_reads_the_languages_its_model_card_lists(
    tmp_path: Path, card: str, sources: list[str]
) -> None:
    """opus-mt-zle-en reads Belarusian, Russian and Ukrainian, as its card says, not any language: a family read as
    "any" took German and Japanese into it without a word. (Broken once on purpose, the card not read: its one
    source stayed `zle`.) A card that lists none leaves the family, which routing ranks below `mul`."""
    hf_dir = build_marian_dir(tmp_path / "opus-mt-zle-en", layout="tc-big")
    (hf_dir / "tokenizer_config.json").unlink()
    (hf_dir / "README.md").write_text(f"---\nlicense: apache-2.0\n---\n\n{card}")
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "ours")]) == 0
    pairs = json.loads((tmp_path / "ours" / "languages.json").read_text())["pairs"]
    assert pairs == [[source, "en"] for source in sources]


@pytest.mark.parametrize(
    ("name", "pairs"),
    [("opus-mt-tc-big-en-fr", [["en", "fr"]]),
     ("opus-mt-tc-big-cat_oci_spa-en", [["cat", "en"], ["oci", "en"], ["spa", "en"]]),
     ("opus-mt-tc-bible-big-deu_eng_fra-gmw", [["deu", "gmw"], ["eng", "gmw"], ["fra", "gmw"]]),
     ("opus-mt-en-zh_Hant", [["en", "zh_Hant"]])],
)  # fmt: skip
def test_languages_come_from_the_models_name_where_its_tokenizer_config_has_none(
    tmp_path: Path, name: str, pairs: list[list[str]]
) -> None:
    """Broken before `_` lists were read, opus-mt-tc-big-cat_oci_spa-en served one source, `cat_oci_spa` (Catalan
    with two odd subtags): Spanish and Occitan were refused; a tc-bible-big name gave no languages at all."""
    hf_dir = build_marian_dir(tmp_path / name, layout="tc-big")
    (hf_dir / "tokenizer_config.json").unlink()
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "ours")]) == 0
    assert json.loads((tmp_path / "ours" / "languages.json").read_text()) == {"pairs": pairs}
    shutil.rmtree(tmp_path / "ours")
