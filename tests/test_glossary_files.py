"""DeepL's glossary entry formats, TSV and CSV: entries read in order with their lines, and each line that breaks
its format refused naming the line."""

from __future__ import annotations

import itertools

import pytest

from server.text.glossary_files import FileEntry, GlossaryFileError, read_csv, read_tsv


def test_tsv_reads_one_entry_per_line_trimmed_with_its_line_number_across_line_ends() -> None:
    text = "Haus\thouse\r\n\n  Bahnhof \t train station\rGeheimpolizei\tsecret police\n"
    assert list(read_tsv(text)) == [
        FileEntry(1, "Haus", "house"),
        FileEntry(3, "Bahnhof", "train station"),
        FileEntry(4, "Geheimpolizei", "secret police"),
    ]


def test_tsv_keeps_commas_quotes_and_hashes_as_text_and_skips_comments_only_when_asked() -> None:
    text = '# Marken\n"Zug", sagte er\t"train", he said\n'
    with pytest.raises(GlossaryFileError, match=r"^line 1 has no tab"):
        list(read_tsv(text))
    assert list(read_tsv(text, comments=True)) == [FileEntry(2, '"Zug", sagte er', '"train", he said')]
    assert list(read_tsv("#hashtag\t#hashtag\n")) == [FileEntry(1, "#hashtag", "#hashtag")]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Haus\thouse\nBahnhof station\n", "line 2 has no tab; an entry is source<TAB>target"),
        ("Haus\thouse\tmaison\n", "line 1 has 2 tabs; an entry is source<TAB>target"),
        ("a\tb\n\n\t house\n", "line 3 has no source term"),
        ("Haus\t  \n", "line 1 has no target term"),
    ],
)
def test_a_tsv_line_that_breaks_the_format_is_named_by_its_number(text: str, message: str) -> None:
    with pytest.raises(GlossaryFileError) as refused:
        list(read_tsv(text))
    assert str(refused.value).startswith(message)
    assert refused.value.line == int(message.split()[1])


def test_tsv_other_line_separators_stay_in_the_term_for_its_rules_to_refuse() -> None:
    """Only LF, CRLF and CR end a line (DeepL's): a U+2028 or form feed is the term's, which the edge refuses."""
    assert list(read_tsv("a\u2028b\tc\x0cd\n")) == [FileEntry(1, "a\u2028b", "c\x0cd")]


def test_csv_reads_rfc_4180_quoting_and_the_optional_languages() -> None:
    text = 'Haus,house\r\n\n"Zug, schnell","fast train"\n"sag ""hallo""",say "hello"\nBahnhof , station ,de, en\n'
    assert list(read_csv(text)) == [
        FileEntry(1, "Haus", "house"),
        FileEntry(3, "Zug, schnell", "fast train"),
        FileEntry(4, 'sag "hallo"', 'say "hello"'),
        FileEntry(5, "Bahnhof", "station", ("de", "en")),
    ]


def test_csv_names_an_entry_by_the_line_it_starts_on_when_a_quoted_field_spans_lines() -> None:
    entries = list(read_csv('a,b\n"zwei\nZeilen",two\nc,d\n'))
    assert [(entry.line, entry.source) for entry in entries] == [(1, "a"), (2, "zwei\nZeilen"), (4, "c")]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Haus,house\nBahnhof\n", "line 2 has 1 fields; a CSV entry has 2 (source,target) or 4"),
        ("Haus,house,de\n", "line 1 has 3 fields"),
        ("a,b\n,house\n", "line 2 has no source term"),
        ('a,b\n"Zug"x,train\n', "line 2 is not CSV as RFC 4180 writes it"),
        ('a,b\n"Zug,train\nc,d\n', "line 2 is not CSV as RFC 4180 writes it"),  # a quote that never closes
    ],
)
def test_a_csv_line_that_breaks_the_format_is_named_by_its_number(text: str, message: str) -> None:
    with pytest.raises(GlossaryFileError) as refused:
        list(read_csv(text))
    assert str(refused.value).startswith(message)


def test_entries_are_read_as_they_are_asked_for() -> None:
    """A caller that stops at its limit reads no further: a huge text costs what the limit allows."""
    text = "a\tb\n" * 5 + "broken line\n"
    assert len(list(itertools.islice(read_tsv(text), 3))) == 3
    assert len(list(itertools.islice(read_csv(text.replace("\t", ",")), 3))) == 3
