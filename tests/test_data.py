"""Dictionary parsing on real Ding lines, including malformed ones."""

from __future__ import annotations

from model.data import Pair, ParseStats, clean, is_sentence, parse_line, parse_lines, resolve_slashes, split_pairs

REAL_LINES = [
    "# Version :: devel 2023-01-30",
    "Aalsuppe {f} [cook.] | Aalsuppen {pl} :: eel soup | eel soups",
    "Lüftungsgerät {n} | Lüftungsgeräte {pl} | Kompaktlüftungsgerät {n} :: air handling unit /AHU/; air handler"
    " | air handling units; air handlers | compact air-handling unit",
    "Aalräucherei {f} | Aalräuchereien {pl} :: eel smokery; eel-smoking business <eelsmoking business>"
    " | eel smokeries; eel-smoking businesses",
    "Das ist die Höhe!; Das schießt den Vogel ab! [übtr.] :: That takes the cake! [fig.]",
    "blanker Hohn | Es war purer Zufall. :: sheer/pure mockery | It was sheer/pure coincidence.",
]
MALFORMED_LINES = [
    "Aal {m} | Aale {pl} :: eel",  # sub-entries do not align
    "no separator at all",
    "a :: b :: c",  # two separators
    "{f} [techn.] :: <x>",  # nothing left after cleaning
    "",
]


def test_annotations_are_stripped() -> None:
    assert clean("Aalsuppe {f} [cook.]") == "Aalsuppe"
    assert clean("air handling unit /AHU/") == "air handling unit"
    assert clean("eel-smoking business <eelsmoking business>") == "eel-smoking business"


def test_parenthesised_glosses_are_kept() -> None:
    assert clean("Aal {m} (auf der Speisekarte) [cook.]") == "Aal (auf der Speisekarte)"


def test_slash_alternatives_keep_the_first() -> None:
    assert resolve_slashes("ganz/völlig") == "ganz"
    assert resolve_slashes("It was sheer/pure coincidence.") == "It was sheer coincidence."
    assert resolve_slashes("pure / arrant rhetoric") == "pure rhetoric"
    assert resolve_slashes("1/2 cup") == "1/2 cup"
    assert resolve_slashes("open 24/7.") == "open 24/7."


def test_slash_chains_resolve_whole_and_keep_closing_punctuation() -> None:
    # The defects of the first word rule, each from a real Ding entry.
    assert resolve_slashes("A / B / C") == "A"  # was "A / C"
    assert resolve_slashes("Wir haben es gut / schlecht.") == "Wir haben es gut."  # the full stop was lost
    assert clean("Abfluss {m} (von / nach) [econ.]") == "Abfluss (von)"
    assert clean("signalled [Br.] / motioned") == "signalled"  # the annotation left two spaces: slash kept
    assert clean("Äpfel/Birnen/Kirschen") == "Äpfel"  # "/Birnen/" was taken for an abbreviation
    assert clean("Abfahrt {f} /Abf./") == "Abfahrt"  # a real abbreviation is still stripped


def test_sentences_touched_by_the_slash_rule_are_training_only() -> None:
    sentences = [Pair(f"Das ist Satz Nummer {i}.", f"This is sentence number {i}.") for i in range(2000)]
    line = "Wir haben es gut / schlecht getroffen.; Wir hatten Glück. :: We were lucky."
    touched = parse_line(line, ParseStats())
    assert [p.resolved for p in touched] == [True, False]
    # The German of an untouched pair is training-only too once any pair with it was touched.
    again = [Pair(f"Das ist Satz Nummer {i}.", "Another reference.", resolved=True) for i in range(2000)]
    splits = split_pairs(sentences + touched + again)
    assert not splits["test"] and not splits["valid"]
    assert Pair("Wir haben es gut getroffen.", "We were lucky.") in splits["train"]
    assert Pair("Das ist Satz Nummer 7.", "This is sentence number 7.") in splits["train"]
    assert split_pairs(sentences)["test"], "without the touched pairs the same sentences are held out"


def test_aligned_subentries_and_alternatives() -> None:
    stats = ParseStats()
    pairs = parse_line(REAL_LINES[2], stats)
    assert Pair("Lüftungsgerät", "air handling unit") in pairs
    assert Pair("Lüftungsgerät", "air handler") in pairs
    assert Pair("Lüftungsgeräte", "air handling units") in pairs
    assert Pair("Kompaktlüftungsgerät", "compact air-handling unit") in pairs
    assert not stats.malformed


def test_sentence_alternatives_pair_with_first() -> None:
    pairs = parse_line(REAL_LINES[4], ParseStats())
    assert pairs == [
        Pair("Das ist die Höhe!", "That takes the cake!"),
        Pair("Das schießt den Vogel ab!", "That takes the cake!"),
    ]


def test_malformed_lines_are_counted_not_fatal() -> None:
    stats = ParseStats()
    pairs = list(parse_lines(REAL_LINES + MALFORMED_LINES, stats))
    assert pairs, "the good lines still parse"
    assert sum(stats.malformed.values()) == 4
    assert stats.malformed["unaligned sub-entries"] == 1
    assert stats.malformed["separator"] == 2
    assert stats.comments == 2  # the header comment and the empty line


def test_sentence_detection() -> None:
    assert is_sentence(Pair("Es war purer Zufall.", "It was sheer coincidence."))
    assert not is_sentence(Pair("blanker Hohn", "sheer mockery"))


def test_split_is_deterministic_and_leak_free() -> None:
    sentences = [Pair(f"Das ist Satz Nummer {i}.", f"This is sentence number {i}.") for i in range(2000)]
    words = [Pair(f"Wort{i}", f"word{i}") for i in range(200)]
    leak = [Pair(p.de, "another translation") for p in sentences]  # same German, other English
    # Other German, same English: hashed on the German, these land in training, so only the English
    # filter keeps a held-out English reference (a source in the en->de direction) out of training.
    leak_en = [Pair(f"Ein ganz anderer Satz {i}.", p.en) for i, p in enumerate(sentences)]
    first = split_pairs(sentences + words + leak + leak_en)
    second = split_pairs(sentences + words + leak + leak_en)
    assert first == second
    assert first["test"] and first["valid"]
    held = first["test"] + first["valid"]
    assert not {p.de for p in held} & {p.de for p in first["train"]}
    assert not {p.en for p in held} & {p.en for p in first["train"]}
    assert any(p.de.startswith("Ein ganz anderer") for p in first["train"]), "the English filter drops only leaks"
    assert all(is_sentence(p) for p in held)
