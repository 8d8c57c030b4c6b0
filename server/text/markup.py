"""HTML and XML documents as translation units and back: what is translated, what is left as it came.

A document becomes `units` (plain texts for the model: one per block element's inline content, one
per translated attribute) and `parts` (the raw markup around them). Block elements (p, li, td, th,
h1-h6, div, caption, title and the like) and `<br>` end a unit; inline elements (a, b, em, span,
img...) stay inside it and are put back into its translation by `server.text.markup_render`.
Left byte for byte: script, style, template and pre (which end a unit), code, tt, kbd, samp, var,
textarea, svg and math, XLIFF's and TMX's inline codes ph, bpt, ept and it inside a segment, and Android's
`<xliff:g>` placeholders (carried inside one, whole), comments, declarations, CDATA, and the text
of every element under `translate="no"` or `class="notranslate"` (inherited; `translate="yes"`
turns it back on). Of the attributes only alt, title, placeholder and aria-label are translated (not on an
element copied whole). Placeholders in translated text (`%s`, `{name}`: server.text.placeholders) are kept pieces
as inline codes are, unless turned off; a translated attribute holding one is kept whole. Plain text is one unit
whose only kept pieces are its placeholders. HTML's optional end tags close as a browser's parser closes them
(`IMPLIED_CLOSE`).
A line break inside a unit is a space to the model, as to a browser: it never ends a sentence there.

A unit whose translation is its own text comes back as it came, entities and all; otherwise its
text is escaped again, so `&lt;script&gt;` stays text. A tag is read as a browser reads it, NUL and other
control characters in it included (server.text.markup_lexer), so no markup reaches the model. Tags keep
their order, so the output has the input's tag tree (and well-formed XML stays well-formed).
"""

from __future__ import annotations

import enum
import html
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from server.text.markup_lexer import Kind, Token, tokens
from server.text.markup_render import AttributeSlot, Block, Item, Piece, render_block, render_piece
from server.text.placeholders import Placeholders, holds_placeholders, text_and_placeholders, without_placeholders
from server.text.splitter import translatable
from server.text.tag_placement import Boundaries, Edge


class TextType(enum.Enum):
    TEXT = "text"  # plain text
    HTML = "html"
    XML = "xml"


class MarkupDepthError(ValueError):
    """A document nests elements deeper than the limit."""


def _names(words: str) -> frozenset[str]:
    return frozenset(words.split())


BLOCKS = _names(
    "address article aside blockquote body br caption center col colgroup dd details dialog dir div dl dt"
    " fieldset figcaption figure footer form frameset h1 h2 h3 h4 h5 h6 head header hgroup hr html legend li"
    " link main menu meta nav noscript ol optgroup option p section select summary table tbody td tfoot th"
    " thead title tr ul"
)
INLINES = _names(  # XML mode: every element not named here is a block
    "a abbr acronym b bdi bdo big button cite data del dfn em font i img input ins label mark q rp rt ruby s"
    " small span strike strong sub sup time u wbr"
    " g x bx ex mrk ph bpt ept it"  # XLIFF's inline elements (and DITA's `ph`, its phrase)
)
KEPT_BLOCKS = frozenset({"script", "style", "template", "pre"})  # copied whole; end a unit
# Copied whole inside a unit: identifiers, keys, program output and variables (`tt` is the old `code`), form text
# and graphics
KEPT_INLINES = _names("code tt kbd samp var textarea svg math")
# XLIFF's and TMX's inline codes, copied whole inside a unit of an XML segment (an element of SEGMENTS open): what
# they hold is the original format's markup (`<bpt id="1">&lt;b&gt;</bpt>`), not text; elsewhere (DITA's `<ph>`,
# its phrase) they are plain inline elements
XLIFF_CODES = _names("ph bpt ept it")
SEGMENTS = _names("xliff tmx source target seg")
# Copied whole inside a unit by their qualified name: Android's `<xliff:g>` marks a placeholder (`%1$s`) that
# stays as it is, where XLIFF's own `<g>` holds text to translate
KEPT_QUALIFIED = frozenset({"xliff:g"})
# Line breaks inside a block are spaces to a browser and to XML's text, never the end of a sentence: the
# model sees each as a space (one for one, so offsets into the unit hold)
_LINE_BREAKS_AS_SPACES = str.maketrans(dict.fromkeys("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029", " "))
HTML_VOIDS = _names("area base br col embed hr img input link meta param source track wbr")
TRANSLATED_ATTRIBUTES = frozenset({"alt", "title", "placeholder", "aria-label"})
# HTML's optional end tags: a start tag of the key closes the nearest open element of these names with only inline
# elements above it (`<li>a<li>b`, `<li><b>a<li>b`, `<tr><td>a<tr>`, `<dt>a<dd>b`, `<p>a<ul>`), as a browser's
# parser does; XML closes nothing.
_CELLS = frozenset({"td", "th"})
_CLOSES_P = _names(
    "address article aside blockquote details dialog div dl fieldset figcaption figure footer form h1 h2 h3 h4 h5 h6"
    " header hgroup hr main menu nav ol p pre section table ul"
)
# Inline elements a browser's implied end tags do not reach past (`<p><button><div>` leaves the `p` open)
_SCOPE_BOUNDARIES = frozenset({"button", "object", "marquee", "applet"})
IMPLIED_CLOSE: dict[str, frozenset[str]] = {
    **{name: frozenset({"p"}) for name in _CLOSES_P},
    "li": frozenset({"li", "p"}),
    "dt": frozenset({"dt", "dd", "p"}),
    "dd": frozenset({"dt", "dd", "p"}),
    "tr": _CELLS | {"tr"},
    "td": _CELLS,
    "th": _CELLS,
    **{name: _CELLS | {"tr", "thead", "tbody", "tfoot"} for name in ("thead", "tbody", "tfoot")},
    "option": frozenset({"option"}),
    "optgroup": frozenset({"option", "optgroup"}),
}
XML_PREDEFINED_ENTITIES = frozenset({"amp", "lt", "gt", "quot", "apos"})
_ENTITY_REFERENCE = re.compile(r"&([A-Za-z_:][\w.:-]*);")  # by name; character references (`&#38;`) are text
# A start tag's name and attributes, split at HTML's whitespace only, as the lexer's parser splits them
_TAG_NAME = re.compile(r"<[^\t\n\f\r />]*")
_ATTRIBUTE = re.compile(  # name, value
    r"""([^\t\n\f\r "'>/=]+)(?:[\t\n\f\r ]*=[\t\n\f\r ]*("[^"]*"|'[^']*'|[^\t\n\f\r "'>]+))?"""
)


@dataclass(frozen=True)
class MarkupDocument:
    units: list[str]  # plain texts to translate, in document order
    parts: list[Piece | Block]  # the document: raw markup, attribute slots and units
    places: list[str]  # per unit, where it is for a message: "its text at character 120", "its alt attribute..."
    plain: bool = False  # plain text: no markup but its placeholders, and nothing escaped
    # Placeholders were kept: the model saw none, so one it writes would be a second copy or one the source lacks
    placeholders: bool = False

    def render(self, translations: Sequence[str], boundaries: Sequence[Boundaries] = ()) -> tuple[str, bool]:
        """The document with each unit's translation; and whether some tag was placed in a changed text.
        `boundaries`, per unit, pairs the offsets of its sentences' edges with their translations' (a tag at a
        sentence's edge stays at it); none given, a unit's tags are placed over the whole unit. With placeholders
        kept, any the model wrote is dropped first."""
        if self.placeholders:
            translations, boundaries = _own_placeholders_dropped(translations, boundaries)
        out: list[str] = []
        placed = False
        for part in self.parts:
            if isinstance(part, Block):
                edges = boundaries[part.unit] if boundaries else ()
                text, moved = render_block(part, self.units, translations, edges, self.plain)
                out.append(text)
                placed |= moved
            else:
                out.append(render_piece(part, self.units, translations))
        return "".join(out), placed


def parse(
    text: str, text_type: TextType, max_depth: int, placeholders: Placeholders = Placeholders.KEEP
) -> MarkupDocument:
    """`text` as units and markup, each placeholder of its translated text a kept piece unless `placeholders` is
    OFF; never raises on malformed markup, only `MarkupDepthError` past `max_depth`."""
    keep = placeholders is Placeholders.KEEP
    if text_type is TextType.TEXT:
        return _plain(text, keep)
    builder = _Builder(xml=text_type is TextType.XML, max_depth=max_depth, placeholders=keep)
    for token in tokens(text):
        builder.feed(token)
    builder.flush()
    return MarkupDocument(builder.units, builder.parts, builder.places, placeholders=keep)


def _plain(text: str, keep: bool) -> MarkupDocument:
    """Plain text as one unit around its placeholders, each carried as a kept inline piece is."""
    items = tuple(
        Item(Edge.ANY, (raw,)) if kept else Item(None, (raw,), raw)
        for raw, kept in (text_and_placeholders(text) if keep else [(text, False)])
    )
    unit = "".join(item.text for item in items)
    if not translatable(unit):
        return MarkupDocument([], [text], [], plain=True, placeholders=keep)
    return MarkupDocument([unit], [Block(0, items)], [""], plain=True, placeholders=keep)


def _own_placeholders_dropped(
    translations: Sequence[str], boundaries: Sequence[Boundaries]
) -> tuple[list[str], list[Boundaries]]:
    """Each unit's translation without the placeholders the model wrote, its sentences' edges moved with it."""
    dropped: list[str] = []
    moved: list[Boundaries] = []
    for unit, translation in enumerate(translations):
        text, shifted = without_placeholders(translation)
        dropped.append(text)
        edges = boundaries[unit] if boundaries else ()
        moved.append(tuple((source_at, shifted(target_at)) for source_at, target_at in edges))
    return dropped, moved if boundaries else []


@dataclass
class _Kept:
    """An element copied whole: its tokens until its matching end tag."""

    name: str  # the element's tag name, as the parser lowercased it
    inline: bool  # carried inside the unit (code, svg...) rather than ending it (script, pre...)
    raw: list[str]  # its tokens' raw texts so far
    depth: int = 1  # elements of its name open inside it, itself included


@dataclass
class _Builder:
    xml: bool
    max_depth: int
    placeholders: bool  # translated text's placeholders are kept pieces
    units: list[str] = field(default_factory=list)
    parts: list[Piece | Block] = field(default_factory=list)
    places: list[str] = field(default_factory=list)
    offset: int = 0  # where the token being read begins in the document
    unit_start: int = 0  # where the unit being gathered begins
    items: list[Item] = field(default_factory=list)  # the unit being gathered
    stack: list[tuple[str, bool]] = field(default_factory=list)  # open elements: (name, translate)
    kept: _Kept | None = None

    @property
    def translate(self) -> bool:
        return self.stack[-1][1] if self.stack else True

    def feed(self, token: Token) -> None:
        if not self.items and self.kept is None:
            self.unit_start = self.offset
        self._read(token)
        self.offset += len(token.raw)

    def _read(self, token: Token) -> None:
        if self.kept is not None:
            self._keep(token, self.kept)
        elif token.kind is Kind.TEXT:
            for raw, reference in self._text_pieces(token.raw):
                if reference:  # an XML entity the document's DTD defines: carried like an inline tag, never text
                    self.items.append(Item(Edge.ANY, (raw,)))
                elif self.translate:
                    self._add_text(raw)
                else:
                    self.items.append(Item(Edge.ANY, (raw,), kept_text=True))
        elif token.kind is Kind.OTHER:
            self.items.append(Item(Edge.ANY, (token.raw,)))
        elif token.kind is Kind.END:
            self._end(token)
        else:
            self._start(token)

    def _add_text(self, raw: str) -> None:
        """Text to translate, each placeholder in it a kept piece."""
        for piece, kept in text_and_placeholders(raw) if self.placeholders else [(raw, False)]:
            self.items.append(Item(Edge.ANY, (piece,)) if kept else Item(None, (piece,), _prose(piece)))

    def _start(self, token: Token) -> None:
        name = _local(token.name)
        if not self.xml:  # the elements this start tag ends (before its translate="no" is read from its parent)
            self._close_implied(IMPLIED_CLOSE.get(name, frozenset()))
        void = token.kind is Kind.VOID or (not self.xml and name in HTML_VOIDS)
        code = self.xml and name in XLIFF_CODES and any(_local(open_name) in SEGMENTS for open_name, _ in self.stack)
        if not void and (name in KEPT_BLOCKS | KEPT_INLINES or token.name in KEPT_QUALIFIED or code):
            self.kept = _Kept(token.name, name not in KEPT_BLOCKS, [token.raw])
            return
        translate = _translate_of(token.attrs, self.translate, self.xml)
        pieces = self._tag(token.raw, translate)
        if self._is_block(name):
            self.flush()
            self.parts += pieces
        else:
            self.items.append(Item(Edge.ANY if void else Edge.OPEN, pieces))
        if void:
            return
        self.stack.append((token.name, translate))
        if len(self.stack) > self.max_depth:
            raise MarkupDepthError(f"elements nest deeper than {self.max_depth}")

    def _close_implied(self, closed: frozenset[str]) -> None:
        """Close the open elements named in `closed` and the inline ones left open inside them, nearest first, as a
        browser does (`<li><b>a<li>b`: the second item is no longer inside the first's `<b>`, nor its translate="no"); a
        block between stops the search (`<li><ul><li>`: a nested list's item closes nothing outside it)."""
        depth = len(self.stack) - 1
        while depth >= 0:  # `<tr>` closes an open cell, then the row it was in
            name = self.stack[depth][0]
            if name in closed:
                del self.stack[depth:]
            elif self._is_block(_local(name)) or _local(name) in _SCOPE_BOUNDARIES:
                return
            depth -= 1

    def _end(self, token: Token) -> None:
        names = [name for name, _ in self.stack]
        matched = token.name in names
        if matched:
            del self.stack[len(names) - 1 - names[::-1].index(token.name) :]
        if self._is_block(_local(token.name)):
            self.flush()
            self.parts.append(token.raw)
        else:
            self.items.append(Item(Edge.CLOSE if matched else Edge.ANY, (token.raw,)))

    def _keep(self, token: Token, kept: _Kept) -> None:
        if not self.xml and kept.inline and token.kind is Kind.END and token.name in (n for n, _ in self.stack):
            self.kept = None  # `<p>Nutze <code>ls</p>`: the paragraph's end ends the code, as in a browser
            self._add_kept(kept)
            self._end(token)
            return
        kept.raw.append(token.raw)
        if token.kind is Kind.START and token.name == kept.name:
            kept.depth += 1
        elif token.kind is Kind.END and token.name == kept.name:
            kept.depth -= 1
        if kept.depth == 0:
            self.kept = None
            self._add_kept(kept)

    def _add_kept(self, kept: _Kept) -> None:
        raw = "".join(kept.raw)
        if kept.inline:
            self.items.append(Item(Edge.ANY, (raw,)))
        else:
            self.flush()
            self.parts.append(raw)

    def flush(self) -> None:
        """End the unit being gathered: a Block if it has something to translate, else its markup as it came."""
        if self.kept is not None:  # never closed: copied to the end
            kept, self.kept = self.kept, None
            self._add_kept(kept)
        text = "".join(item.text for item in self.items)
        if translatable(text):
            self.parts.append(Block(self._unit(text, f"its text at character {self.unit_start}"), tuple(self.items)))
        else:
            self.parts += [piece for item in self.items for piece in item.pieces]
        self.items = []

    def _tag(self, raw: str, translate: bool) -> tuple[Piece, ...]:
        """A start tag's markup, with a slot for each attribute value to translate."""
        name = _TAG_NAME.match(raw)
        if not translate or name is None:
            return (raw,)
        pieces: list[Piece] = []
        done = 0
        for match in _ATTRIBUTE.finditer(raw, name.end()):
            value = match.group(2)
            if value is None or match.group(1).lower() not in TRANSLATED_ATTRIBUTES:
                continue
            if self.xml and any(
                ref.group(1) not in XML_PREDEFINED_ENTITIES for ref in _ENTITY_REFERENCE.finditer(value)
            ):
                continue  # an attribute value has no place to carry `&product;` through a translation: kept whole
            text = _prose(_unquoted(value))
            if self.placeholders and holds_placeholders(text):
                continue  # nor one to put a placeholder back in: kept whole
            if translatable(text):
                place = f"its {match.group(1).lower()} attribute at character {self.offset + match.start(2)}"
                pieces += [raw[done : match.start(2)], AttributeSlot(self._unit(text, place), value)]
                done = match.end(2)
        return (*pieces, raw[done:])

    def _text_pieces(self, raw: str) -> list[tuple[str, bool]]:
        """A text token's raw text in pieces, each with whether it is an entity reference XML does not predefine
        (`&product;`: its DTD says what it stands for, which the model must neither see as words nor lose)."""
        if not self.xml or "&" not in raw:
            return [(raw, False)]
        pieces: list[tuple[str, bool]] = []
        done = 0
        for match in _ENTITY_REFERENCE.finditer(raw):
            if match.group(1) in XML_PREDEFINED_ENTITIES:  # text: `&amp;` and its like
                continue
            pieces += [(raw[done : match.start()], False)] if match.start() > done else []
            pieces.append((match.group(0), True))
            done = match.end()
        return [*pieces, (raw[done:], False)] if done < len(raw) else pieces

    def _unit(self, text: str, place: str) -> int:
        self.units.append(text)
        self.places.append(place)
        return len(self.units) - 1

    def _is_block(self, name: str) -> bool:
        if name in BLOCKS:
            return True
        return self.xml and name not in INLINES and name not in KEPT_INLINES


def _defines_entities(raw: str) -> bool:
    """Whether `raw` holds an entity reference XML does not predefine (one a DTD defines)."""
    return any(ref.group(1) not in XML_PREDEFINED_ENTITIES for ref in _ENTITY_REFERENCE.finditer(raw))


def _prose(raw: str) -> str:
    """Raw text or attribute value as the model sees it: entities decoded, line breaks as spaces."""
    return html.unescape(raw).translate(_LINE_BREAKS_AS_SPACES)


def _unquoted(value: str) -> str:
    """An attribute value without its delimiting quotes: `'"Hallo"'` is `"Hallo"`, quotes of its own kept."""
    return value[1:-1] if len(value) >= 2 and value[0] in "\"'" and value[-1] == value[0] else value


def _local(name: str) -> str:
    """The name without its XML namespace prefix."""
    return name.rpartition(":")[2]


def _translate_of(attrs: tuple[tuple[str, str | None], ...], inherited: bool, xml: bool) -> bool:
    """Whether an element's text and attributes are translated: its `translate`, its class, in XML Android's
    `translatable="false"` (a string resource left as it is), else its parent's."""
    values = dict(attrs)
    flag = values.get("translate")
    if flag is not None and flag.strip().lower() in ("yes", "no", ""):
        return flag.strip().lower() != "no"
    if "notranslate" in (values.get("class") or "").split():
        return False
    if xml and (values.get("translatable") or "").strip().lower() == "false":
        return False
    return inherited
