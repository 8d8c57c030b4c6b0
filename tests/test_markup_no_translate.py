"""Attributes under `translate="no"` (server.text.markup): an element that is not translated keeps its translated
attributes (title, alt, placeholder, aria-label) byte for byte, on itself and on every element inside it, while the
same attributes elsewhere in the document are translated."""

from __future__ import annotations

import pytest

from server.text.markup import TextType, parse

HTML = (
    '<p title="Ein Titel">Das Haus ist groß.</p>'
    '<p>Die Firma <abbr translate="no" title="Gesellschaft mit beschränkter Haftung">GmbH</abbr> ist klein.</p>'
    '<div translate="no" title="Kopfzeile"><p title="Innerer Titel">Nicht dies</p><img alt="Ein Logo">'
    '<input placeholder="Suchen Sie hier" aria-label="Suchfeld"></div>'
    '<div class="notranslate"><span title="Noch ein Titel">Acme</span></div>'
)
XML = (
    '<r><p title="Ein Titel">Das Haus ist groß.</p>'
    '<p translate="no" title="Kopfzeile"><b title="Innerer Titel">Nicht dies</b></p></r>'
)
KEPT = ["Gesellschaft mit beschränkter Haftung", "Kopfzeile", "Innerer Titel", "Ein Logo", "Suchen Sie hier",
        "Suchfeld", "Noch ein Titel"]  # fmt: skip


@pytest.mark.parametrize(("text", "text_type"), [(HTML, TextType.HTML), (XML, TextType.XML)])
def test_a_title_inside_translate_no_stays_as_it_came_and_one_outside_is_translated(
    text: str, text_type: TextType
) -> None:
    """Deliberate break: the builder's start tag reading its attributes as translated whatever its `translate`
    (`self._tag(token.raw, True)` in `_Builder._start`) fails it: "Kopfzeile" and the inner titles became units."""
    document = parse(text, text_type, 16)
    assert "Ein Titel" in document.units  # the attribute is translated where its element is
    kept = [value for value in KEPT if f'"{value}"' in text]
    assert not [unit for unit in document.units if any(value in unit for value in kept)], document.units
    out, _ = document.render([unit.upper() for unit in document.units])  # every translated word changes
    assert 'title="EIN TITEL"' in out
    for value in kept:
        assert f'"{value}"' in out and value.upper() not in out, value
