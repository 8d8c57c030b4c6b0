"""Language codes as clients and OPUS-MT models write them, and the one rule that matches the two.

Clients write BCP-47 (`pt`, `pt-BR`, `zh-Hant`), ISO 639-1 (`pt`) or ISO 639-3 (`por`); OPUS-MT models name
their languages in ISO 639-1 (`opus-mt-de-en`), ISO 639-3 with an optional script (`>>fra<<`, `>>cmn_Hans<<`),
a region after an underscore (`>>pt_br<<`), the Tatoeba Challenge's own `pob` (Brazilian Portuguese), or a
group (`mul`, ISO 639-5 families such as `gem`, and older names such as `ROMANCE`); a name lists several
joined by `+` or `_` (`listed`: `opus-mt-tc-big-cat_oci_spa-en`). Every code is read into
a `LanguageTag` (ISO 639-3 language, script, region) and a client's code is matched to the model's codes by
`match`, which prefers, in this order: the same language (a macrolanguage and its usual member count as
one, e.g. `zh` and `cmn`), the same script (else the language's usual script), the same region (else
none), the very same language code.
Torch-free: the importer and the server both read it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# ISO 639-1 -> ISO 639-3 (every 639-1 code, plus the deprecated iw, in, ji, mo, sh that old data still uses)
_ISO639_1_TO_3 = """aa:aar ab:abk ae:ave af:afr ak:aka am:amh an:arg ar:ara as:asm av:ava ay:aym az:aze ba:bak
    be:bel bg:bul bh:bih bi:bis bm:bam bn:ben bo:bod br:bre bs:bos ca:cat ce:che ch:cha co:cos cr:cre cs:ces
    cu:chu cv:chv cy:cym da:dan de:deu dv:div dz:dzo ee:ewe el:ell en:eng eo:epo es:spa et:est eu:eus fa:fas
    ff:ful fi:fin fj:fij fo:fao fr:fra fy:fry ga:gle gd:gla gl:glg gn:grn gu:guj gv:glv ha:hau he:heb hi:hin
    ho:hmo hr:hrv ht:hat hu:hun hy:hye hz:her ia:ina id:ind ie:ile ig:ibo ii:iii ik:ipk io:ido is:isl it:ita
    iu:iku ja:jpn jv:jav ka:kat kg:kon ki:kik kj:kua kk:kaz kl:kal km:khm kn:kan ko:kor kr:kau ks:kas ku:kur
    kv:kom kw:cor ky:kir la:lat lb:ltz lg:lug li:lim ln:lin lo:lao lt:lit lu:lub lv:lav mg:mlg mh:mah mi:mri
    mk:mkd ml:mal mn:mon mr:mar ms:msa mt:mlt my:mya na:nau nb:nob nd:nde ne:nep ng:ndo nl:nld nn:nno no:nor
    nr:nbl nv:nav ny:nya oc:oci oj:oji om:orm or:ori os:oss pa:pan pi:pli pl:pol ps:pus pt:por qu:que rm:roh
    rn:run ro:ron ru:rus rw:kin sa:san sc:srd sd:snd se:sme sg:sag si:sin sk:slk sl:slv sm:smo sn:sna so:som
    sq:sqi sr:srp ss:ssw st:sot su:sun sv:swe sw:swa ta:tam te:tel tg:tgk th:tha ti:tir tk:tuk tl:tgl tn:tsn
    to:ton tr:tur ts:tso tt:tat tw:twi ty:tah ug:uig uk:ukr ur:urd uz:uzb ve:ven vi:vie vo:vol wa:wln wo:wol
    xh:xho yi:yid yo:yor za:zha zh:zho zu:zul iw:heb in:ind ji:yid mo:ron sh:hbs"""
ISO639_1_TO_3 = dict(pair.split(":") for pair in _ISO639_1_TO_3.split())
ISO639_3_TO_1 = {three: one for one, three in ISO639_1_TO_3.items() if one not in ("iw", "in", "ji", "mo")}
# ISO 639-2/B (bibliographic) codes that differ from ISO 639-3
_ISO639_2B_TO_3 = """alb:sqi arm:hye baq:eus bur:mya chi:zho cze:ces dut:nld fre:fra geo:kat ger:deu gre:ell ice:isl
    mac:mkd mao:mri may:msa per:fas rum:ron slo:slk tib:bod wel:cym"""
ISO639_2B_TO_3 = dict(pair.split(":") for pair in _ISO639_2B_TO_3.split())
# Macrolanguage -> its members that OPUS-MT models name; the first is the one the macrolanguage usually means
MACRO_MEMBERS: dict[str, tuple[str, ...]] = {
    "zho": ("cmn", "yue", "wuu", "nan", "hak", "gan", "cjy", "hsn", "lzh", "cdo", "cpx", "czo", "mnp"),
    "ara": ("arb", "arz", "ary", "apc", "ajp", "acm", "afb", "aeb", "arq", "acq", "ars", "apd", "ayl", "abv"),
    "fas": ("pes", "prs"),
    "msa": ("zsm", "zlm", "min", "mfa", "max"),
    "nor": ("nob", "nno"),
    "est": ("ekk", "vro"),
    "lav": ("lvs", "ltg"),
    "sqi": ("als", "aln", "aae"),
    "aze": ("azj", "azb"),
    "uzb": ("uzn", "uzs"),
    "kur": ("kmr", "ckb", "sdh"),
    "mon": ("khk", "mvf"),
    "swa": ("swh", "swc"),
    "hbs": ("srp", "hrv", "bos", "cnr"),
    "grn": ("gug", "gui"),
    "pus": ("pbu", "pst", "pbt"),
    "yid": ("ydd", "yih"),
    "zza": ("diq", "kiu"),
    "fil": ("tgl",),
    "nep": ("npi", "dty"),
    "kom": ("kpv", "koi"),
    "iku": ("ike", "ikt"),
    "kok": ("gom", "knn"),
    "lah": ("pnb", "skr", "hno"),
    "hmn": ("mww", "hnj", "hmd"),
}  # not ful: no member is the one `ff` usually means (CLDR's is Senegal's Pulaar, fuc; FLORES' Nigerian fuv)
MEMBER_TO_MACRO = {member: macro for macro, members in MACRO_MEMBERS.items() for member in members}
# Codes OPUS-MT uses that are no language of their own: the Tatoeba Challenge's Brazilian Portuguese
SPECIAL: dict[str, tuple[str, str, str]] = {
    "pob": ("por", "", "BR"),
    # BCP-47's grandfathered Chinese tags, whose second part is no extended language of its own
    "zh-min-nan": ("nan", "", ""), "zh-guoyu": ("cmn", "", ""), "zh-hakka": ("hak", "", ""),
    "zh-xiang": ("hsn", "", ""),
}  # fmt: skip
# The script a language is written in when a code names none (CLDR's likely subtags), by (language, region)
LIKELY_SCRIPT: dict[tuple[str, str], str] = {
    ("zho", ""): "Hans", ("zho", "CN"): "Hans", ("zho", "SG"): "Hans", ("zho", "TW"): "Hant",
    ("zho", "HK"): "Hant", ("zho", "MO"): "Hant", ("cmn", ""): "Hans", ("cmn", "TW"): "Hant", ("yue", ""): "Hant",
    ("srp", ""): "Cyrl", ("uzb", ""): "Latn", ("uzn", ""): "Latn", ("aze", ""): "Latn", ("kaz", ""): "Cyrl",
    ("pan", ""): "Guru", ("pan", "PK"): "Arab", ("snd", ""): "Arab", ("mon", ""): "Cyrl", ("bos", ""): "Latn",
    ("jpn", ""): "Jpan", ("kor", ""): "Kore", ("rus", ""): "Cyrl", ("ukr", ""): "Cyrl", ("bel", ""): "Cyrl",
    ("uig", ""): "Arab", ("pnb", ""): "Arab",
}  # fmt: skip
# ISO 639-5 language families and groups that OPUS-MT names as a source or target: many languages, not one
_ISO639_5 = """aav afa alg alv apa aqa art ath auf aus awd azc bad bai bat ber bnt btk cai cau cba ccn ccs cdc cdd cel
    cmc cpe cpf cpp crp csu cus day dmn dra egx esx euq fiu fox gem gme gmq gmw grk hmx hok hyx iir ijo inc ine
    ira iro itc jpx kar kdo khi kro map mkh mno mul mun myn nah nai ngf nic nub omq omv oto paa phi plf poz pqe
    pqw pra qwe roa sai sal sdv sem sgn sio sit sla smi son sqj ssa syd tai tbq trk tup tut tuw urj wak wen xgn
    xnd ypk zhx zle zls zlw znd"""
ISO639_5 = frozenset(_ISO639_5.split())
# language, script, region, then any further BCP-47 subtags (variants, extensions: `de-DE-1996`, `en-u-ca-gregory`)
# language, then BCP-47's extended language (`zh-yue`: Cantonese, `ar-arz`: Egyptian Arabic, which it names
# instead), script, region and whatever follows
_CODE = re.compile(
    r"(?P<language>[A-Za-z]{2,3})(?:[-_](?P<extlang>[A-Za-z]{3})(?![A-Za-z]))?(?:[-_](?P<script>[A-Za-z]{4}))?"
    r"(?:[-_](?P<region>[A-Za-z]{2}|[0-9]{3}))?(?:[-_][A-Za-z0-9]{1,8})*"
)


class AmbiguousLanguage(ValueError):
    """A client's code matches several of a model's codes equally well."""


@dataclass(frozen=True)
class LanguageTag:
    """A language code read: ISO 639-3 language (or a group), script (`Hans`) and region (`BR`), each maybe ''."""

    language: str
    script: str = ""
    region: str = ""

    @property
    def is_group(self) -> bool:
        """A family or collection of languages (`mul`, `gem`, `ROMANCE`), not one language."""
        return self.language in ISO639_5 or self.language.isupper()

    @property
    def likely_script(self) -> str:
        default = LIKELY_SCRIPT.get((self.language, ""), "")
        return self.script or LIKELY_SCRIPT.get((self.language, self.region), default)


def parse(code: str) -> LanguageTag:
    """`code` read as a language tag; a code that is no tag this module knows is its own language."""
    if code.lower() in SPECIAL:
        return LanguageTag(*SPECIAL[code.lower()])
    found = _CODE.fullmatch(_bare(code))
    if not found:  # OPUS-MT's group names ("ROMANCE", "NORTH_EU"), or no code at all
        return LanguageTag(code)
    language, extlang, script, region = found.group("language", "extlang", "script", "region")
    language = (extlang or language).lower()
    language = ISO639_1_TO_3.get(language) or ISO639_2B_TO_3.get(language) or language
    return LanguageTag(language, (script or "").title(), (region or "").upper())


def listed(codes: str) -> list[str]:
    """The codes a model's name or tokenizer config lists for one side: joined by `+` (opus-mt-ROMANCE-en's
    `fr+fr_BE+...+pt_br`), or by `_` where every part is a lowercase language or group code of its own
    (opus-mt-tc-big-cat_oci_spa-en, opus-mt-tc-bible-big-deu_eng_fra_por_spa-gmw); otherwise one code, its
    script and region after `_` (`zh_Hant`, `sr_Latn`, `pt_BR`, `es_419`, and `pt_br`: two two-letter parts
    read as language and region, as older OPUS-MT releases write regions)."""
    if "+" in codes:
        return list(dict.fromkeys(code for code in codes.split("+") if code))
    parts = codes.split("_")
    own_codes = all(part.islower() and part.isalpha() and len(part) in (2, 3) and known(part) for part in parts)
    if len(parts) > 1 and own_codes and not (len(parts) == 2 and len(parts[1]) == 2):
        return list(dict.fromkeys(parts))
    return [codes] if codes else []


def bcp47(code: str, fold_member: bool = True) -> str:
    """The BCP-47 spelling of a model's code: ISO 639-1 where the language (or its macrolanguage, for the usual
    member, unless `fold_member` is False) has one, then script and region: `pob` -> `pt-BR`, `cmn_Hans` ->
    `zh-Hans`, `fra` -> `fr`."""
    tag = parse(code)
    if tag.is_group:
        return tag.language
    language = ISO639_3_TO_1.get(tag.language)
    macro = MEMBER_TO_MACRO.get(tag.language)
    if language is None and fold_member and macro and MACRO_MEMBERS[macro][0] == tag.language:
        language = ISO639_3_TO_1.get(macro)
    return "-".join(part for part in (language or tag.language, tag.script, tag.region) if part)


def bcp47_spellings(codes: Iterable[str]) -> dict[str, str]:
    """Each of a model's codes spelt by `bcp47`, except where two languages would share one spelling (opus-mt-en-mul
    names `cmn_Hans` and `zho_Hans`, both `zh-Hans`): the member is then spelt as itself (`cmn-Hans`), so that a
    client sending a listed spelling back reaches the code it was listed for."""
    spelt = {code: bcp47(code) for code in codes}
    languages: dict[str, set[str]] = {}
    for code, spelling in spelt.items():
        languages.setdefault(spelling, set()).add(parse(code).language)
    for code, spelling in spelt.items():
        if len(languages[spelling]) > 1 and parse(code).language in MEMBER_TO_MACRO:
            spelt[code] = bcp47(code, fold_member=False)
    return spelt


def _bare(code: str) -> str:
    """`code` without a POSIX locale's codeset or modifier (`de_DE.UTF-8`, `de_DE@euro`: what `$LANG` holds)
    and without a trailing separator."""
    return re.split(r"[.@]", code, maxsplit=1)[0].rstrip("-_")


def same_written_language(a: str, b: str) -> bool:
    """Whether two codes name one language in one script: `en` and `en-US`, `no` and `nb`; not `no` and `nn`, `zh`
    and `zh-TW` (Simplified and Traditional), `sr` and `sr-Latn`, nor a group (`mul`) and anything."""
    x, y = written_language(a), written_language(b)
    if x is None or y is None or x[0] != y[0]:
        return False
    return x[1] == y[1] or not (x[1] and y[1])  # a script unsaid where no usual one is known fits any (`deu_Latn`)


def written_language(code: str) -> tuple[str, str] | None:
    """What `same_written_language` compares: the language (a macrolanguage's usual member as the macrolanguage:
    `nb` as `no`, not `nn`) and its likely script ('' where the code names none and none is usual); None for a
    group, which is no one language."""
    tag = parse(code)
    if tag.is_group:
        return None
    macro = MEMBER_TO_MACRO.get(tag.language)
    usual = macro is not None and MACRO_MEMBERS[macro][0] == tag.language
    return (macro if usual else tag.language), tag.likely_script  # type: ignore[return-value]


def same_language(client: str, model_codes: Iterable[str]) -> list[str]:
    """The model's codes of `client`'s language (or its macrolanguage, or a member), whatever their script and
    region: what a refusal names where none fits as written (`sr-Latn` against NLLB's `srp_Cyrl`)."""
    wanted = parse(client).language
    return [code for code in dict.fromkeys(model_codes) if _language_fit(wanted, parse(code).language) is not None]


def canonical(code: str) -> str:
    """`code` with language, script and region in their usual case, the rest as written: `pt_br` -> `pt_BR`."""
    found = _CODE.fullmatch(code)
    if found is None:
        return code
    cased = code
    for group, case in (("language", str.lower), ("extlang", str.lower), ("script", str.title), ("region", str.upper)):
        if found.group(group):
            begin, end = found.span(group)
            cased = cased[:begin] + case(found.group(group)) + cased[end:]
    return cased


def iso639_1(code: str) -> str:
    """The two-letter code of `code`'s language (or of its macrolanguage), '' where it has none."""
    tag = parse(code)
    return ISO639_3_TO_1.get(tag.language) or ISO639_3_TO_1.get(MEMBER_TO_MACRO.get(tag.language, ""), "")


# How well a model's code fits a client's, compared as tuples: (language, script, region, the script written alike,
# the very language). The language counts a macrolanguage's usual member as the language itself (`zh` is `cmn`),
# so that the script decides between `cmn_Hans` and `zho_Hant`; where a model names one language with and
# without its script (`cmn` and `cmn_Hans`, both Simplified), the client's spelling decides (`zh` takes `cmn`,
# `zh-Hans` `cmn_Hans`); the very same language code only breaks a tie.
Fit = tuple[int, int, int, int, int]
VERBATIM: Fit = (9, 9, 9, 9, 9)  # the client wrote the model's own code, one naming no single language (`mul`)


def match(client: str, model_codes: Iterable[str]) -> str | None:
    """The model code a client's `client` code means, None if none; AmbiguousLanguage if several fit equally."""
    found = match_fit(client, model_codes)
    return found[1] if found else None


def match_fit(client: str, model_codes: Iterable[str]) -> tuple[Fit, str] | None:
    """`match` with how well the code fits, so that a server can prefer one model's fit over another's.

    A code the model names verbatim is always itself (scored as its language, VERBATIM where it names none). Otherwise
    each model code is scored (language, then
    script, then region, as the module says); a group code (`mul`) takes any known language, below every
    real match.
    """
    codes = list(dict.fromkeys(model_codes))
    wanted = parse(client)
    if client in codes:  # scored as any spelling of its language is, so that `eng` and `en` fit two models alike
        return _score(wanted, wanted) or VERBATIM, client
    scored = [(fit, code) for code in codes if (fit := _score(wanted, parse(code))) is not None]
    if not scored:
        return None
    best = max(fit for fit, _ in scored)
    winners = [code for fit, code in scored if fit == best]
    if len({parse(code) for code in winners}) == 1:  # one language spelt twice (`>>pt_br<<`, `>>pt_BR<<`)
        winners = sorted(winners, key=lambda code: (code != canonical(code), code))[:1]
    if len(winners) > 1:
        raise AmbiguousLanguage(f"{client!r} could mean any of {', '.join(winners)}: send one of them")
    return best, winners[0]


def known(code: str) -> bool:
    """Whether `code` reads as a language this module can name: an ISO 639-1 or 639-2/B code, a three-letter
    code (ISO 639-3 has thousands; any is taken), optionally with script and region."""
    if code.lower() in SPECIAL:
        return True
    found = _CODE.fullmatch(_bare(code))
    if found is None:
        return False
    return len(found.group(1)) == 3 or found.group(1).lower() in ISO639_1_TO_3


def _score(wanted: LanguageTag, offered: LanguageTag) -> Fit | None:
    """How well an offered code fits a wanted one, compared as a tuple; None where it does not fit."""
    if offered.is_group:  # any language: `mul` itself, else a family whose model card listed no member, below it
        return (0, 0, 0, 0, int(offered.language == "mul")) if not wanted.is_group and known(wanted.language) else None
    language = _language_fit(wanted.language, offered.language)
    if language is None:
        return None
    script = _part_fit(wanted.likely_script, offered.likely_script, explicit=bool(wanted.script and offered.script))
    region = _part_fit(wanted.region, offered.region, explicit=bool(wanted.region and offered.region))
    if script is None or region is None:
        return None
    written_alike = int(bool(wanted.script) == bool(offered.script))
    return (language, script, region, written_alike, int(wanted.language == offered.language))


def _language_fit(wanted: str, offered: str) -> int | None:
    if wanted == offered:
        return 2
    if MEMBER_TO_MACRO.get(offered) == wanted:  # client "zh", model "cmn"
        return 2 if MACRO_MEMBERS[wanted][0] == offered else 1
    if MEMBER_TO_MACRO.get(wanted) == offered:  # client "cmn", model "zho"
        return 1
    return None


def _part_fit(wanted: str, offered: str, explicit: bool) -> int | None:
    """Script or region: the same scores best; a code without one fits any, below the same; two different
    ones written out on both sides never fit (pt-PT is not pob); likely scripts that differ fit last."""
    if wanted == offered:
        return 2
    if not wanted or not offered:
        return 1 if not offered else 0
    return None if explicit else -1
