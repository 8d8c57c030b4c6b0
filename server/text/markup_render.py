"""A unit's markup put back around its translation: tags placed, spaces kept, no element emptied.

`server.text.markup` reads a document into units of `Item`s; this module renders one unit. Its tags go where
`server.text.tag_placement` puts them; an inline element that held words in the source and would hold none
in the translation (the model wrote no word for `Tutorial2` or `deflate()`) gets back its source content,
so a link never comes back empty.
"""

from __future__ import annotations

import html
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field

from server.text.splitter import translatable
from server.text.tag_placement import Boundaries, Edge, place


@dataclass(frozen=True)
class AttributeSlot:
    """A translated attribute's value inside a tag."""

    unit: int  # index into MarkupDocument.units
    raw: str  # the value as it came, quotes included


Piece = str | AttributeSlot  # raw markup, or an attribute value to fill in


@dataclass(frozen=True)
class Item:
    """One thing inside a unit: text for the model, or a tag or kept piece that the translation carries."""

    edge: Edge | None  # None: text; else where the tag snaps to in the translation
    pieces: tuple[Piece, ...]  # the raw markup
    text: str = ""  # text items: the unescaped text the model sees
    # Text kept as it came (translate="no"): a stray "<" in it is escaped when translated words may follow
    kept_text: bool = False


@dataclass(frozen=True)
class Block:
    """One translation unit of inline content."""

    unit: int  # index into MarkupDocument.units
    items: tuple[Item, ...]


@dataclass
class _Group:
    """Tags with no text between them: they move together, so `<span translate="no">Acme</span>` stays whole."""

    offset: int  # where in the unit's source text they stand
    edge: Edge  # where they snap to: their own edge if all share it, else ANY
    members: list[str]  # their rendered markup
    source_after: list[str] = field(default_factory=list)  # the raw source text up to the next group


def render_piece(piece: Piece, units: list[str], translations: Sequence[str]) -> str:
    if isinstance(piece, str):
        return piece
    translation = translations[piece.unit]
    if translation == units[piece.unit]:
        return piece.raw
    quote = piece.raw[0] if piece.raw[0] in "\"'" else '"'
    return quote + html.escape(translation, quote=True) + quote


def render_block(
    block: Block, units: list[str], translations: Sequence[str], boundaries: Boundaries, plain: bool = False
) -> tuple[str, bool]:
    """The unit's markup around its translation; as it came when the translation is its own text. `plain`: the unit
    is plain text around kept placeholders, whose translation is written as it is, never escaped."""
    source, translation = units[block.unit], translations[block.unit]
    rendered = ["".join(render_piece(p, units, translations) for p in item.pieces) for item in block.items]
    if translation == source:
        return "".join(rendered), False
    if plain and len(block.items) == 1:  # plain text without placeholders: the translation is the text
        return translation, False
    escape = _as_is if plain else _escaped
    translation = _breaks_back(block, translation, boundaries, plain)
    groups, elements = _groups(block.items, rendered)
    positions = place([g.offset for g in groups], [g.edge for g in groups], source, translation, boundaries)
    emptied = _emptied(elements, groups, positions, source, translation)
    out, done = [], 0
    for k, (group, position) in enumerate(zip(groups, positions, strict=True)):
        members = _spaced(group.members, group.edge, group.offset, source, position, translation)
        if k in emptied.starts:
            members = _spaced_outside(members, group.offset, source, position, translation, before=True)
        elif k in emptied.ends:
            members = _spaced_outside(members, group.offset, source, position, translation, before=False)
        out += [escape(translation[done:position]), *members]
        out += group.source_after if k in emptied.gaps else []
        done = position
    out.append(escape(translation[done:]))
    return "".join(out), bool(groups)


def _groups(items: Sequence[Item], rendered: list[str]) -> tuple[list[_Group], list[tuple[int, int]]]:
    """The unit's tag groups, and its elements as (group of the start tag, group of the end tag) pairs."""
    groups: list[_Group] = []
    elements: list[tuple[int, int]] = []
    open_at: list[int] = []  # groups of the start tags not yet closed in this unit
    offset, after_text = 0, True
    for item, markup in zip(items, rendered, strict=True):
        if item.edge is None:
            offset, after_text = offset + len(item.text), True
            if groups:
                groups[-1].source_after.append(markup)
            continue
        markup = markup.replace("<", "&lt;") if item.kept_text else markup
        if after_text:
            groups.append(_Group(offset, item.edge, [markup]))
        else:
            group = groups[-1]
            group.edge = group.edge if group.edge is item.edge else Edge.ANY
            group.members.append(markup)
        after_text = False
        if item.edge is Edge.OPEN:
            open_at.append(len(groups) - 1)
        elif item.edge is Edge.CLOSE and open_at:
            elements.append((open_at.pop(), len(groups) - 1))
    return groups, elements


@dataclass
class _Emptied:
    """The elements that held words in the source and would hold none in the translation, given back their source
    text: by the groups of their start and end tags, and of the tags each gap of source text follows."""

    starts: set[int] = field(default_factory=set)
    ends: set[int] = field(default_factory=set)
    gaps: set[int] = field(default_factory=set)


def _emptied(
    elements: list[tuple[int, int]], groups: list[_Group], positions: list[int], source: str, translation: str
) -> _Emptied:
    """Every element emptied by the translation, outermost first: its inner elements then hold their words."""
    emptied = _Emptied()
    for first, last in sorted(elements, key=lambda pair: (pair[0], -pair[1])):
        if first == last or not emptied.gaps.isdisjoint(range(first, last)):
            continue
        held = translatable(source[groups[first].offset : groups[last].offset])
        if held and not translatable(translation[positions[first] : positions[last]]):
            emptied.starts.add(first)
            emptied.ends.add(last)
            emptied.gaps.update(range(first, last))
    return emptied


def _breaks_back(block: Block, translation: str, boundaries: Boundaries, plain: bool) -> str:
    """The translation with what stood between its sentences (and around them) as it came: the model saw the unit's
    line breaks as spaces, and its sentences' translations were joined with what it saw, one character for one,
    so a line break between two sentences of `xml:space="preserve"` text or a string resource stays one."""
    if not boundaries:
        return translation
    unescape = _as_is if plain else html.unescape
    original = "".join(unescape(str(item.pieces[0])) for item in block.items if item.edge is None)
    edges = [(0, 0), *boundaries, (len(original), len(translation))]
    out: list[str] = []
    for k in range(0, len(edges), 2):
        (source_from, target_from), (source_to, target_to) = edges[k], edges[k + 1]  # a run between sentences
        if source_to - source_from != target_to - target_from:
            return translation  # not the run the sentences were joined with: nothing to put back
        out.append(original[source_from:source_to])
        if k + 2 < len(edges):
            out.append(translation[target_to : edges[k + 2][1]])  # the next sentence's translation
    return "".join(out)


def _spaced(members: list[str], edge: Edge, offset: int, source: str, position: int, translation: str) -> list[str]:
    """Tags placed at a gap, with the gap's spaces. A piece that stood between two words with a space on each
    side (`Die Firma <span translate="no">Acme</span> ist`) left the model a double space, which it writes as
    one, so the piece gets back the space it lost on one side. And a side of a piece standing alone (no tag that
    opens or closes words of the translation, which stays at their edge) that touched no letter or digit in the
    source touches none where the word beside it is of a script written with spaces: `zurück, <xliff:g>%1$s
    </xliff:g>!` placed after "back" gives "back %1$s!", not "back%1$s!"; placed after "回来" it stays. A side
    at the unit's edge has nothing beside it: `<code>foo()</code> returns` keeps its space after the code."""
    source_before, source_after = _beside(source, offset)
    before, after = _beside(translation, position)
    if source_before.isspace() and source_after.isspace() and before.isspace() != after.isspace():
        return [*members, " "] if before.isspace() else [" ", *members]
    if edge is not Edge.ANY:
        return members  # a tag at a word's edge
    lead = [" "] if spaced_word(before) and source_before and not source_before.isalnum() else []
    trail = [" "] if spaced_word(after) and source_after and not source_after.isalnum() else []
    return [*lead, *members, *trail]


def _spaced_outside(
    members: list[str], offset: int, source: str, position: int, translation: str, before: bool
) -> list[str]:
    """An element given back its source content, with the space it had outside it where the translation's text
    beside it has none: `Siehe. <a>Tutorial2</a>`, not `Siehe.<a>Tutorial2</a>`."""
    source_side = _beside(source, offset)[0 if before else 1]
    side = _beside(translation, position)[0 if before else 1]
    gap = source_side.isspace() and (spaced_word(side) or (before and side in _SPACED_AFTER))
    if not gap or (members[0] if before else members[-1]) == " ":
        return members
    return [" ", *members] if before else [*members, " "]


def _escaped(text: str) -> str:
    return html.escape(text, quote=False)


def _as_is(text: str) -> str:
    return text


def _beside(text: str, offset: int) -> tuple[str, str]:
    """The characters before and after `offset` in `text`, "" past either end."""
    return text[offset - 1 : offset] if offset > 0 else "", text[offset : offset + 1]


_SPACED_AFTER = frozenset(",.;:!?)]}")  # punctuation a space follows in scripts written with spaces
# Scripts written without spaces between words: a piece placed beside one of their characters gets no space
_UNSPACED_SCRIPTS = ("CJK", "HIRAGANA", "KATAKANA", "HALFWIDTH KATAKANA", "THAI", "LAO", "KHMER", "MYANMAR")


def spaced_word(char: str) -> bool:
    """Whether `char` is a letter or digit of a script that puts spaces between its words."""
    return char.isalnum() and not unicodedata.name(char, "").startswith(_UNSPACED_SCRIPTS)
