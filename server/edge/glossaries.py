"""Stored glossaries: one JSON file per glossary in a directory that several server processes may share (the
`--processes` of one server, servers with one volume).

`<directory>/<id>.json`, the id a random UUID (uuid4): written whole under a temporary name beside it and renamed
into place (os.replace), so that a reader sees a glossary whole or not at all. A glossary never changes once written
and a deletion removes its file, so every process reads what is on disk now: an id deleted by one is NOT_FOUND for
all at once. A creation counts the glossaries under an exclusive lock (flock on `<directory>/.lock`), so that two
processes creating at once cannot pass the limit together. Parsed glossaries are cached by their file's inode, mtime
and size, which every read stats first.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from server.edge.errors import NotFound
from server.edge.refusals import Refusal
from server.text.terms import Term

logger = logging.getLogger(__name__)

FORMAT = 1  # the files' layout; a file of another is refused, naming it
MAX_STORED_GLOSSARIES = 1_000  # per directory: each is listed and counted by reading the directory
CACHED_TERMS = 200_000  # terms of the glossaries read last kept parsed, all of them together
GLOSSARY_DIR = "glossaries"  # the store's directory inside the server's cache directory (--cache-dir)
LOCK_FILE = ".lock"
_GLOSSARY_FILE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\.json")
Stamp = tuple[int, int, int]  # a file's inode, mtime (ns) and size: another file, or another version of it


@dataclass(frozen=True)
class NewGlossary:
    """A CreateGlossary request, typed and checked (`server.edge.messages`)."""

    name: str  # trimmed, one line
    source_language: str  # the client's codes, trimmed; a request's must be the same languages to use the glossary
    target_language: str
    terms: tuple[Term, ...]  # 1..MAX_GLOSSARY_ENTRIES, trimmed, each source once, in the order given


@dataclass(frozen=True)
class GlossaryInfo:
    """What ListGlossaries tells of a stored glossary."""

    glossary_id: str  # a UUID, canonical (lowercase, hyphenated): the file's name
    name: str
    source_language: str
    target_language: str
    entry_count: int
    created: datetime  # in UTC


@dataclass(frozen=True)
class Glossary:
    """A stored glossary with its terms."""

    info: GlossaryInfo
    terms: tuple[Term, ...]


class DamagedGlossary(RuntimeError):
    """A glossary file this server cannot read (damaged, or of another format): a fault, not the client's."""


class GlossaryStore:
    """The glossaries in one directory, created there on the first glossary stored; safe across threads and
    processes."""

    def __init__(self, directory: Path, max_glossaries: int = MAX_STORED_GLOSSARIES) -> None:
        self.directory = directory
        self.max_glossaries = max_glossaries
        self._lock = threading.Lock()  # the caches: the servicer runs each store call on a thread of its own
        self._parsed: OrderedDict[str, tuple[Stamp, Glossary]] = OrderedDict()  # least recently read first
        self._parsed_terms = 0
        self._infos: dict[str, tuple[Stamp, GlossaryInfo]] = {}  # every glossary listed, without its terms

    def create(self, new: NewGlossary) -> Glossary:
        """Store `new` under a new id; FailedPrecondition where the directory holds max_glossaries already."""
        info = GlossaryInfo(
            str(uuid.uuid4()), new.name, new.source_language, new.target_language, len(new.terms), datetime.now(UTC)
        )
        glossary = Glossary(info, new.terms)
        self.directory.mkdir(parents=True, exist_ok=True)
        with _locked(self.directory / LOCK_FILE):
            if (count := len(self._ids())) >= self.max_glossaries:
                raise Refusal.STORE_FULL.unmet(count=count)
            _write_whole(self._path(info.glossary_id), _to_json(glossary))
        return glossary

    def get(self, glossary_id: str, field: str = "glossary_id") -> Glossary:
        """The glossary stored under `glossary_id` now; InvalidRequest for what is no id (`field` holds it), NotFound
        for an id none is stored under."""
        key = glossary_key(glossary_id, field)
        path = self._path(key)
        stamp = _stamp(path, key)
        with self._lock:
            if (cached := self._parsed.get(key)) is not None and cached[0] == stamp:
                self._parsed.move_to_end(key)
                return cached[1]
        glossary = _read(path, key)
        self._keep(key, stamp, glossary)
        return glossary

    def list_glossaries(self) -> list[GlossaryInfo]:
        """Every glossary stored now, oldest first; a file that cannot be read is logged and left out."""
        infos = [info for key in self._ids() if (info := self._info(key)) is not None]
        with self._lock:
            for gone in self._infos.keys() - {info.glossary_id for info in infos}:
                del self._infos[gone]
        return sorted(infos, key=lambda info: (info.created, info.glossary_id))

    def delete(self, glossary_id: str, field: str = "glossary_id") -> None:
        """Remove the glossary stored under `glossary_id`; InvalidRequest or NotFound as `get` says."""
        key = glossary_key(glossary_id, field)
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            raise Refusal.UNKNOWN_GLOSSARY.not_found(glossary_id=key) from None

    def _info(self, key: str) -> GlossaryInfo | None:
        """A glossary's info; None where it is gone since the directory was read, or cannot be read (logged)."""
        path = self._path(key)
        try:
            stamp = _stamp(path, key)
            with self._lock:
                if (listed := self._infos.get(key)) is not None and listed[0] == stamp:
                    return listed[1]
                if (cached := self._parsed.get(key)) is not None and cached[0] == stamp:
                    self._infos[key] = (stamp, cached[1].info)
                    return cached[1].info
            info = _read(path, key).info
        except NotFound:
            return None
        except DamagedGlossary as error:
            logger.warning("glossary %s is left out of the list: %s", key, error)
            return None
        with self._lock:
            self._infos[key] = (stamp, info)
        return info

    def _keep(self, key: str, stamp: Stamp, glossary: Glossary) -> None:
        """Cache a glossary just read, dropping the least recently read beyond CACHED_TERMS (the last always stays)."""
        with self._lock:
            if (old := self._parsed.pop(key, None)) is not None:
                self._parsed_terms -= len(old[1].terms)
            self._parsed[key] = (stamp, glossary)
            self._parsed_terms += len(glossary.terms)
            while self._parsed_terms > CACHED_TERMS and len(self._parsed) > 1:
                _, (_, dropped) = self._parsed.popitem(last=False)
                self._parsed_terms -= len(dropped.terms)

    def _ids(self) -> list[str]:
        """The ids of the glossaries in the directory now (none before the first is stored)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return [name.removesuffix(".json") for name in names if _GLOSSARY_FILE.fullmatch(name)]

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"


def glossary_key(glossary_id: str, field: str) -> str:
    """A client's glossary id as its file is named: a UUID in canonical spelling; InvalidRequest naming `field` for
    anything else, so that no client string becomes a path."""
    try:
        return str(uuid.UUID(glossary_id.strip()))
    except ValueError:
        raise Refusal.GLOSSARY_ID.error(field=field, begins=glossary_id[:40]) from None


def _stamp(path: Path, key: str) -> Stamp:
    try:
        status = path.stat()
    except FileNotFoundError:
        raise Refusal.UNKNOWN_GLOSSARY.not_found(glossary_id=key) from None
    return status.st_ino, status.st_mtime_ns, status.st_size


def _to_json(glossary: Glossary) -> bytes:
    info = glossary.info
    document = {
        "format": FORMAT,
        "glossary_id": info.glossary_id,
        "name": info.name,
        "source_language": info.source_language,
        "target_language": info.target_language,
        "creation_time": info.created.isoformat(),
        "entries": [[term.source, term.target] for term in glossary.terms],
    }
    return json.dumps(document, ensure_ascii=False, indent=0).encode("utf-8")


def _read(path: Path, key: str) -> Glossary:
    """The glossary in `path`; NotFound where it is gone, DamagedGlossary where it cannot be read as one."""
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise Refusal.UNKNOWN_GLOSSARY.not_found(glossary_id=key) from None
    except ValueError as error:
        raise DamagedGlossary(f"{path} is no glossary file ({error})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else None
        raise DamagedGlossary(f"{path} is of format {found!r}; this server reads format {FORMAT}")
    try:
        terms = tuple(Term(source, target) for source, target in document["entries"])
        info = GlossaryInfo(
            key,
            document["name"],
            document["source_language"],
            document["target_language"],
            len(terms),
            datetime.fromisoformat(document["creation_time"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise DamagedGlossary(f"{path} lacks a field or holds a wrong one ({error!r})") from None
    return Glossary(info, terms)


def _write_whole(path: Path, data: bytes) -> None:
    """`data` as `path`, all of it or none: written and synced under a temporary name beside it, then renamed."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide it from a server running as another user
        os.replace(temporary, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself outlives a crash
    finally:
        os.close(directory)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) against every thread and process that takes it."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
