"""Stored glossaries on disk and the rules of every glossary: the store's layout, its sharing between processes,
each limit refused naming it, and the one glossary a call gets."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import pytest

from server.edge.errors import ServiceError, status_for
from server.edge.glossaries import (
    LOCK_FILE,
    DamagedGlossary,
    GlossaryStore,
    NewGlossary,
    glossary_key,
)
from server.edge.glossary_terms import (
    MAX_GLOSSARY_ENTRIES,
    MAX_INLINE_ENTRIES,
    MAX_NAME_CHARS,
    MAX_TERM_CHARS,
    inline_terms,
    new_glossary,
    same_language,
    with_glossary,
)
from server.edge.request import CallOptions, TranslateCall
from server.text.terms import Term

HAUS = NewGlossary("products", "de", "en", (Term("Haus", "home"), Term("Bahnhof", "station")))


def refusal(error: pytest.ExceptionInfo[ServiceError]) -> tuple[str, str]:
    code, message = status_for(error.value)
    return code.name, message


def make(
    listed: list[tuple[str, str]] | None = None,
    text: str = "",
    text_format: str = "TSV",
    name: str = "n",
    languages: tuple[str, str] = ("de", "en"),
) -> NewGlossary:
    return new_glossary(name, languages, listed or [], text, text_format)


# The store


def test_a_glossary_is_one_json_file_named_by_its_uuid_written_whole(tmp_path: Path) -> None:
    store = GlossaryStore(tmp_path / "glossaries")
    created = store.create(HAUS)
    key = created.info.glossary_id
    assert glossary_key(key, "id") == key and len(key) == 36
    assert sorted(p.name for p in (tmp_path / "glossaries").iterdir()) == sorted([f"{key}.json", LOCK_FILE])
    document = json.loads((tmp_path / "glossaries" / f"{key}.json").read_text())
    assert document == {
        "format": 1,
        "glossary_id": key,
        "name": "products",
        "source_language": "de",
        "target_language": "en",
        "creation_time": created.info.created.isoformat(),
        "entries": [["Haus", "home"], ["Bahnhof", "station"]],
    }
    assert created.info.entry_count == 2 and created.info.created.tzinfo is not None


def test_create_get_list_delete(tmp_path: Path) -> None:
    store = GlossaryStore(tmp_path)
    assert store.list_glossaries() == []  # no directory yet: nothing stored
    first, second = store.create(HAUS), store.create(HAUS)
    assert first.info.glossary_id != second.info.glossary_id
    assert store.get(first.info.glossary_id) == first
    assert store.get(first.info.glossary_id.upper()) == first  # a UUID in any case is the same id
    assert store.list_glossaries() == [first.info, second.info]  # oldest first
    store.delete(first.info.glossary_id)
    assert store.list_glossaries() == [second.info]
    for call in (store.get, store.delete):
        with pytest.raises(ServiceError) as missing:
            call(first.info.glossary_id)
        assert refusal(missing) == ("NOT_FOUND", f"no glossary {first.info.glossary_id} is stored (never created, "
                                    "or deleted); ListGlossaries lists them")  # fmt: skip


def test_two_stores_on_one_directory_share_it_and_a_delete_by_one_is_seen_by_the_other_at_once(
    tmp_path: Path,
) -> None:
    """Two server processes, or two servers on one volume: each reads what is on disk now."""
    a, b = GlossaryStore(tmp_path), GlossaryStore(tmp_path)
    created = a.create(HAUS)
    key = created.info.glossary_id
    assert b.get(key) == created  # b has it parsed and cached now
    assert b.list_glossaries() == [created.info]
    a.delete(key)
    with pytest.raises(ServiceError) as missing:
        b.get(key)
    assert refusal(missing)[0] == "NOT_FOUND"
    assert b.list_glossaries() == []


def test_a_restarted_server_reads_the_glossaries_of_the_one_before(tmp_path: Path) -> None:
    created = GlossaryStore(tmp_path).create(HAUS)
    assert GlossaryStore(tmp_path).get(created.info.glossary_id) == created


def test_what_is_no_id_is_refused_before_any_path_is_made_of_it(tmp_path: Path) -> None:
    store = GlossaryStore(tmp_path / "glossaries")
    (tmp_path / "secret.json").write_text("{}")
    for value in ("../secret", "", "x" * 1000, "12345678-1234-1234-1234-12345678901"):
        with pytest.raises(ServiceError) as refused:
            store.get(value, "options.glossary_id")
        code, message = refusal(refused)
        assert code == "INVALID_ARGUMENT"
        assert message == (
            f"options.glossary_id {value[:40]!r} is no glossary id: an id is the 36-character UUID that CreateGlossary"
            " returns"
        )


def test_the_store_holds_at_most_its_limit_even_when_processes_create_at_once(tmp_path: Path) -> None:
    """Each creation counts under the directory's lock: stores in several threads (each its own lock handle, as
    processes have) never pass the limit together."""
    stores = [GlossaryStore(tmp_path, max_glossaries=5) for _ in range(4)]
    outcomes: list[str] = []

    def create(store: GlossaryStore) -> None:
        for _ in range(4):
            try:
                store.create(HAUS)
                outcomes.append("OK")
            except ServiceError as error:
                outcomes.append(status_for(error)[0].name)

    threads = [threading.Thread(target=create, args=(store,)) for store in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["FAILED_PRECONDITION"] * 11 + ["OK"] * 5
    assert len(stores[0].list_glossaries()) == 5
    with pytest.raises(ServiceError) as full:
        stores[0].create(HAUS)
    assert refusal(full) == (
        "FAILED_PRECONDITION",
        "5 glossaries are stored, the limit; delete one (DeleteGlossary) before creating another",
    )


def test_a_damaged_file_is_a_fault_named_in_the_log_and_left_out_of_the_list(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = GlossaryStore(tmp_path)
    kept, damaged = store.create(HAUS), store.create(HAUS)
    path = tmp_path / f"{damaged.info.glossary_id}.json"
    path.write_text('{"format": 2}')
    with pytest.raises(DamagedGlossary, match="is of format 2; this server reads format 1"):
        store.get(damaged.info.glossary_id)
    assert status_for(DamagedGlossary("x"))[0] == grpc.StatusCode.INTERNAL  # the client is not told why
    assert store.list_glossaries() == [kept.info]
    assert "is left out of the list" in caplog.text
    path.write_text("not json")
    with pytest.raises(DamagedGlossary, match="is no glossary file"):
        store.get(damaged.info.glossary_id)


def test_a_file_replaced_on_disk_is_read_again_not_served_from_the_cache(tmp_path: Path) -> None:
    store = GlossaryStore(tmp_path)
    created = store.create(HAUS)
    store.get(created.info.glossary_id)
    path = tmp_path / f"{created.info.glossary_id}.json"
    document = json.loads(path.read_text())
    document["entries"] = [["Haus", "house"]]
    path.write_text(json.dumps(document))
    assert store.get(created.info.glossary_id).terms == (Term("Haus", "house"),)


# The rules of entries, names and languages


def test_entries_are_trimmed_and_kept_in_order_from_a_list_tsv_or_csv() -> None:
    listed = make([(" Haus ", "home\u00a0"), ("Bahnhof", "station")])
    tsv = make(text="Haus\thome\nBahnhof\tstation\n")
    csv = make(text='Haus,home\n"Bahnhof",station,de-DE,EN\n', text_format="CSV")
    assert listed.terms == tsv.terms == csv.terms == (Term("Haus", "home"), Term("Bahnhof", "station"))


@pytest.mark.parametrize(
    ("listed", "message"),
    [
        ([("Haus", "")], "entries[0] target is empty; a glossary term holds text"),
        ([("a", "b"), ("  ", "b")], "entries[1] source is empty"),
        ([("a" * (MAX_TERM_CHARS + 1), "b")], "entries[0] source is 257 characters long, over the limit of 256"),
        ([("Haus\tHof", "b")], "entries[0] source holds U+0009, a tab, line break or other control character"),
        ([("a", "b\nc")], "entries[0] target holds U+000A"),
        ([("a\x07", "b")], "entries[0] source holds U+0007"),
        ([("a\x85b", "b")], "entries[0] source holds U+0085"),  # C1 control: NEL
        ([("a\u2028b", "b")], "entries[0] source holds U+2028"),
        (
            [("Haus", "home"), ("Hof", "yard"), ("Haus", "house")],
            "entries[2] source 'Haus' is the source of entries[0] too; a glossary holds each source term once",
        ),
    ],
)
def test_each_term_rule_refuses_naming_the_entry(listed: list[tuple[str, str]], message: str) -> None:
    with pytest.raises(ServiceError) as refused:
        make(listed)
    code, said = refusal(refused)
    assert code == "INVALID_ARGUMENT" and said.startswith(message)


def test_a_term_at_its_limit_passes_and_sources_differing_in_case_are_two_terms() -> None:
    terms = make([("a" * MAX_TERM_CHARS, "b" * MAX_TERM_CHARS), ("haus", "house"), ("Haus", "House")]).terms
    assert len(terms) == 3


def test_the_entry_limits_per_glossary_and_per_request() -> None:
    assert len(make([(f"w{i}", "t") for i in range(MAX_GLOSSARY_ENTRIES)]).terms) == MAX_GLOSSARY_ENTRIES
    with pytest.raises(ServiceError) as refused:
        make([(f"w{i}", "t") for i in range(MAX_GLOSSARY_ENTRIES + 1)])
    assert refusal(refused) == (
        "INVALID_ARGUMENT",
        "the glossary holds more than 10,000 entries, the limit per glossary",
    )
    with pytest.raises(ServiceError) as refused:
        make(text="".join(f"w{i}\tt\n" for i in range(MAX_GLOSSARY_ENTRIES + 1)))
    assert refusal(refused)[1] == "the glossary holds more than 10,000 entries, the limit per glossary"
    assert len(inline_terms([(f"w{i}", "t") for i in range(MAX_INLINE_ENTRIES)])) == MAX_INLINE_ENTRIES
    with pytest.raises(ServiceError) as refused:
        inline_terms([(f"w{i}", "t") for i in range(MAX_INLINE_ENTRIES + 1)])
    assert refusal(refused) == (
        "INVALID_ARGUMENT",
        "options.glossary holds more than 1,000 entries, the limit per request",
    )
    with pytest.raises(ServiceError, match=r"^options.glossary\[1\] source 'a' is the source of options.glossary\[0\]"):
        inline_terms([("a", "b"), ("a", "c")])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "the glossary has no entries; give 1 to 10,000 in `entries` or `entries_text`"),
        ({"text": "\n\n"}, "the glossary has no entries"),
        ({"listed": [("a", "b")], "text": "a\tb"}, "give the entries once, in `entries` or in `entries_text`"),
        ({"text": "Haus\thome\nHof yard\n"}, "entries_text (TSV) line 2 has no tab; an entry is source<TAB>target"),
        ({"text": "Haus\thome\n\nHof\ta\x07\n"}, "entries_text line 3 target holds U+0007"),
        ({"text": "a,b\nc,d,e\n", "text_format": "CSV"}, "entries_text (CSV) line 2 has 3 fields"),
        (
            {"text": "a,b\nc,d,fr,en\n", "text_format": "CSV"},
            "entries_text line 2 is a fr -> en entry, in a de -> en glossary; leave a line's languages out or give"
            " the glossary's",
        ),
        ({"listed": [("a", "b")], "name": " "}, "name is empty; a glossary is named in 1 to 256 characters"),
        (
            {"listed": [("a", "b")], "name": "n" * (MAX_NAME_CHARS + 1)},
            "name is 257 characters long, over the limit of 256",
        ),
        ({"listed": [("a", "b")], "name": "a\nb"}, "name holds U+000A"),
        (
            {"listed": [("a", "b")], "languages": ("auto", "en")},
            "source_language is required: the language of the glossary's source terms (not auto)",
        ),
        ({"listed": [("a", "b")], "languages": ("de", "")}, "target_language is required"),
        ({"listed": [("a", "b")], "languages": ("de", "klingon!")}, "target_language 'klingon!' is no language code"),
        ({"listed": [("a", "b")], "languages": ("de", "x" * 65)}, "target_language is 65 characters long"),
        (
            {"listed": [("a", "b")], "languages": ("en-US", "en-GB")},
            "source_language 'en-US' and target_language 'en-GB' are the same language",
        ),
    ],
)
def test_each_rule_of_a_glossary_to_store_refuses_naming_it(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ServiceError) as refused:
        make(**kwargs)  # type: ignore[arg-type]
    code, said = refusal(refused)
    assert code == "INVALID_ARGUMENT" and said.startswith(message), said


def test_a_glossary_to_store_keeps_its_name_and_codes_trimmed() -> None:
    new = make([("a", "b")], name="  Produkte 2024 ", languages=(" de-DE ", "EN"))
    assert (new.name, new.source_language, new.target_language) == ("Produkte 2024", "de-DE", "EN")


# Which requests a stored glossary serves, and the one glossary a call gets


@pytest.mark.parametrize(
    ("glossary", "request_code", "serves"),
    [
        ("de", "de", True),
        ("de", "de-DE", True),  # the region aside, as DeepL's EN glossary serves EN-US and EN-GB
        ("de-DE", "de-AT", True),
        ("en", "EN-us", True),
        ("de", "deu", True),
        ("DE", "de_DE", True),
        ("pt", "pt-BR", True),
        ("zh-Hans", "zh-Hant", False),  # another script is another written language
        ("zh", "zh-TW", False),
        ("sr", "sr-Latn", False),
        ("de", "nl", False),
        ("mul", "mul", True),
        ("mul", "de", False),
    ],
)
def test_a_glossary_serves_its_language_in_its_script_in_any_region_or_spelling(
    glossary: str, request_code: str, serves: bool
) -> None:
    assert same_language(glossary, request_code) is serves


def call_of(source: str = "de", target: str = "en", glossary: tuple[Term, ...] = ()) -> TranslateCall:
    return TranslateCall(("Das Haus",), CallOptions(source_language=source, target_language=target, glossary=glossary))


def test_inline_terms_come_first_and_win_over_the_stored_ones_with_their_source(tmp_path: Path) -> None:
    stored = GlossaryStore(tmp_path).create(HAUS)
    call = with_glossary(call_of(glossary=(Term("Haus", "house"), Term("Hof", "yard"))), stored)
    assert call.options.glossary == (Term("Haus", "house"), Term("Hof", "yard"), Term("Bahnhof", "station"))
    assert with_glossary(call_of(), stored).options.glossary == HAUS.terms


def test_a_stored_glossary_needs_the_request_to_name_its_source_and_have_its_languages(tmp_path: Path) -> None:
    stored = GlossaryStore(tmp_path).create(HAUS)
    key = stored.info.glossary_id
    with pytest.raises(ServiceError) as refused:
        with_glossary(call_of(source=""), stored)
    assert refusal(refused) == (
        "INVALID_ARGUMENT",
        f"options.glossary_id needs options.source_language: glossary {key} holds 'de' terms, and detection cannot"
        " choose a glossary",
    )
    for source, target in (("en", "de"), ("de", "fr"), ("nl", "en")):
        with pytest.raises(ServiceError) as refused:
            with_glossary(call_of(source, target), stored)
        assert refusal(refused) == (
            "INVALID_ARGUMENT",
            f"glossary {key} is 'de' -> 'en'; the request asks for {source!r} -> {target!r}: give a glossary of the"
            " request's languages",
        )
    assert with_glossary(call_of("de-CH", "en-GB"), stored).options.glossary == HAUS.terms
    assert with_glossary(call_of("de", ""), stored).options.target_language == ""  # routing refuses a missing target
