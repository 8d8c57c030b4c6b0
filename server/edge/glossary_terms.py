"""What a glossary may hold, however it arrives (inline in a request, stored, as TSV or CSV), and the one glossary a
call gets: its inline terms, then its stored glossary's where the languages agree.

Each rule is one function here and refuses through `server.edge.refusals`, naming the entry and the limit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace

from model.languages import known, same_written_language
from server.edge.glossaries import Glossary, NewGlossary
from server.edge.refusals import Refusal
from server.edge.request import MAX_LANGUAGE_CODE_CHARS, UNDETERMINED, TranslateCall
from server.text.glossary_files import FileEntry, GlossaryFileError, read_csv, read_tsv
from server.text.terms import Term

MAX_TERM_CHARS = 256  # per source or target term, once trimmed: a phrase, not a passage
MAX_INLINE_ENTRIES = 1_000  # per request: sent again with every call
MAX_GLOSSARY_ENTRIES = 10_000  # per stored glossary: each Translate naming it carries them all
MAX_NAME_CHARS = 256
# C0 and C1 controls (tab and line breaks among them) and Unicode's line and paragraph separators: a term is matched
# within a sentence, which never holds one.
_NOT_ONE_LINE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
ENTRY_FORMATS: dict[str, Callable[[str], Iterator[FileEntry]]] = {"TSV": read_tsv, "CSV": read_csv}


def inline_terms(entries: Iterable[tuple[str, str]]) -> tuple[Term, ...]:
    """A request's own glossary (source, target) as terms: at most MAX_INLINE_ENTRIES, each within the rules."""
    named = ((f"options.glossary[{index}]", source, target) for index, (source, target) in enumerate(entries))
    return checked_terms(named, MAX_INLINE_ENTRIES, "options.glossary", "per request")


def new_glossary(
    name: str, languages: tuple[str, str], listed: Sequence[tuple[str, str]], text: str, text_format: str
) -> NewGlossary:
    """A glossary to store, checked: its name, its two languages, and its entries, either `listed` (source, target)
    or written as `text` in `text_format` (a key of ENTRY_FORMATS), 1..MAX_GLOSSARY_ENTRIES of them."""
    name = glossary_name(name)
    source, target = glossary_languages(*languages)
    if listed and text:
        raise Refusal.ENTRIES_TWICE.error()
    if text:
        entries = _file_entries(text, text_format, source, target)
    else:
        entries = ((f"entries[{index}]", term, translation) for index, (term, translation) in enumerate(listed))
    terms = checked_terms(entries, MAX_GLOSSARY_ENTRIES, "the glossary", "per glossary")
    if not terms:
        raise Refusal.NO_ENTRIES.error(limit=MAX_GLOSSARY_ENTRIES)
    return NewGlossary(name, source, target, terms)


def checked_terms(entries: Iterable[tuple[str, str, str]], limit: int, field: str, per: str) -> tuple[Term, ...]:
    """`(where, source, target)` entries as terms, trimmed: at most `limit` of them (`field` holds them, the limit is
    `per` what), each term within the rules and each source once; InvalidRequest naming the entry by `where`. Reads
    no more than `limit` + 1 entries."""
    terms: list[Term] = []
    first_seen: dict[str, str] = {}  # source term -> where it stood first
    for count, (where, source, target) in enumerate(entries, 1):
        if count > limit:
            raise Refusal.TOO_MANY_ENTRIES.error(field=field, limit=limit, per=per)
        term = Term(_term(where, "source", source), _term(where, "target", target))
        if (first := first_seen.get(term.source)) is not None:
            raise Refusal.DUPLICATE_SOURCE.error(where=where, source=_begins(term.source), first=first)
        first_seen[term.source] = where
        terms.append(term)
    return tuple(terms)


def glossary_name(name: str) -> str:
    """A stored glossary's name, trimmed: 1..MAX_NAME_CHARS characters of one line."""
    trimmed = name.strip()
    if not trimmed:
        raise Refusal.NO_NAME.error(limit=MAX_NAME_CHARS)
    return _one_line("name", trimmed, MAX_NAME_CHARS)


def glossary_language(field: str, side: str, code: str) -> str:
    """A stored glossary's language code, trimmed: given (not left to detection) and read as a language."""
    if len(code) > MAX_LANGUAGE_CODE_CHARS:
        raise Refusal.TOO_LONG.error(field=field, chars=len(code), limit=MAX_LANGUAGE_CODE_CHARS)
    trimmed = code.strip()
    lowered = trimmed.lower()
    if not trimmed or lowered in UNDETERMINED or lowered.startswith(("und-", "und_")):
        raise Refusal.GLOSSARY_LANGUAGE.error(field=field, side=side)
    if not known(trimmed):
        raise Refusal.UNKNOWN_LANGUAGE.error(field=field, code=trimmed)
    return trimmed


def glossary_languages(source: str, target: str) -> tuple[str, str]:
    """A stored glossary's two languages, each checked, and not one language twice."""
    source = glossary_language("source_language", "source", source)
    target = glossary_language("target_language", "target", target)
    if same_language(source, target):
        raise Refusal.GLOSSARY_SAME_LANGUAGE.error(source=source, target=target)
    return source, target


def same_language(glossary_code: str, request_code: str) -> bool:
    """Whether a glossary's language serves a request's: one language in one script, the region aside (`de` serves
    `de-DE` and `de-AT`, `en` serves `en-US`, as DeepL's glossaries do; `zh-Hans` does not serve `zh-Hant`), in any
    case or spelling (`DE`, `deu`, `de_DE`); a code naming no one language (`mul`) only itself."""
    return glossary_code.lower() == request_code.lower() or same_written_language(glossary_code, request_code)


def with_glossary(call: TranslateCall, glossary: Glossary) -> TranslateCall:
    """The call with a stored glossary's terms after its inline ones, an inline term winning over a stored one with
    its source; refused unless the call names its source and both its languages are the glossary's."""
    info, options = glossary.info, call.options
    if not options.source_language:
        raise Refusal.GLOSSARY_NEEDS_SOURCE.error(glossary_id=info.glossary_id, language=info.source_language)
    # An empty target is left to routing, whose refusal lists the pairs served.
    agree = same_language(info.source_language, options.source_language) and (
        not options.target_language or same_language(info.target_language, options.target_language)
    )
    if not agree:
        raise Refusal.GLOSSARY_LANGUAGES.error(
            glossary_id=info.glossary_id,
            glossary_source=info.source_language,
            glossary_target=info.target_language,
            source=options.source_language,
            target=options.target_language,
        )
    if options.glossary:
        inline = {term.source for term in options.glossary}
        merged = options.glossary + tuple(term for term in glossary.terms if term.source not in inline)
    else:
        merged = glossary.terms  # the store's own tuple: calls naming one glossary share it
    return replace(call, options=replace(options, glossary=merged))


def _file_entries(text: str, text_format: str, source: str, target: str) -> Iterator[tuple[str, str, str]]:
    """The entries of `text`, each named by its line; a CSV line that names its languages names the glossary's."""
    try:
        for entry in ENTRY_FORMATS[text_format](text):
            if entry.languages is not None and not (
                same_language(source, entry.languages[0]) and same_language(target, entry.languages[1])
            ):
                languages, glossary = " -> ".join(entry.languages), f"{source} -> {target}"
                raise Refusal.LINE_LANGUAGES.error(line=entry.line, languages=languages, glossary=glossary)
            yield f"entries_text line {entry.line}", entry.source, entry.target
    except GlossaryFileError as error:
        raise Refusal.ENTRIES_LINE.error(format=text_format, error=error) from None


def _term(where: str, side: str, text: str) -> str:
    """One term, trimmed: not empty, within MAX_TERM_CHARS, one line."""
    term = text.strip()
    if not term:
        raise Refusal.TERM_EMPTY.error(where=where, side=side)
    return _one_line(f"{where} {side}", term, MAX_TERM_CHARS)


def _one_line(field: str, text: str, limit: int) -> str:
    if len(text) > limit:
        raise Refusal.TOO_LONG.error(field=field, chars=len(text), limit=limit)
    if (found := _NOT_ONE_LINE.search(text)) is not None:
        raise Refusal.CONTROL_CHARACTER.error(field=field, character=f"U+{ord(found.group()):04X}")
    return text


def _begins(term: str) -> str:
    """A term as a message quotes it: its beginning."""
    return term if len(term) <= 40 else term[:40] + "..."
