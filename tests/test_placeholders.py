"""Placeholders kept verbatim: every form found whole, prose never taken for one, and each placeholder of plain
text, HTML and XML back exactly once, in source order, whatever the model writes; served on the shipped model."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.files import TOKENIZER_FILE
from model.tokenizer import Tokenizer
from server.client.cli import build_parser, make_options
from server.core.offline import translate_ids
from server.proto.translation.v1 import translation_pb2 as pb
from server.text.markup import TextType, parse
from server.text.placeholders import Placeholders, spans, text_and_placeholders, without_placeholders
from tests.serving import onnx_model, request, runner_of, running_server

FORMS = [
    *("%s", "%d", "%i", "%u", "%x", "%f", "%c", "%p", "%@", "%1$s", "%2$d", "%.*s", "%*d", "%lu", "%lld", "%zu"),
    *("%I64d", "%-10s", "%5.2f", "%#x", "%+d", "%'d", "%.3e", "%(name)s", "%(count)d", "%(user_name)-10s"),
    *("{0}", "{12}", "{name}", "{user.name}", "{0[key]}", "{0!r}", "{0:N2}", "{0,-10:N2}", "{value:>10}"),
    *("{count, plural, one {# Datei} other {# Dateien}}", "{gender, select, female {sie} male {er} other {es}}"),
    *("{n, number}", "{d, date, short}", "{n, plural, =0 {keine} other {{n, number} Stück}}"),
    *("{{name}}", "{{ user.name }}", "{{#items}}", "{{/items}}", "{{^empty}}", "{{> partial}}", "{{{html}}}"),
    *("${name}", "${HOME}", "${user.name}"),
]
PROSE = [
    *("100 %", "50%", "50% off", "50 % der Dateien", "50\u00a0%", "zu 100%ig", "eine 100 %ige Lösung", "%%", "%%s"),
    *("% d", "%", "%APPDATA%", "%q", "%5", "%-"),
    *("{ prose }", "{prose text}", "{unbalanced", "unbalanced}", "{{0}}", "{}", "{ }", "{-1}", "{0 }"),
    *("{count, plural, one {# Datei}", "{count, plural, one {# Datei} other", "{{ }}", "{{name}"),
    *("$name", "${ name }", "${}", "$5", "US$ {"),
]
WORDS = ["Datei", "nicht", "gefunden", "Verzeichnis", "kann", "gesperrt", "werden", "über", "Fehler", "Ö"]
SEPARATORS = ["", " ", ", ", ": ", "\n", " (", ") "]


@pytest.mark.parametrize("form", FORMS)
def test_every_form_is_found_whole_in_prose(form: str) -> None:
    for text in (form, f"Die Datei {form} fehlt.", f"Datei:{form}", f"({form})"):
        assert [text[start:end] for start, end in spans(text)] == [form], text


@pytest.mark.parametrize("prose", PROSE)
def test_a_percent_sign_and_prose_braces_are_never_placeholders(prose: str) -> None:
    for text in (prose, f"Sie sparen {prose} heute.", f"{prose} heute"):
        assert spans(text) == [], text


def test_pieces_are_the_text_in_order_and_removing_placeholders_maps_offsets() -> None:
    text = "Kann %s nicht öffnen: {0}."
    runs = [("Kann ", False), ("%s", True), (" nicht öffnen: ", False), ("{0}", True), (".", False)]
    assert text_and_placeholders(text) == runs
    kept, moved = without_placeholders(text)
    assert kept == "Kann  nicht öffnen: ."
    assert [moved(offset) for offset in (0, 5, 6, 7, 8, 22, 23, 25, 26)] == [0, 5, 5, 5, 6, 20, 20, 20, 21]


def test_scanning_is_linear_in_the_text() -> None:
    """Inputs that would make a backtracking or rescanning scanner quadratic: each is 200,000 characters."""
    costly = ("{a, plural, " * 17000, "{" * 200_000, "%" * 200_000, "{{ " * 70000, "%(" * 100_000, "{0:" * 70000)
    for text in (*costly, "%" + "1" * 200_000, "%" + "A" * 200_000, "{a" + " " * 200_000):
        started = time.monotonic()
        spans(text)
        assert time.monotonic() - started < 5.0, text[:20]


def placeholders_of(text: str) -> list[str]:
    return [text[start:end] for start, end in spans(text)]


TRANSLATORS: dict[str, Callable[[str], str]] = {
    "upper": str.upper,
    "reversed words": lambda unit: " ".join(reversed(unit.split())),
    "shorter": lambda unit: " ".join(unit.split()[:1]) or "x",
    "longer": lambda unit: f"{unit} und noch mehr Worte dazu",
    "empty": lambda unit: "",
    "writes its own": lambda unit: f"%s {unit} {{0}} {{{{name}}}}",
}


def documents(text_type: TextType) -> st.SearchStrategy[str]:
    """Random texts of words and placeholders; HTML and XML ones in paragraphs with inline tags among them."""
    item = st.one_of(st.sampled_from(WORDS), st.sampled_from(FORMS), st.just("<b>"), st.just("</b>"))
    if text_type is TextType.TEXT:
        item = st.one_of(st.sampled_from(WORDS), st.sampled_from(FORMS))
    runs = st.lists(st.tuples(item, st.sampled_from(SEPARATORS)), min_size=1, max_size=12)
    joined = runs.map(lambda pairs: "".join(a + b for a, b in pairs))
    if text_type is TextType.TEXT:
        return joined
    root = "doc" if text_type is TextType.XML else "div"
    return st.lists(joined, min_size=1, max_size=3).map(
        lambda blocks: f"<{root}>" + "".join(f"<p>{block}</p>" for block in blocks) + f"</{root}>"
    )


@pytest.mark.parametrize("text_type", list(TextType))
@pytest.mark.parametrize("translator", list(TRANSLATORS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_each_placeholder_comes_back_exactly_once_in_source_order(
    text_type: TextType, translator: str, data: st.DataObject
) -> None:
    text = data.draw(documents(text_type))
    document = parse(text, text_type, 256)
    assert not any(spans(unit) for unit in document.units), "the model saw a placeholder"
    translated, _ = document.render([TRANSLATORS[translator](unit) for unit in document.units])
    assert placeholders_of(translated) == placeholders_of(text)


def test_plain_text_is_written_as_the_model_wrote_it_with_its_placeholders_placed() -> None:
    document = parse("Das Verzeichnis %s kann nicht gesperrt werden.", TextType.TEXT, 256)
    assert document.units == ["Das Verzeichnis  kann nicht gesperrt werden."]
    translated, placed = document.render(["The directory <x> & cannot be locked."])
    assert translated == "The directory %s <x> & cannot be locked."
    assert placed


def test_a_text_of_placeholders_alone_comes_back_unchanged_without_the_model() -> None:
    document = parse("%s: %d", TextType.TEXT, 256)
    assert document.units == []
    assert document.render([]) == ("%s: %d", False)


def test_html_and_xml_keep_placeholders_beside_their_tags_and_kept_pieces() -> None:
    html = '<p>Datei <b>%s</b> nicht gefunden. <code>{x}</code> <img alt="Bild von %s"> <img alt="Ein Bild"></p>'
    document = parse(html, TextType.HTML, 256)
    assert document.units == ["Ein Bild", "Datei  nicht gefunden.   "]
    translated, _ = document.render(["A picture", "File not found."])
    assert translated.startswith("<p>File <b>%s</b> not found")
    assert '<img alt="Bild von %s">' in translated and '<img alt="A picture">' in translated
    assert placeholders_of(translated) == placeholders_of(html) == ["%s", "{x}", "%s"]
    xml = "<string>Hallo {{name}}, du hast {count, plural, one {# Nachricht} other {# Nachrichten}}.</string>"
    units = parse(xml, TextType.XML, 256).units
    assert units == ["Hallo , du hast ."]


def test_turned_off_the_model_reads_placeholders_as_text() -> None:
    text = "Das Verzeichnis %s kann nicht gesperrt werden."
    assert parse(text, TextType.TEXT, 256, Placeholders.OFF).units == [text]
    assert parse(f"<p>{text}</p>", TextType.HTML, 256, Placeholders.OFF).units == [text]
    assert parse(f'<img alt="{text}">', TextType.HTML, 256, Placeholders.OFF).units == [text]


def test_the_cli_keeps_placeholders_unless_told_not_to() -> None:
    base = ["--source", "de", "--target", "en"]
    assert make_options(build_parser().parse_args(base)).placeholders == pb.PLACEHOLDERS_KEEP
    off = build_parser().parse_args([*base, "--no-keep-placeholders"])
    assert make_options(off).placeholders == pb.PLACEHOLDERS_OFF


# UI strings as Debian's German message catalogs write them (coreutils, apt, dpkg, glib and the like)
DEBIAN_STRINGS = [
    "Das Verzeichnis %s kann nicht gesperrt werden.",
    "Die Datei %s wurde nicht gefunden.",
    "Kann %s nicht öffnen: %s",
    "%d Dateien wurden gelöscht.",
    "Fehler beim Lesen von %s.",
    "Paket %1$s hängt von %2$s ab.",
    "Es werden %lu Bytes benötigt.",
    "Der Benutzer %(name)s existiert nicht.",
    "Die Datei {0} ist zu groß.",
    "Hallo {{name}}, willkommen!",
    "Das Verzeichnis ${HOME} ist voll.",
]
PLAIN_SENTENCES = ["Ich habe keine Zeit.", "Wo ist der Bahnhof?"]


@pytest.mark.shipped
def test_debian_strings_keep_their_placeholders_on_the_shipped_model_and_off_is_as_before(
    exported_shipped: Path,
) -> None:
    model = onnx_model(exported_shipped, max_slots=16)
    texts = [*DEBIAN_STRINGS, *PLAIN_SENTENCES]
    with running_server(model) as served:
        kept = served.stub.Translate(request(texts, beam_size=4)).results
        off = served.stub.Translate(request(texts, beam_size=4, placeholders=pb.PLACEHOLDERS_OFF)).results
        html = served.stub.Translate(
            request([f"<p>{text}</p>" for text in DEBIAN_STRINGS], beam_size=4, text_type=pb.TEXT_TYPE_HTML)
        ).results
    assert "%s" in kept[0].translation and kept[0].translation.count("%") == 1, kept[0].translation
    for text, result, document in zip(DEBIAN_STRINGS, kept[: len(DEBIAN_STRINGS)], html, strict=True):
        assert placeholders_of(result.translation) == placeholders_of(text), (text, result.translation)
        assert result.tag_placement == pb.TAG_PLACEMENT_PROPORTIONAL
        assert placeholders_of(document.translation) == placeholders_of(text), (text, document.translation)
    tok = Tokenizer(exported_shipped / TOKENIZER_FILE)
    penalty = model.description.default_length_penalty["de-en"]
    offline = translate_ids(runner_of(model), [tok.encode_source(t, "en") for t in texts], 4, penalty, None)
    as_before = [tok.decode(list(hypotheses[0].tokens)) for hypotheses in offline]
    assert [result.translation for result in off] == as_before
    assert [result.translation for result in kept[len(DEBIAN_STRINGS) :]] == as_before[len(DEBIAN_STRINGS) :]
