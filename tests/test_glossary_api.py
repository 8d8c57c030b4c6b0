"""Glossaries through a real server: the stored-glossary lifecycle, its sharing between servers on one directory and
across a restart, the statuses of each refusal, and the terms a call carries where the servicer hands it on."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from server.edge.config import ModelsConfig, ServerConfig
from server.edge.glossaries import GLOSSARY_DIR
from server.edge.loading import LoadedModel
from server.edge.request import TranslateCall
from server.proto.translation.v1 import translation_pb2 as pb
from server.text.terms import Term
from tests.serving import (
    RunningServer,
    fake_model,
    health_status,
    request,
    running_server,
    sample_value,
    server_config,
    status_of,
)

ENTRIES = [pb.GlossaryEntry(source="Haus", target="home"), pb.GlossaryEntry(source="Bahnhof", target="station")]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    from tests.tiny import build_tiny_tokenizer

    directory = tmp_path_factory.mktemp("glossary_tokenizer")
    build_tiny_tokenizer(directory)
    return fake_model(directory)


def config_on(cache: Path) -> ServerConfig:
    return server_config(models=ModelsConfig(cache_dir=cache))


@pytest.fixture
def served(model: LoadedModel, tmp_path: Path) -> Iterator[RunningServer]:
    with running_server(model, config_on(tmp_path)) as running:
        yield running


class HandedOn:
    """The typed calls the servicer hands on to routing (its `_parts`), in order."""

    def __init__(self, served: RunningServer) -> None:
        self.calls: list[TranslateCall] = []
        servicer = served.server.servicer
        parts = servicer._parts

        async def recording(call: TranslateCall, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(call)
            return await parts(call, *args, **kwargs)

        servicer._parts = recording  # type: ignore[method-assign,assignment]


def create(served: RunningServer, **fields: Any) -> pb.Glossary:
    fields = {"name": "products", "source_language": "de", "target_language": "en", **fields}
    if "entries_text" not in fields:
        fields.setdefault("entries", ENTRIES)
    return served.stub.CreateGlossary(pb.CreateGlossaryRequest(**fields), timeout=30)


def get(served: RunningServer, glossary_id: str) -> pb.Glossary:
    return served.stub.GetGlossary(pb.GetGlossaryRequest(glossary_id=glossary_id), timeout=30)


def listed(served: RunningServer) -> list[pb.Glossary]:
    return list(served.stub.ListGlossaries(pb.ListGlossariesRequest(), timeout=30).glossaries)


def delete(served: RunningServer, glossary_id: str) -> None:
    served.stub.DeleteGlossary(pb.DeleteGlossaryRequest(glossary_id=glossary_id), timeout=30)


def translate(served: RunningServer, **options: Any) -> pb.TranslateResponse:
    return served.stub.Translate(request(["Das Haus ist groß."], **options), timeout=30)


def test_create_get_list_delete(served: RunningServer, tmp_path: Path) -> None:
    created = create(served)
    assert (created.name, created.source_language, created.target_language) == ("products", "de", "en")
    assert created.entry_count == 2 and not created.entries  # its entries only in GetGlossary's answer
    assert created.creation_time.seconds > 0
    assert (tmp_path / GLOSSARY_DIR / f"{created.glossary_id}.json").is_file()  # under --cache-dir
    got = get(served, created.glossary_id)
    assert [(e.source, e.target) for e in got.entries] == [("Haus", "home"), ("Bahnhof", "station")]
    got.ClearField("entries")
    assert got == created
    second = create(served, name="second", entries_text="Hof\tyard\n")
    assert [g.glossary_id for g in listed(served)] == [created.glossary_id, second.glossary_id]  # oldest first
    assert all(not g.entries and g.entry_count for g in listed(served))
    delete(served, created.glossary_id)
    assert [g.glossary_id for g in listed(served)] == [second.glossary_id]
    for call in (lambda: get(served, created.glossary_id), lambda: delete(served, created.glossary_id)):
        status = status_of(call)
        assert status.code == grpc.StatusCode.NOT_FOUND
        assert status.details.startswith(f"no glossary {created.glossary_id} is stored")
    assert sample_value(served.registry, "translation_requests_total", method="CreateGlossary", code="OK") == 2
    assert sample_value(served.registry, "translation_requests_total", method="GetGlossary", code="NOT_FOUND") == 1


def test_entries_in_deepl_tsv_and_csv(served: RunningServer) -> None:
    tsv = create(served, entries_text="Haus\thome\r\n\nBahnhof\tstation")
    csv = create(served, entries_text='Haus,home\n"Bahnhof",station,de,en\n', entries_format=pb.ENTRIES_FORMAT_CSV)
    for glossary in (tsv, csv):
        assert [(e.source, e.target) for e in get(served, glossary.glossary_id).entries] == [
            ("Haus", "home"),
            ("Bahnhof", "station"),
        ]
    status = status_of(lambda: create(served, entries_text="a,b\nc\n", entries_format=pb.ENTRIES_FORMAT_CSV))
    assert (status.code, status.details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "entries_text (CSV) line 2 has 1 fields; a CSV entry has 2 (source,target) or 4 (source,target,"
        "source_language,target_language)",
    )


@pytest.mark.parametrize(
    ("fields", "code", "message"),
    [
        (
            {"entries": [pb.GlossaryEntry(source="a\tb", target="c")]},
            "INVALID_ARGUMENT",
            "entries[0] source holds U+0009",
        ),
        ({"entries": []}, "INVALID_ARGUMENT", "the glossary has no entries"),
        ({"name": ""}, "INVALID_ARGUMENT", "name is empty"),
        ({"source_language": "auto"}, "INVALID_ARGUMENT", "source_language is required"),
        ({"entries_format": 7, "entries_text": "a\tb"}, "INVALID_ARGUMENT", "entries_format must be TSV or CSV, got 7"),
    ],
)
def test_a_glossary_against_a_rule_is_invalid_argument_naming_it(
    served: RunningServer, fields: dict[str, Any], code: str, message: str
) -> None:
    status = status_of(lambda: create(served, **fields))
    assert status.code.name == code and status.details.startswith(message), status


def test_the_typed_call_carries_the_inline_terms_and_no_protobuf(served: RunningServer) -> None:
    handed = HandedOn(served)
    entries = [pb.GlossaryEntry(source=" Haus ", target="home"), pb.GlossaryEntry(source="Hof", target="yard")]
    assert translate(served, glossary=entries).results[0].sentences == 1
    (call,) = handed.calls
    assert call.options.glossary == (Term("Haus", "home"), Term("Hof", "yard"))
    assert all(type(term) is Term for term in call.options.glossary)
    values = [getattr(call, f.name) for f in dataclasses.fields(call)]
    values += [getattr(call.options, f.name) for f in dataclasses.fields(call.options)]
    assert not any(isinstance(value, Message) for value in values)
    assert not any("glossary_id" in f.name for f in dataclasses.fields(call.options))  # ids stop at the servicer


def test_stored_terms_reach_the_call_after_the_inline_ones_which_win(served: RunningServer) -> None:
    handed = HandedOn(served)
    stored = create(served)
    inline = [pb.GlossaryEntry(source="Haus", target="house"), pb.GlossaryEntry(source="Hof", target="yard")]
    translate(served, glossary=inline, glossary_id=stored.glossary_id)
    translate(served, source="de-DE", target="EN-us", glossary_id=stored.glossary_id)  # the region aside
    with_inline, stored_only = handed.calls
    assert with_inline.options.glossary == (Term("Haus", "house"), Term("Hof", "yard"), Term("Bahnhof", "station"))
    assert stored_only.options.glossary == (Term("Haus", "home"), Term("Bahnhof", "station"))
    streamed = served.stub.TranslateStream(request(["Das Haus"], glossary_id=stored.glossary_id), timeout=30)
    assert [m.result.index for m in streamed if m.HasField("result")] == [0]
    assert handed.calls[-1].options.glossary == stored_only.options.glossary


def test_refusals_of_a_translate_call_with_a_glossary(served: RunningServer) -> None:
    stored = create(served)
    key = stored.glossary_id
    unknown = "0" * 8 + "-0000-4000-8000-" + "0" * 12
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"glossary_id": unknown}, "NOT_FOUND", f"no glossary {unknown} is stored"),
        ({"glossary_id": "products"}, "INVALID_ARGUMENT", "options.glossary_id 'products' is no glossary id"),
        ({"glossary_id": key, "source": ""}, "INVALID_ARGUMENT", "options.glossary_id needs options.source_language"),
        (
            {"glossary_id": key, "source": "en", "target": "de"},
            "INVALID_ARGUMENT",
            f"glossary {key} is 'de' -> 'en'; the request asks for 'en' -> 'de'",
        ),
        (
            {"glossary": [pb.GlossaryEntry(source="Haus", target="")]},
            "INVALID_ARGUMENT",
            "options.glossary[0] target is empty",
        ),
        (
            {"glossary": [pb.GlossaryEntry(source=f"w{i}", target="t") for i in range(1001)]},
            "INVALID_ARGUMENT",
            "options.glossary holds more than 1,000 entries, the limit per request",
        ),
    ]
    for options, code, message in cases:
        status = status_of(partial(translate, served, **options))
        assert status.code.name == code and status.details.startswith(message), (options, status)
    partial_request = pb.TranslateRequest(
        texts=["Haus"],
        options=pb.TranslationOptions(source_language="de", target_language="en", glossary_id=unknown),
        allow_partial=True,
    )
    status = status_of(lambda: served.stub.Translate(partial_request, timeout=30))
    assert status.code == grpc.StatusCode.NOT_FOUND  # the whole call's option: allow_partial does not split it


def test_glossaries_outlive_a_restart_on_the_same_cache_dir(model: LoadedModel, tmp_path: Path) -> None:
    with running_server(model, config_on(tmp_path)) as first:
        created = create(first)
    with running_server(model, config_on(tmp_path)) as second:
        assert [g.glossary_id for g in listed(second)] == [created.glossary_id]
        assert get(second, created.glossary_id).entry_count == 2
        assert translate(second, glossary_id=created.glossary_id).results[0].sentences == 1


def test_two_servers_on_one_directory_see_each_others_glossaries_and_deletions_at_once(
    model: LoadedModel, tmp_path: Path
) -> None:
    with running_server(model, config_on(tmp_path)) as a, running_server(model, config_on(tmp_path)) as b:
        handed = HandedOn(b)
        created = create(a)
        key = created.glossary_id
        assert [(e.source, e.target) for e in get(b, key).entries] == [("Haus", "home"), ("Bahnhof", "station")]
        translate(b, glossary_id=key)
        assert handed.calls[-1].options.glossary == (Term("Haus", "home"), Term("Bahnhof", "station"))
        delete(a, key)
        assert status_of(lambda: get(b, key)).code == grpc.StatusCode.NOT_FOUND
        assert status_of(lambda: translate(b, glossary_id=key)).code == grpc.StatusCode.NOT_FOUND
        assert listed(b) == []


def test_fuzzed_glossary_requests_each_get_a_status_and_the_server_stays_up(served: RunningServer) -> None:
    rng = random.Random(11)
    valid = pb.CreateGlossaryRequest(name="n", source_language="de", target_language="en", entries=ENTRIES)
    methods = ["CreateGlossary", "GetGlossary", "ListGlossaries", "DeleteGlossary"]
    codes: set[grpc.StatusCode] = set()
    for n in range(120):
        payload = bytearray(valid.SerializeToString())
        for _ in range(rng.randint(1, 4)):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        call = served.channel.unary_unary(
            f"/translation.v1.Translator/{methods[n % len(methods)]}",
            request_serializer=None,
            response_deserializer=None,
        )
        try:
            call(bytes(payload), timeout=10)
            codes.add(grpc.StatusCode.OK)
        except grpc.RpcError as error:
            codes.add(error.code())  # type: ignore[attr-defined]
    assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}, codes
    assert health_status(served.channel) == "SERVING"
