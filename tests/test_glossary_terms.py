"""Glossary terms enforced in decoding: each term found in a source is in its translation exactly as often, in
greedy and beam search, unary and streaming, plain text and HTML, on the shipped model and on tiny random OPUS-MT
and NLLB/M2M100 checkpoints; a glossary whose terms are absent changes nothing."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from model.files import TOKENIZER_FILE
from model.tokenizer import Tokenizer
from server.core.offline import translate_ids
from server.proto.translation.v1 import translation_pb2 as pb
from server.text.terms import target_ids
from tests.serving import onnx_model, request, runner_of, running_server, sample_value

SENTENCES = [
    "Das Haus ist sehr groß.",
    "Wo ist der nächste Bahnhof?",
    "Ich habe heute keine Zeit, aber morgen gehe ich zum Bahnhof.",
]
GLOSSARY = [("Haus", "building"), ("Bahnhof", "railway terminal"), ("Zeit", "leisure")]


def entries(pairs: list[tuple[str, str]]) -> list[pb.GlossaryEntry]:
    return [pb.GlossaryEntry(source=source, target=target) for source, target in pairs]


def expected_counts(text: str, pairs: list[tuple[str, str]]) -> dict[str, int]:
    """How often each target must appear: once per whole-word mention of its source."""
    return {target: len(re.findall(rf"(?<!\w){re.escape(source)}(?!\w)", text)) for source, target in pairs}


@pytest.mark.shipped
@pytest.mark.parametrize("beam_size", [1, 4])
def test_terms_appear_exactly_once_per_mention_on_the_shipped_model(exported_shipped: Path, beam_size: int) -> None:
    model = onnx_model(exported_shipped, max_slots=16)
    with running_server(model) as served:
        plain = served.stub.Translate(request(SENTENCES, beam_size=beam_size)).results
        forced = served.stub.Translate(request(SENTENCES, beam_size=beam_size, glossary=entries(GLOSSARY))).results
        requested = sample_value(served.registry, "translation_glossary_terms_total", outcome="requested")
        applied = sample_value(served.registry, "translation_glossary_terms_total", outcome="applied")
    for text, before, result in zip(SENTENCES, plain, forced, strict=True):
        for target, count in expected_counts(text, GLOSSARY).items():
            assert result.translation.count(target) == count, (text, before.translation, result.translation)
    assert requested == applied == 4


@pytest.mark.shipped
def test_absent_terms_change_nothing_and_a_hundred_terms_are_served(exported_shipped: Path) -> None:
    words = random.Random(7).sample(range(10_000, 99_999), 97)
    hundred = [(f"Wort{n}", f"word{n}") for n in words] + GLOSSARY
    absent = [("Katze", "feline"), ("Hund", "canine")]
    model = onnx_model(exported_shipped, max_slots=16)
    with running_server(model) as served:
        plain = served.stub.Translate(request(SENTENCES, beam_size=4)).results
        unmatched = served.stub.Translate(request(SENTENCES, beam_size=4, glossary=entries(absent))).results
        many = served.stub.Translate(request(SENTENCES, beam_size=4, glossary=entries(hundred))).results
    assert [r.translation for r in unmatched] == [r.translation for r in plain]
    for text, result in zip(SENTENCES, many, strict=True):
        for target, count in expected_counts(text, GLOSSARY).items():
            assert result.translation.count(target) == count, (text, result.translation)


@pytest.mark.shipped
def test_overlapping_terms_the_longer_wins_and_markup_and_streaming_hold_terms(exported_shipped: Path) -> None:
    overlapping = [("Haus", "building"), ("großes Haus", "mansion")]
    model = onnx_model(exported_shipped, max_slots=16)
    with running_server(model) as served:
        [longer] = served.stub.Translate(
            request(["Das ist ein großes Haus."], beam_size=4, glossary=entries(overlapping))
        ).results
        [html] = served.stub.Translate(
            request(
                ["<p>Das <b>Haus</b> ist sehr groß.</p>"],
                beam_size=4,
                text_type=pb.TEXT_TYPE_HTML,
                glossary=entries(GLOSSARY),
            )
        ).results
        streamed = list(served.stub.TranslateStream(request(SENTENCES[:1], beam_size=1, glossary=entries(GLOSSARY))))
    assert longer.translation.count("mansion") == 1 and "building" not in longer.translation, longer.translation
    assert html.translation.count("building") == 1 and html.translation.startswith("<p>"), html.translation
    final = [m.result.translation for m in streamed if m.HasField("result")]
    assert len(final) == 1 and final[0].count("building") == 1, streamed


@pytest.mark.shipped
def test_offline_decoding_forces_the_target_ids(exported_shipped: Path) -> None:
    """The constrained search over the served CPU runner, without the edge: the ids of each term once."""
    tokenizer = Tokenizer(exported_shipped / TOKENIZER_FILE)
    runner = runner_of(onnx_model(exported_shipped, max_slots=8))
    term = target_ids(tokenizer, "railway terminal")
    assert term
    sources = [tokenizer.encode_source(SENTENCES[1], "en")]
    for beam in (1, 4):
        [[best]] = translate_ids(runner, sources, beam, 1.0, None, terms=((term,),))
        tokens = best.tokens
        assert sum(tokens[i : i + len(term)] == term for i in range(len(tokens))) == 1
        assert tokenizer.decode(list(tokens)).count("railway terminal") == 1


def test_a_term_the_vocabulary_cannot_spell_is_not_forced(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer(tiny_model_dir / TOKENIZER_FILE)
    assert target_ids(tokenizer, "\u2603\u2604") == ()
    assert target_ids(tokenizer, "house") != ()
