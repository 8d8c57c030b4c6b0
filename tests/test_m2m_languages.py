"""Languages of any-to-any models (NLLB-200, M2M100): the importer declares two sets, not 40,000 pairs; clients'
BCP-47 / ISO 639-1 / 639-3 codes reach the model's FLORES-200 or ISO 639-1 codes by set membership; a script the
model lacks is refused naming what it has; ListModels lists languages; detection says what it cannot tell apart;
every language gets a sentence rule."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from export.hf import main as import_main
from export.importers.language_codes import M2M100_CODES, NLLB_CODES
from model.directions import Directions, DirectionsError, read_directions
from model.directory import EVERY_DIRECTION, direction_names, read_length_penalties
from model.files import load_config, weights_sha256
from model.m2m_tokenizer import M2MTokenizer
from server.edge.backends import Backend, Backends
from server.edge.convert import ModelDescription
from server.edge.detect import SourceDetector
from server.edge.errors import InvalidRequest
from server.edge.loading import target_tags
from server.edge.messages import model_info_to_pb
from server.edge.request import CallOptions
from server.edge.routing import route_pair, sources_toward
from server.text.documents import RequestLimits
from server.text.splitter import PUNCTUATION, join, rule_for, split
from tests.fakes import FAKE_SPEC
from tests.m2m_tiny import build_nllb_dir
from tests.serving import export_tiny_onnx

NLLB = Directions.between(NLLB_CODES, NLLB_CODES)
M2M100 = Directions.between(M2M100_CODES, M2M100_CODES)


@pytest.fixture(scope="module")
def nllb_import(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random NLLB-200 with all 202 codes, imported."""
    root = tmp_path_factory.mktemp("nllb")
    assert import_main(["--model", str(build_nllb_dir(root / "hf")), "--out", str(root / "ours")]) == 0
    return root / "ours"


@pytest.mark.parametrize(
    ("client", "code"),
    [("de", "deu_Latn"), ("deu", "deu_Latn"), ("zh-Hant", "zho_Hant"), ("zh", "zho_Hans"), ("zh-Hans", "zho_Hans"),
     ("zh-TW", "zho_Hant"), ("pt-BR", "por_Latn"), ("pt", "por_Latn"), ("yue", "yue_Hant"), ("sr", "srp_Cyrl"),
     ("sr-Cyrl", "srp_Cyrl"), ("en-US", "eng_Latn"), ("nb", "nob_Latn"), ("ar", "arb_Arab")],
)  # fmt: skip
def test_client_codes_reach_nllb_codes_as_source_and_as_target(client: str, code: str) -> None:
    """Set membership routes both ways without a pair list: it->X and X->it."""
    into = route_pair("it", client, NLLB)
    assert into is not None and (into.source, into.target) == ("ita_Latn", code)
    out_of = route_pair(client, "it", NLLB)
    assert out_of is not None and (out_of.source, out_of.target) == (code, "ita_Latn")


@pytest.mark.parametrize(("client", "code"), [("sr-Latn", "sr"), ("sr", "sr"), ("zh-Hant", "zh"), ("pt-BR", "pt")])
def test_client_codes_reach_m2m100_codes(client: str, code: str) -> None:
    """M2M100 names ISO 639-1 codes without a script: Serbian in Latin script is its `sr`."""
    route = route_pair("en", client, M2M100)
    assert route is not None and route.target == code


def backends(name: str, directions: Directions) -> Backends:
    engine = SimpleNamespace(load=0, draining=False, failed=False)
    backend = SimpleNamespace(
        engine=engine, spec=SimpleNamespace(directions=directions), model=SimpleNamespace(name=name)
    )
    return Backends([cast(Backend, backend)])


def test_a_script_the_model_lacks_is_refused_naming_the_one_it_has() -> None:
    """NLLB-200 has Serbian in Cyrillic only: `sr-Latn` is never translated into Cyrillic silently."""
    options = CallOptions(source_language="en", target_language="sr-Latn")
    with pytest.raises(InvalidRequest, match=r"'sr-Latn' is not served as written.*srp_Cyrl \(sr-Cyrl\)") as refused:
        backends("nllb", NLLB).route(options)
    assert "any of 202 languages into any of 202 but itself" in str(refused.value)
    assert backends("m2m100", M2M100).route(options)[1].target == "sr"


def test_the_same_language_on_both_sides_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="are the same language"):
        backends("nllb", NLLB).route(CallOptions(source_language="de", target_language="deu_Latn"))


def test_sources_toward_a_target_are_every_other_language_without_routing_each() -> None:
    toward = sources_toward("de", NLLB)
    assert len(toward) == 201 and "deu_Latn" not in toward and toward[0] == NLLB_CODES[0]
    assert sources_toward("ks", NLLB) == ()  # kas_Arab or kas_Deva: ambiguous, routing asks for one


def test_directions_answer_by_membership_and_round_trip_their_json() -> None:
    assert NLLB.count() == 202 * 201 and NLLB.translates("deu_Latn", "zho_Hant")
    assert not NLLB.translates("deu_Latn", "deu_Latn") and not NLLB.translates("deu_Latn", "xx")
    listed = Directions.of_pairs((("de", "en"), ("en", "de")))
    for directions in (NLLB, listed):
        assert Directions.from_json(directions.to_json(), "x") == directions
    assert direction_names(NLLB) == [EVERY_DIRECTION] and direction_names(listed) == ["de-en", "en-de"]
    for bad in ({"sources": ["de"], "targets": ["en"]}, {"pairs": [["de"]]}, {"any_to_any": True, "sources": []}):
        with pytest.raises(DirectionsError, match=r"languages\.json: expected"):
            Directions.from_json(bad, "languages.json")


def test_the_importer_writes_two_sets_and_one_length_penalty(nllb_import: Path) -> None:
    """Broken once on purpose (every ordered pair written, as the importer wrote them): languages.json held 40,602
    pairs and decoding.json as many penalties."""
    written = json.loads((nllb_import / "languages.json").read_text())
    assert written == {"sources": list(NLLB_CODES), "targets": list(NLLB_CODES), "any_to_any": True}
    assert read_directions(nllb_import) == NLLB == M2MTokenizer(nllb_import).directions
    decoding = json.loads((nllb_import / "decoding.json").read_text())
    assert decoding["length_penalty"] == {EVERY_DIRECTION: 1.0}
    penalties = read_length_penalties(nllb_import, direction_names(NLLB), weights_sha256(nllb_import))
    assert penalties == {EVERY_DIRECTION: 1.0}
    assert "202 source languages" in (nllb_import / "MODEL_CARD.md").read_text()


def test_one_penalty_for_every_direction_and_a_direction_of_its_own(tmp_path: Path) -> None:
    record = {"length_penalty": {EVERY_DIRECTION: 1.2, "de-en": 0.8}, "weights_sha256": "w"}
    (tmp_path / "decoding.json").write_text(json.dumps(record))
    penalties = read_length_penalties(tmp_path, ["de-en", "en-de"], "w")
    assert penalties == pytest.approx({"de-en": 0.8, "en-de": 1.2, EVERY_DIRECTION: 1.2})
    model = ModelDescription("m", "fp32", ["fp32"], "cpu", 17, "w", "float32", default_length_penalty=penalties)
    assert model.length_penalty_for("fr", "de") == pytest.approx(1.2)
    assert model.length_penalty_for("de", "en") == pytest.approx(0.8)


def test_list_models_lists_an_any_to_any_models_languages_not_its_pairs() -> None:
    spec = FAKE_SPEC.__class__(**{**FAKE_SPEC.__dict__, "directions": NLLB})
    model = ModelDescription("nllb", "fp32", ["fp32"], "cpu", 17, "w", "float32", {EVERY_DIRECTION: 1.0})
    info = model_info_to_pb(model, spec, RequestLimits())
    assert len(info.pairs) == 0 and info.HasField("any_to_any")
    assert [language.code for language in info.any_to_any.sources] == list(NLLB_CODES)
    spelt = {language.code: language.bcp47 for language in info.any_to_any.targets}
    assert spelt["deu_Latn"] == "de-Latn" and spelt["zho_Hant"] == "zh-Hant" and spelt["srp_Cyrl"] == "sr-Cyrl"
    assert len(set(spelt.values())) == 202  # every spelling reaches its own code
    routed = {code: route_pair("en", bcp47, NLLB) for code, bcp47 in spelt.items() if code != "eng_Latn"}
    assert all(route is not None and route.target == code for code, route in routed.items())
    assert dict(info.default_length_penalty) == {EVERY_DIRECTION: 1.0} and len(info.languages) == 202
    listed = model_info_to_pb(model, FAKE_SPEC, RequestLimits())
    assert not listed.HasField("any_to_any") and len(listed.pairs) == 2


def test_list_models_reports_no_target_tag_for_a_model_whose_code_is_forced(nllb_import: Path) -> None:
    """The code is the first output token, not a tag before the source: no `<2en>` even where the model's codes are
    the shipped model's tag names (M2M100's `en`, `de`), and its pairs listed (restricted by hand)."""
    cfg = load_config(nllb_import)
    assert cfg.forced_bos and target_tags(replace(FAKE_SPEC, tag_ids=M2MTokenizer(nllb_import).tag_ids), cfg) == {}
    spec = replace(FAKE_SPEC, forced_bos=True)  # codes en and de, pairs listed, so ListModels lists each pair
    model = ModelDescription("m2m", "fp32", ["fp32"], "cpu", 17, "w", "float32", target_tags=target_tags(spec, cfg))
    assert [pair.target_tag for pair in model_info_to_pb(model, spec, RequestLimits()).pairs] == ["", ""]


def test_length_penalty_tuning_refuses_an_any_to_any_model_in_one_line(
    nllb_import: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from server.gates.length_penalty import main as sweep_main

    model = shutil.copytree(nllb_import, tmp_path / "nllb")
    export_tiny_onnx(model)
    assert sweep_main(["--model-dir", str(model), "--values", "1.0", "--write"]) == 2
    refusal = capsys.readouterr().err.splitlines()
    assert len(refusal) == 1 and "per-direction tuning does not apply" in refusal[0]
    assert json.loads((model / "decoding.json").read_text())["length_penalty"] == {EVERY_DIRECTION: 1.0}


def test_detection_says_which_served_languages_it_cannot_tell_apart() -> None:
    detector = SourceDetector(NLLB_CODES)
    assert detector.indistinct["zh"] == ("yue_Hant", "zho_Hans", "zho_Hant")
    assert {"arb_Arab", "ary_Arab", "arz_Arab"} <= set(detector.indistinct["ar"])
    assert "de" not in detector.indistinct and "ace_Latn" in detector.undetectable
    detection = detector.detect("这是一个很长的中文句子。用来测试语言检测。我们今天去公园散步。")
    assert detection is not None and detection.language == "zh" and detection.indistinct == detector.indistinct["zh"]
    german = detector.detect("Das ist ein ganz gewöhnlicher deutscher Satz über das Wetter von heute.")
    assert german is not None and german.language == "de" and german.indistinct == ()
    assert SourceDetector(["fr", "fr_CA", "de", "deu_Latn"]).indistinct == {}  # one written language, two spellings


def test_every_language_gets_a_sentence_rule() -> None:
    assert rule_for("deu_Latn") == "de" and rule_for("zho_Hant") == "zh" and rule_for("ace_Latn") == PUNCTUATION
    text = "First sentence here. Second one follows!"
    for code in NLLB_CODES:  # a rule for every code; Latin-script text split by each Latin-script language's
        cut = split(text, code)
        assert join(cut.pieces, cut.separators) == text, code
        if code.endswith("_Latn"):
            assert cut.pieces == ["First sentence here.", "Second one follows!"], code
