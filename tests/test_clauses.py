"""A sentence over the model's source limit is translated in parts, never refused (server.text.clauses): cut at clause
boundaries first, then at whitespace, then between characters, with the whitespace at each cut kept."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from model.files import TOKENIZER_FILE
from model.tokenizer import Tokenizer
from server.core.beam import Hypothesis
from server.proto.translation.v1 import translation_pb2 as pb
from server.text.clauses import UncuttableError, cut
from server.text.documents import (
    Assembler,
    PreparedText,
    Refuse,
    RequestLimits,
    TextLimitError,
    prepare_texts,
    request_text,
)
from server.text.markup import TextType
from server.text.markup_documents import RequestAssembler, prepare_request
from server.text.splitter import join
from tests.serving import fake_model, request, running_server, sample_value

TAG, EOS = 4, 3
# A licence disclaimer of the shape that once refused a whole page, in words and marks the tiny tokenizer spells
# (its translations echoed back are the text): clauses after commas, one sentence of several hundred tokens
CLAUSES = [
    "Die Sache wurde bis zur Klärung zurückgestellt",
    "ich verstehe ihre Gedankengänge nicht",
    "er wartete voller Nervosität",
    "die Stiefel reichten ihm bis zu den Knien",
    "sie schrieben gemeinsam ein Buch",
    "ich habe mich dort ausgeschlossen gefühlt",
]
DISCLAIMER = ", ".join([*CLAUSES, *reversed(CLAUSES)] * 2) + ", und das Haus ist groß."


def by_characters(text: str) -> list[int]:
    """A fake encoding: a tag, one id per character other than whitespace, EOS."""
    return [TAG, *(ord(char) for char in text if not char.isspace()), EOS]


def test_a_sentence_is_cut_at_its_clause_boundaries_each_part_as_long_as_fits() -> None:
    sentence = "alpha beta,  gamma delta;\tepsilon zeta: eta theta \u2014 iota kappa"
    parts = cut(sentence, by_characters, 24)  # 22 characters a part, tag and EOS aside
    assert parts.split.pieces == ["alpha beta,  gamma delta;", "epsilon zeta: eta theta \u2014", "iota kappa"]
    assert parts.split.separators == ["", "\t", " ", ""]  # the whitespace that stood at each cut
    assert parts.sources == [by_characters(piece) for piece in parts.split.pieces]
    assert join(parts.split.pieces, parts.split.separators) == sentence


def test_numbers_ranges_and_hyphens_are_no_clause_boundaries() -> None:
    sentence = "the sum of 1,000,000 for 1990-2000 well-known, paid in full"
    parts = cut(sentence, by_characters, 44)
    assert parts.split.pieces == ["the sum of 1,000,000 for 1990-2000 well-known,", "paid in full"]


def test_a_clause_too_long_alone_is_cut_at_whitespace() -> None:
    sentence = "one two three four five six seven eight, nine"
    parts = cut(sentence, by_characters, 14)  # 12 characters a part
    assert parts.split.pieces == ["one two three", "four five six", "seven eight,", "nine"]
    assert join(parts.split.pieces, parts.split.separators) == sentence


def test_a_run_without_whitespace_is_cut_between_characters_never_before_a_combining_mark() -> None:
    blob = "Siehe " + "aGVsbG8gd29ybGQ" * 4
    parts = cut(blob, by_characters, 12)
    assert all(len(ids) <= 12 for ids in parts.sources)
    assert parts.split.pieces[0] == "Siehe"
    assert parts.split.separators == ["", " ", *[""] * (len(parts.split.pieces) - 1)]
    assert join(parts.split.pieces, parts.split.separators) == blob
    accented = "e\u0301" * 30  # each e with a combining acute
    pieces = cut(accented, by_characters, 13).split.pieces
    assert all(piece[0] == "e" for piece in pieces) and "".join(pieces) == accented


def test_cjk_and_arabic_clause_marks_cut_with_or_without_whitespace() -> None:
    chinese = "我们去了商店\uff0c买了苹果、香蕉和橙子\uff1b然后回家了"
    parts = cut(chinese, by_characters, 10)
    assert parts.split.pieces == ["我们去了商店\uff0c", "买了苹果、", "香蕉和橙子\uff1b", "然后回家了"]
    assert parts.split.separators == ["", "", "", "", ""]  # none stood there: none is added
    arabic = "ذهبنا إلى السوق، واشترينا التفاح؛ ثم عدنا"
    parts = cut(arabic, by_characters, 20)
    assert parts.split.pieces == ["ذهبنا إلى السوق،", "واشترينا التفاح؛", "ثم عدنا"]
    assert parts.split.separators == ["", " ", " ", ""]


class Glossary(Tokenizer):
    """The tiny tokenizer, decoding a part's output (one id) as the part's translation in `translations`."""

    translations: list[str]

    def decode(self, ids: list[int]) -> str:
        return self.translations[ids[0]]


def test_parts_cut_after_a_cjk_comma_are_joined_with_a_space_into_a_script_written_with_spaces(
    tiny_model_dir: Path,
) -> None:
    """Broken before: "We went to the shop,bought apples,bananas and oranges;then went home"."""
    english = ["We went to the shop,", "bought apples,", "bananas and oranges;", "then went home"]
    japanese = ["店に行って\u3001", "りんご\u3001", "バナナとオレンジを買って\u3001", "帰った"]
    run = "aGVsbG8gd29ybGQ" * 3  # cut between characters: the parts' translations stay as close as the parts
    for sentence, translations, want in [
        ("我们去了商店\uff0c买了苹果、香蕉和橙子\uff1b然后回家了", english, " ".join(english)),
        ("我们去了商店\uff0c买了苹果、香蕉和橙子\uff1b然后回家了", japanese, "".join(japanese)),
        (run, [run[:10], run[10:20], run[20:30], run[30:40], run[40:]], run),
    ]:
        parts = cut(sentence, by_characters, 12)
        assert len(parts.split.pieces) == len(translations)
        glossary = Glossary(tiny_model_dir / TOKENIZER_FILE)
        glossary.translations = translations
        assembler = Assembler(glossary, [PreparedText(0, parts.split, parts.sources)], 1)
        done = [assembler.sentence_done(i, [Hypothesis((i,), -1.0, -1.0)], 3) for i in range(len(translations))][-1]
        assert done is not None and done.translation == want
        edges = done.boundaries[0]
        assert [want[start:end] for (_, start), (_, end) in zip(edges[::2], edges[1::2], strict=True)] == translations


@pytest.mark.parametrize(
    "sentence",
    [
        "Das Haus ist groß, und alt; " * 400,  # clauses
        "Das Haus ist groß und alt " * 400,  # words
        "aGVsbG8gd29ybGQ" * 700,  # no whitespace
    ],
)
def test_cutting_is_linear_in_the_sentence(sentence: str) -> None:
    """Each character is encoded a bounded number of times, whatever the level its cuts fall at."""
    encoded: list[int] = []

    def counting(text: str) -> list[int]:
        encoded.append(len(text))
        return by_characters(text)

    parts = cut(sentence, counting, 64)
    assert all(len(ids) <= 64 for ids in parts.sources)
    assert sum(encoded) <= 4 * len(sentence), sum(encoded) / len(sentence)


def test_a_character_over_the_limit_alone_cannot_be_cut_and_is_refused_naming_its_sentence(
    tiny_model_dir: Path,
) -> None:
    with pytest.raises(UncuttableError):
        cut("abc def", lambda text: [TAG, *([7] * 5 * len(text)), EOS], 6)
    tokenizer = Tokenizer(tiny_model_dir / TOKENIZER_FILE)
    with pytest.raises(TextLimitError, match=r"texts\[0\] sentence 0 cannot be cut into parts of at most 2 tokens"):
        prepare_texts(["Ja. Das Haus ist groß."], "de", "en", tokenizer, RequestLimits(), 2)


def echoed(assembler: RequestAssembler) -> str:
    """The translation of an assembler's one text when every sentence comes back as its own source."""
    done = None
    for index, source in enumerate(assembler.sources):
        done = assembler.sentence_done(index, [Hypothesis(tuple(source[1:-1]), -1.0, -1.0)], len(source)) or done
    assert done is not None
    return done.translation


def test_a_long_sentence_in_plain_text_is_translated_in_parts_and_joined_with_its_whitespace(
    tiny_model_dir: Path,
) -> None:
    """Broken before: the text was refused, "sentence 1 is N tokens long, over the limit of 48"."""
    tokenizer = Tokenizer(tiny_model_dir / TOKENIZER_FILE)
    text = "Das Haus ist groß.\n\n" + DISCLAIMER + "  Es hörte auf zu regnen."
    cuts: list[int] = []
    prepared = prepare_texts([text], "de", "en", tokenizer, RequestLimits(), 48, on_cut=cuts.append)
    parts = prepared[0].split
    assert len(tokenizer.encode_source(DISCLAIMER, "en")) > 400
    assert all(len(ids) <= 48 for ids in prepared[0].sources) and len(parts.pieces) > 10
    assert cuts == [len(parts.pieces) - 2]  # the disclaimer's parts; the sentences around it fit
    assert all(piece.endswith((",", ".")) for piece in parts.pieces)  # clause boundaries only
    assert set(parts.separators[2:-2]) == {" "}  # the space at each cut, between the parts' translations
    assert echoed(Assembler(tokenizer, prepared, 1)) == text


def test_a_long_sentence_in_an_html_document_is_translated_in_parts(tiny_model_dir: Path) -> None:
    """Broken before: the page was refused, "texts[0] (...) sentence 0 is N tokens long"."""
    tokenizer = Tokenizer(tiny_model_dir / TOKENIZER_FILE)
    document = f"<html><body><h1>Das Haus ist groß.</h1><p>{DISCLAIMER}</p><p>Steuerpult</p></body></html>"
    cuts: list[int] = []

    def prepare(
        texts: list[str], names: Callable[[int], str] = request_text, refuse: Refuse | None = None
    ) -> list[PreparedText]:
        return prepare_texts(texts, "de", "en", tokenizer, RequestLimits(), 48, names, cuts.append, refuse=refuse)

    assembler = prepare_request([document], TextType.HTML, prepare, tokenizer, RequestLimits(), 1)
    assert len(assembler.sources) > 10 and all(len(ids) <= 48 for ids in assembler.sources)
    assert echoed(assembler) == document
    assert cuts == [len(assembler.sources) - 2]


def test_served_text_and_html_with_a_long_sentence_are_translated_and_their_parts_counted(
    tiny_model_dir: Path,
) -> None:
    """Broken before: both calls were INVALID_ARGUMENT, "texts[0] sentence 0 is N tokens long"."""
    with running_server(fake_model(tiny_model_dir)) as served:
        text = served.stub.Translate(request([DISCLAIMER])).results[0]
        html = request([f"<p>{DISCLAIMER}</p><p>Steuerpult</p>"], text_type=pb.TEXT_TYPE_HTML)
        page = served.stub.Translate(html).results[0]
        cut_sentences = sample_value(served.registry, "translation_sentences_cut_total", model="fake")
        parts = sample_value(served.registry, "translation_sentence_parts_total", model="fake")
    assert text.sentences > 10 and page.sentences == text.sentences + 1
    assert (cut_sentences, parts) == (2, 2 * text.sentences)
