"""Language codes as clients write them reach the model's own codes and >>xx<< tags (model.languages)."""

from __future__ import annotations

import pytest

from model.directions import Directions
from model.languages import (
    VERBATIM,
    AmbiguousLanguage,
    LanguageTag,
    bcp47,
    bcp47_spellings,
    canonical,
    iso639_1,
    listed,
    match,
    match_fit,
    parse,
    same_written_language,
)
from server.edge.routing import describe_pairs, route_pair

PORTUGUESE = ["por", "pob"]  # opus-mt-tc-big-en-pt's tags: European and Brazilian Portuguese
CHINESE = ["cmn_Hans", "cmn_Hant", "yue_Hant", "zho_Hant"]
# opus-mt-en-zh's own target tags: one language with and without its script. Broken once on purpose (scripts
# compared only as implied), `zh`, `zh-CN` and `zh-Hans` were refused as "could mean any of cmn, cmn_Hans".
EN_ZH = ["cmn", "cmn_Hans", "cmn_Hant", "yue", "yue_Hans", "yue_Hant", "zho_Hans", "zho_Hant", "lzh", "lzh_Hans"]


@pytest.mark.parametrize(
    ("client", "offered", "expected"),
    [
        ("pt", PORTUGUESE, "por"),
        ("pt-BR", PORTUGUESE, "pob"),
        ("pt_br", PORTUGUESE, "pob"),
        ("por", PORTUGUESE, "por"),
        ("pob", PORTUGUESE, "pob"),
        ("pt-PT", PORTUGUESE, "por"),
        ("PT-br", PORTUGUESE, "pob"),
        ("pt-BR", ["pt", "pt_br", "fr"], "pt_br"),  # the older OPUS-MT spelling of regions
        ("fr", ["fra", "deu"], "fra"),
        ("fre", ["fra", "deu"], "fra"),  # ISO 639-2/B
        ("fr-CA", ["fra", "deu"], "fra"),  # a region the model does not split by
        ("de", ["deu"], "deu"),
        ("deu", ["de", "en"], "de"),
        ("zh", CHINESE, "cmn_Hans"),  # a macrolanguage means its usual member, in its usual script
        ("zh-Hans", CHINESE, "cmn_Hans"),
        ("zh-CN", CHINESE, "cmn_Hans"),
        ("zh-TW", CHINESE, "zho_Hant"),  # the same script: the very language code breaks the tie
        ("zh-TW", ["cmn_Hans", "cmn_Hant"], "cmn_Hant"),
        ("zh-Hant", ["cmn_Hans", "zho_Hant"], "zho_Hant"),
        ("zh", ["cmn_Hans", "zho_Hant"], "cmn_Hans"),  # the script weighs more than macro or member
        ("yue", CHINESE, "yue_Hant"),
        ("zh", EN_ZH, "cmn"),  # written as the client writes it: no script
        ("zh-CN", EN_ZH, "cmn"),
        ("zh-Hans", EN_ZH, "zho_Hans"),  # written alike, then the very language code
        ("zh-TW", EN_ZH, "zho_Hant"),
        ("zh-Hant", EN_ZH, "zho_Hant"),
        ("yue-Hant", EN_ZH, "yue_Hant"),
        ("yue", EN_ZH, "yue"),
        ("cmn", ["zho"], "zho"),
        ("no", ["nob", "nno"], "nob"),
        ("nn", ["nob", "nno"], "nno"),
        ("iw", ["heb", "ara"], "heb"),  # deprecated 639-1 codes old data still uses
        ("sr", ["srp_Cyrl", "srp_Latn"], "srp_Cyrl"),
        ("sr-Latn", ["srp_Cyrl", "srp_Latn"], "srp_Latn"),
        ("fr", ["mul"], "mul"),  # a group takes any known language
        ("fr", ["mul", "fra"], "fra"),  # below every real match
        ("PT-BR", PORTUGUESE, "pob"),  # DeepL's spelling: tags are case-insensitive (RFC 5646 2.1.1)
        ("ZH-HANT", CHINESE, "zho_Hant"),
        ("EN-US", ["eng"], "eng"),
        ("de-DE-1996", ["deu"], "deu"),  # a variant subtag
        ("en-u-ca-gregory", ["eng"], "eng"),  # an extension
        # opus-mt-en-ROMANCE names Brazilian Portuguese twice; one language, so no ambiguity: the usual casing
        ("pt-BR", ["pt", "pt_br", "pt_BR", "pt_PT"], "pt_BR"),
        ("pt_br", ["pt", "pt_br", "pt_BR", "pt_PT"], "pt_br"),  # its own spelling: itself
        ("de_DE.UTF-8", ["deu"], "deu"),  # what `$LANG` holds: a POSIX locale's codeset and modifier are read past
        ("de_DE@euro", ["deu"], "deu"),
        ("de-", ["deu"], "deu"),
    ],
)
def test_client_codes_reach_the_models_own(client: str, offered: list[str], expected: str) -> None:
    assert match(client, offered) == expected


@pytest.mark.parametrize(
    ("client", "offered", "expected"),
    [("ne", ["npi"], "npi"), ("kv", ["kpv"], "kpv"), ("iu", ["ike_Latn"], "ike_Latn"), ("kok", ["gom"], "gom"),
     ("ug", ["uig_Arab", "uig_Cyrl"], "uig_Arab"), ("ug-Cyrl", ["uig_Arab", "uig_Cyrl"], "uig_Cyrl"),
     ("lah", ["pnb", "skr"], "pnb"), ("hmn", ["mww", "hnj"], "mww"), ("npi", ["nep"], "nep")],
)  # fmt: skip
def test_a_macrolanguage_reaches_the_member_a_model_names(client: str, offered: list[str], expected: str) -> None:
    """OPUS-MT names Nepali npi, Komi kpv, Inuktitut ike, Konkani gom, and Uyghur in two scripts; clients write
    the macrolanguage (ne, kv, iu, kok) and no script. Broken before these entries, each was refused, and `ug`
    was ambiguous between uig_Arab and uig_Cyrl."""
    assert match(client, offered) == expected


@pytest.mark.parametrize(
    ("side", "codes"),
    [("cat_oci_spa", ["cat", "oci", "spa"]), ("deu_eng_fra_por_spa", ["deu", "eng", "fra", "por", "spa"]),
     ("fi_nb_no_nn_ru_sv_en", ["fi", "nb", "no", "nn", "ru", "sv", "en"]), ("gmw", ["gmw"]),
     ("fr+fr_BE+pt_br+pt_BR", ["fr", "fr_BE", "pt_br", "pt_BR"]), ("zh_Hant", ["zh_Hant"]), ("sr_Latn", ["sr_Latn"]),
     ("pt_BR", ["pt_BR"]), ("pt_br", ["pt_br"]), ("es_419", ["es_419"]), ("cmn_Hans_TW", ["cmn_Hans_TW"]),
     ("NORTH_EU", ["NORTH_EU"]), ("", [])],
)  # fmt: skip
def test_a_name_side_lists_the_codes_joined_by_plus_or_underscore(side: str, codes: list[str]) -> None:
    """opus-mt-tc-big-cat_oci_spa-en reads Catalan, Occitan and Spanish; a script or region after `_` stays part of
    its code. Broken before (`+` alone split), `cat_oci_spa` was one language: Catalan, its rest read as subtags."""
    assert listed(side) == codes


@pytest.mark.parametrize(
    ("client", "offered"),
    [("pt-PT", ["pob"]), ("zh-Hant", ["cmn_Hans"]), ("fr", ["de", "en"]), ("klingon", ["mul"]), ("", ["en"]),
     ("de\n", ["deu"]), ("fr+es", ["fra"])],
)  # fmt: skip
def test_codes_that_name_no_served_language_match_nothing(client: str, offered: list[str]) -> None:
    """Broken once on purpose (`_part_fit` letting two different regions written out on both sides fit),
    `pt-PT` was matched to `pob`."""
    assert match(client, offered) is None


def test_a_code_fitting_several_languages_equally_is_ambiguous_and_names_them() -> None:
    """Broken once on purpose (`match_fit` taking the first of equal winners), "ar" went to `arz` silently."""
    with pytest.raises(AmbiguousLanguage, match="arz, ary"):
        match("ar", ["arz", "ary"])  # two Arabic varieties, neither the one "ar" usually means


def test_a_bare_language_fitting_two_regions_of_it_is_ambiguous() -> None:
    """Two regions of one language are two languages, not one spelt twice: "pt" names neither of them.

    Deliberate break: `match_fit` taking the winners for one language spelt twice when only their language is
    the same (`parse(code).language` in its set) answered pt_BR."""
    with pytest.raises(AmbiguousLanguage, match="pt_BR, pt_PT"):
        match("pt", ["pt_BR", "pt_PT"])
    with pytest.raises(AmbiguousLanguage, match="pt_PT, pt_BR"):
        match("pt", ["pt_PT", "pt_BR"])  # whichever comes first
    assert match("pt", ["pt_br", "pt_BR"]) == "pt_BR"  # one region spelt twice: its canonical spelling


@pytest.mark.parametrize(
    ("code", "tag"),
    [
        ("pt-BR", LanguageTag("por", "", "BR")),
        ("cmn_Hans", LanguageTag("cmn", "Hans", "")),
        ("zh-Hant-TW", LanguageTag("zho", "Hant", "TW")),
        ("es-419", LanguageTag("spa", "", "419")),
        ("ROMANCE", LanguageTag("ROMANCE")),
        ("pob", LanguageTag("por", "", "BR")),
    ],
)
def test_codes_are_read_into_language_script_and_region(code: str, tag: LanguageTag) -> None:
    assert parse(code) == tag


@pytest.mark.parametrize(
    ("code", "spelled", "two_letter"),
    [("pob", "pt-BR", "pt"), ("cmn_Hans", "zh-Hans", "zh"), ("fra", "fr", "fr"), ("zho_Hant", "zh-Hant", "zh"),
     ("nob", "nb", "nb"), ("arb", "ar", "ar"), ("mul", "mul", ""), ("yue", "yue", "zh"), ("haw", "haw", ""),
     ("npi", "ne", "ne"), ("kpv", "kv", "kv"), ("gom", "gom", "")],
)  # fmt: skip
def test_model_codes_in_bcp47_and_iso_639_1(code: str, spelled: str, two_letter: str) -> None:
    assert bcp47(code) == spelled
    assert iso639_1(code) == two_letter


@pytest.mark.parametrize(
    ("code", "cased"), [("pt_br", "pt_BR"), ("ZH-HANS", "zh-Hans"), ("DE", "de"), ("ROMANCE", "ROMANCE")]
)
def test_canonical_cases_language_script_and_region(code: str, cased: str) -> None:
    assert canonical(code) == cased


def test_a_language_fits_alike_however_the_client_or_the_model_spells_it() -> None:
    """Two models name English `en` and `eng`: a client's `eng` must not fit the second better for being its
    spelling, so that routing can prefer the specialised model (broken once on purpose: a verbatim code scored
    above every other spelling, and `eng->de` went to a multilingual en-mul beside opus-mt-en-de)."""
    spelt_otherwise, own_spelling = match_fit("eng", ["en"]), match_fit("eng", ["eng"])
    assert spelt_otherwise is not None and own_spelling is not None
    assert spelt_otherwise[0] == own_spelling[0] != VERBATIM and own_spelling[1] == "eng"
    assert match_fit("mul", ["mul"]) == (VERBATIM, "mul")  # a group has no language to score


def test_a_pair_is_routed_by_its_source_then_the_targets_of_that_source() -> None:
    pairs = Directions.of_pairs((("eng", "por"), ("eng", "pob"), ("fra", "eng")))
    route = route_pair("en", "pt-BR", pairs)
    assert route is not None and (route.source, route.target, route.sentence_language) == ("eng", "pob", "eng")
    assert route_pair("fr", "pt", pairs) is None  # fra has no Portuguese target
    grouped = route_pair("sw", "en", Directions.of_pairs((("mul", "eng"),)))
    assert grouped is not None and grouped.sentence_language == "sw"  # a group source splits by the client's code


def test_a_family_that_lists_no_member_takes_any_language_below_mul() -> None:
    """`mul` reads any language; a family (`zle`) whose model card named no member is taken as one too, but ranks
    below it, so German beside opus-mt-mul-en and an East Slavic model goes to the first. (Broken once on purpose,
    every group scored alike: German went to whichever of the two loaded first.)"""
    family = route_pair("de", "en", Directions.of_pairs((("zle", "eng"),)))
    anything = route_pair("de", "en", Directions.of_pairs((("mul", "eng"),)))
    assert family is not None and anything is not None and anything.fit > family.fit
    real = route_pair("ru", "en", Directions.of_pairs((("rus", "eng"),)))
    assert real is not None and real.fit > anything.fit


def test_an_extended_language_subtag_names_the_language() -> None:
    """BCP-47's `zh-yue` is Cantonese and `ar-arz` Egyptian Arabic, and opus-mt-*-ZH's own tag `zh_yue` too; a
    grandfathered `zh-min-nan` is Min Nan. (Broken once on purpose, the second subtag read as a variant: `zh-yue`
    reached Mandarin's tag.)"""
    tags = ["cmn", "yue", "arb", "arz", "nan"]
    assert [match(code, tags) for code in ("zh-yue", "zh_yue", "ar-arz", "zh-min-nan")] == ["yue", "yue", "arz", "nan"]
    assert parse("sr_Latn") == parse("sr-Latn") and parse("sr_Latn").script == "Latn"  # a script is no extension
    assert bcp47("zh_yue") == "yue" and canonical("ZH-YUE-hk") == "zh-yue-HK"


def test_listed_spellings_are_unique_per_model_and_reach_the_code_they_were_listed_for() -> None:
    """opus-mt-en-mul names both `cmn_Hans` and `zho_Hans`: listed alike as `zh-Hans`, a client picking the first
    from ListModels reached the second. Two spellings of one language (`pt_br`, `pt_BR`) stay one spelling."""
    codes = ["cmn", "cmn_Hans", "zho", "zho_Hans", "zho_Hant", "deu", "pt_br", "pt_BR"]
    spelt = bcp47_spellings(codes)
    assert spelt["cmn_Hans"] == "cmn-Hans" and spelt["zho_Hans"] == "zh-Hans" and spelt["deu"] == "de"
    assert spelt["pt_br"] == spelt["pt_BR"] == "pt-BR"
    assert all(match(spelt[code], codes) == code for code in codes if not code.startswith("pt"))
    assert bcp47_spellings(["cmn_Hans", "deu"])["cmn_Hans"] == "zh-Hans"  # alone, the member takes the usual spelling


def test_error_messages_list_pairs_with_their_bcp47_spelling_and_cut_long_lists() -> None:
    assert describe_pairs({"m": Directions.of_pairs((("eng", "pob"),))}) == "m: eng-pob (en-pt-BR)"
    many = tuple(("eng", f"x{i:02d}") for i in range(40))
    assert "and 16 more (ListModels lists them)" in describe_pairs({"m": Directions.of_pairs(many)})


@pytest.mark.parametrize(
    ("detected", "target", "same"),
    [("en", "en-US", True), ("no", "nb", True), ("de", "deu", True), ("zh", "zh-CN", True), ("zh", "zh-TW", False),
     ("sr", "sr-Latn", False), ("en", "mul", False), ("pt", "pt-BR", True), ("de", "en", False), ("nb", "no", True),
     ("no", "nn", False), ("nn", "no", False)],
)  # fmt: skip
def test_a_text_is_already_in_the_target_only_in_its_language_and_script(
    detected: str, target: str, same: bool
) -> None:
    """Broken once on purpose (two-letter codes compared), Simplified Chinese asked for zh-TW came back
    unchanged, and Norwegian asked for `nb` was refused as the pair no-nb."""
    assert same_written_language(detected, target) is same
