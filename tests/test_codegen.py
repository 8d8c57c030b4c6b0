"""The committed generated code is exactly what `python -m server.edge.codegen` makes from the proto."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from server.edge.codegen import PACKAGE, REPO_ROOT, generate


def test_committed_generated_code_matches_the_codegen_command(tmp_path: Path) -> None:
    fresh = {p.relative_to(tmp_path / PACKAGE): p.read_bytes() for p in generate(tmp_path)}
    committed_root = REPO_ROOT / PACKAGE
    committed = {
        p.relative_to(committed_root): p.read_bytes()
        for p in committed_root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert sorted(committed) == sorted(fresh), "run `python -m server.edge.codegen` and commit server/proto/"
    stale = [str(path) for path in fresh if committed[path] != fresh[path]]
    assert not stale, f"generated files differ from the proto: {stale}; run `python -m server.edge.codegen`"


def test_generated_package_imports_with_typed_stubs() -> None:
    from server.proto.translation.v1 import translation_pb2, translation_pb2_grpc

    assert translation_pb2.DESCRIPTOR.package == "translation.v1"
    assert {m.name for m in translation_pb2.DESCRIPTOR.services_by_name["Translator"].methods} == {
        "Translate",
        "TranslateStream",
        "ListModels",
        "CreateGlossary",
        "GetGlossary",
        "ListGlossaries",
        "DeleteGlossary",
    }
    assert hasattr(translation_pb2_grpc, "TranslatorStub")
    assert (REPO_ROOT / PACKAGE / "translation/v1/translation_pb2.pyi").is_file()
    assert (REPO_ROOT / PACKAGE / "translation/v1/translation_pb2_grpc.pyi").is_file()


def _floor(requirements: list[str], name: str) -> tuple[int, ...]:
    spec = next(r for r in requirements if re.split(r"[<>=!~ ]", r, maxsplit=1)[0] == name)
    match = re.search(r">=([\d.]+)", spec)
    assert match, f"{spec} needs a >= floor"
    return tuple(int(part) for part in match.group(1).split("."))


def test_dependency_floors_satisfy_what_the_generated_code_checks_at_import() -> None:
    """An install that keeps an older grpcio or protobuf would succeed and then fail to import the server."""
    generated = REPO_ROOT / PACKAGE / "translation/v1"
    grpc_needed = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (generated / "translation_pb2_grpc.py").read_text())
    protobuf_needed = re.search(r"Protobuf Python Version: ([\d.]+)", (generated / "translation_pb2.py").read_text())
    assert grpc_needed and protobuf_needed
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    serving = project["dependencies"]
    grpc_floor = tuple(int(p) for p in grpc_needed.group(1).split("."))
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert _floor(serving, name) >= grpc_floor, name
    assert _floor(serving, "protobuf") >= tuple(int(p) for p in protobuf_needed.group(1).split("."))


def _pin(requirements: list[str], name: str) -> str:
    spec = next(r for r in requirements if re.split(r"[<>=!~ ]", r, maxsplit=1)[0] == name)
    match = re.fullmatch(rf"{re.escape(name)}==([\w.]+)", spec)
    assert match, f"{spec}: the code generator must be pinned exactly, or the next patch release rewrites its output"
    return match.group(1)


def test_the_code_generator_is_pinned_to_the_release_the_committed_code_came_from() -> None:
    """A fresh install resolves the newest grpcio-tools, which stamps its own version into the generated code."""
    generated = (REPO_ROOT / PACKAGE / "translation/v1/translation_pb2_grpc.py").read_text()
    stamped = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", generated)
    assert stamped
    dev = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert _pin(dev, "grpcio-tools") == stamped.group(1)
    _pin(dev, "mypy-protobuf")  # writes the .pyi stubs the freshness test compares too
