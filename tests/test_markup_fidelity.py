"""What an outside run against the server found (issue 64): a tag read as a browser reads it, control characters
and all; identifiers kept; no inline element emptied by its translation; the space beside a kept piece kept.

Documents go through `parse_document`, the entry the servicer's request preparation reads markup with.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.text.documents import RequestLimits, sentence_boundaries
from server.text.markup import MarkupDocument, TextType
from server.text.markup_documents import parse_document
from server.text.markup_lexer import Kind, tokens
from server.text.splitter import join, split

LIMITS = RequestLimits()
# C0 and C1 controls, and the characters Python's `\s` reads as whitespace where HTML's tokenizer does not
CONTROLS = [chr(c) for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]] + ["\xa0", "\u2028", "\u3000"]


def document(text: str, text_type: TextType = TextType.HTML) -> MarkupDocument:
    return parse_document(0, text, text_type, LIMITS)


def translated(doc: MarkupDocument, translate: dict[str, str], language: str = "en") -> str:
    """The document rendered as the server renders it: each unit split into sentences, each sentence replaced by
    `translate`'s entry (itself when none), joined with the unit's separators and their sentence edges given."""
    texts, edges = [], []
    for unit in doc.units:
        parts = split(unit, language)
        pieces = [translate.get(piece, piece) for piece in parts.pieces]
        texts.append(join(pieces, parts.separators))
        edges.append(sentence_boundaries(parts, pieces))
    return doc.render(texts, edges)[0]


def tag_names(text: str) -> list[tuple[Kind, str]]:
    return [(t.kind, t.name) for t in tokens(text) if t.kind in (Kind.START, Kind.END, Kind.VOID)]


@pytest.mark.parametrize("text_type", [TextType.HTML, TextType.XML])
def test_a_nul_inside_a_tag_keeps_it_a_tag_never_text_for_the_model(text_type: TextType) -> None:
    """A browser reads NUL in a tag name or attribute as U+FFFD. (Broken before: the parser's tag name stopped at
    NUL and the whole tag was text: the model got `<b\\x00>` and `href="/x"` and the closing `</b>` came back
    alone.)"""
    bold = document("<p>The house is <b\x00>big</b>.</p>", text_type)
    link = document('<p>The <a\x00href="/x">house</a> is big.</p>', text_type)
    for doc in (bold, link):
        assert all("<" not in unit and "href" not in unit and "\x00" not in unit for unit in doc.units), doc.units
        assert doc.render([unit.upper() for unit in doc.units])[0].count("\x00") == 1
    if text_type is TextType.HTML:  # XML has no element of that name: a block of its own
        assert bold.units == ["The house is big."] and link.units == ["The house is big."]
        out = translated(bold, {"The house is big.": "Das Haus ist groß."})
        assert out == "<p>Das Haus ist <b\x00>groß</b>.</p>"


_TAGGED = ('<a href="/x" title="Hi there">', "<b>", "<span class=x>")


@settings(max_examples=300, deadline=None)
@given(
    tag=st.sampled_from(_TAGGED),
    cut=st.floats(0, 1),
    control=st.sampled_from(CONTROLS),
    text_type=st.sampled_from([TextType.HTML, TextType.XML]),
)
def test_a_control_character_anywhere_in_a_tag_never_sends_markup_to_the_model(
    tag: str, cut: float, control: str, text_type: TextType
) -> None:
    """Wherever a control character stands in a tag (after its name's first letter: before it, `<` is text to a
    browser too), the tag stays markup, its attributes are never words for the model, and it comes back byte
    for byte."""
    at = 2 + round(cut * (len(tag) - 3))
    broken = tag[:at] + control + tag[at:]
    name = re.match(r"<(\w+)", tag)
    assert name is not None
    text = f"<p>The {broken}house</{name.group(1)}> is big.</p>"
    doc = document(text, text_type)
    for unit in doc.units:
        assert not re.search(r"[<>=]|href|/x|class", unit), (broken, doc.units)
    if text_type is TextType.HTML:  # an unknown name is an inline element: the sentence stays whole
        assert "The house is big." in doc.units, (broken, doc.units)
    assert doc.render(list(doc.units))[0] == text
    assert tag_names(doc.render([unit.upper() for unit in doc.units])[0]) == tag_names(text)


def test_a_tag_splits_into_attributes_where_a_browser_splits_it() -> None:
    """HTML's whitespace is tab, line feed, form feed, carriage return and space: a vertical tab or no-break
    space is part of a name or value. (Broken before: the title after one was translated, a browser seeing no
    title there.)"""
    for space in ("\v", "\xa0", "\x1c"):
        doc = document(f'<p>The <a href=/x{space}title="Hi there">house</a> is big.</p>')
        assert doc.units == ["The house is big."], space
        doc = document(f'<p>The <img{space}alt="Hi there"> is big.</p>')
        assert doc.units == ["The  is big."], space
    assert document('<p>The <a href=/x\ttitle="Hi there">house</a>.</p>').units == ["Hi there", "The house."]


def test_identifiers_in_tt_kbd_samp_var_are_kept_as_code_is() -> None:
    """`tt` is the old `code`: manuals hold function names in it. (Broken before: `<tt>deflate()</tt>` went to the
    model and came back `<tt></tt>` or with a German word in it.)"""
    text = "<p>Call <tt>deflate()</tt> with <kbd>Ctrl</kbd>, <samp>ok</samp> and <var>n</var> now.</p>"
    doc = document(text)
    assert doc.units == ["Call  with ,  and  now."]
    out = translated(doc, {"Call with, and now.": "Rufen Sie jetzt mit, und auf."})
    for kept in ("<tt>deflate()</tt>", "<kbd>Ctrl</kbd>", "<samp>ok</samp>", "<var>n</var>"):
        assert kept in out, out
    xml = document("<doc><p>Call <tt>deflate()</tt> now.</p></doc>", TextType.XML)
    assert xml.units == ["Call  now."]


def test_a_link_the_translation_has_no_word_for_keeps_its_source_words() -> None:
    """The manuals' `<a href="tutorial2/libxslt_pipes.html">Tutorial2</a>` came back `<a ...></a>` where the model
    wrote no word for it. (Broken before: both links of the list item below, and the lone one, came back
    empty.)"""
    lone = document('<li><a href="t2.html">Tutorial2</a></li>')
    assert translated(lone, {"Tutorial2": "."}) == '<li><a href="t2.html">Tutorial2.</a></li>'
    pair = document('<li><a href="t2.html">Tutorial2</a>, <a href="t3.html">Tutorial3</a></li>')
    out = translated(pair, {"Tutorial2, Tutorial3": "Tutorial3"})
    assert out == '<li><a href="t2.html">Tutorial3</a> <a href="t3.html">Tutorial3</a></li>'
    after = document('<p>Use it. See <b>this</b> <a href="x">the <i>big</i> house</a>.</p>')
    out = translated(after, {"See this the big house.": "Siehe."})  # the link with the element inside it
    assert out == '<p>Use it. <b>Siehe</b>. <a href="x">the <i>big</i> house</a></p>'


_WORDS = st.sampled_from(["Haus", "a", "Tutorial2", "ist", "é", "3", "groß"])
_TRANSLATION = st.lists(st.sampled_from(["Das", "x", "2", " ", ".", ", ", "()", "Tür", "—"]), max_size=8).map("".join)


def _held_words(text: str) -> list[bool]:
    """Per start tag, in order: whether its element holds a letter or digit (to its matching end tag)."""
    held: list[bool] = []
    open_at: list[tuple[str, int]] = []  # (name, index into held)
    for token in tokens(text):
        if token.kind is Kind.START:
            open_at.append((token.name, len(held)))
            held.append(False)
        elif token.kind is Kind.END and any(name == token.name for name, _ in open_at):
            while open_at.pop()[0] != token.name:
                pass
        elif token.kind is Kind.TEXT and any(char.isalnum() for char in token.raw):
            for _, index in open_at:
                held[index] = True
    return held


@settings(max_examples=400, deadline=None)
@given(
    before=st.lists(_WORDS, max_size=3),
    inside=st.lists(_WORDS, min_size=1, max_size=3),
    inner=st.lists(_WORDS, max_size=2),
    after=st.lists(_WORDS, max_size=3),
    translation=_TRANSLATION,
    sentence_edges=st.booleans(),
)
def test_no_inline_element_comes_back_empty_wherever_its_tags_are_placed(
    before: list[str], inside: list[str], inner: list[str], after: list[str], translation: str, sentence_edges: bool
) -> None:
    """An element that held words holds words after any translation: its own, where the translation has one
    for it, else its source's."""
    nested = f" <i>{' '.join(inner)}</i>" if inner else ""
    text = f"<p>{' '.join(before)} <a href='x'>{' '.join(inside)}{nested}</a> {' '.join(after)}</p>"
    doc = document(text)
    if not doc.units:
        return
    edges = [((0, 0), (len(doc.units[0]), len(translation)))] if sentence_edges else []
    out = doc.render([translation], edges)[0]
    assert tag_names(out) == tag_names(text)
    assert [held or not was for held, was in zip(_held_words(out), _held_words(text), strict=True)] == [True] * len(
        _held_words(text)
    ), out


def test_a_kept_piece_at_the_unit_s_edge_keeps_its_space() -> None:
    """`<p><code>foo()</code> returns the value.</p>` keeps the space after `</code>` however the translation
    begins. (Broken before, where the translation came without the unit's leading space: the code was glued to the
    first word, `<code>foo()</code>gibt`.)"""
    lead = document("<p><code>foo()</code> returns the value.</p>")
    assert translated(lead, {"returns the value.": "gibt den Wert zurück."}) == (
        "<p><code>foo()</code> gibt den Wert zurück.</p>"
    )
    assert lead.render(["gibt den Wert zurück."])[0] == "<p><code>foo()</code> gibt den Wert zurück.</p>"
    trail = document("<p>Run <code>ls</code></p>")
    assert trail.render(["Führe aus"])[0] == "<p>Führe aus <code>ls</code></p>"
    glued = document("<p><code>foo</code>bar baz.</p>")  # touched a word in the source: still touches one
    assert glued.render(["Bar baz."])[0] == "<p><code>foo</code>Bar baz.</p>"
    chinese = document("<p><code>foo()</code> returns the value.</p>")
    assert chinese.render(["返回值。"])[0] == "<p><code>foo()</code>返回值。</p>"


@settings(max_examples=300, deadline=None)
@given(words=st.lists(st.sampled_from(["gibt", "den", "Wert", "zurück", ".", "2"]), min_size=1, max_size=6))
def test_a_leading_kept_piece_is_never_glued_to_a_translated_word(words: list[str]) -> None:
    doc = document("<p><code>foo()</code> returns the value.</p>")
    out = doc.render([" ".join(words)])[0]
    assert not re.search(r"</code>\w", out), out
