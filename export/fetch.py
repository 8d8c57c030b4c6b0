"""Where a model named on the command line comes from: a transformers directory, or a hub id pinned to a commit.

`ID[@REVISION]` resolves with huggingface_hub, which honours HF_TOKEN, HF_ENDPOINT and its cache layout
(`models--org--name/{refs,snapshots,blobs}`): a commit sha is used as given, without the network; a branch or
tag is resolved to its sha online, or from the cache's `refs/` offline. The weights are the commit's safetensors,
else its pytorch_model.bin, fetched only where torch is installed to read it. A directory is served as it is, a
snapshot in a Hugging Face cache (`models--org--name/snapshots/<sha>`) as `org/name` at that commit. Every
failure becomes a FetchError whose message is one line for the operator.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from export.importers.files import PICKLED_WEIGHTS, UnsupportedModel, torch_needed

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
COMMIT = re.compile(r"[0-9a-f]{40}")
# A model's page on the hub, as a browser shows it: https://huggingface.co/org/name[/tree/revision]
HUB_PAGE = re.compile(
    r"https?://(?:www\.)?(?:huggingface\.co|hf\.co)/(?P<repository>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
    r"(?:/tree/(?P<revision>[\w.-]+))?/?"
)
HUB_ORGANISATIONS = {"opus-mt-": "Helsinki-NLP", "opus-tatoeba-": "Helsinki-NLP"}  # name prefix -> its organisation
# What the importer (export/hf.py) reads; PICKLED_WEIGHTS is fetched on its own, where the commit has no safetensors
HUB_FILES = ["*.json", "*.spm", "*.model", "*.safetensors", "README.md"]
CONFIG = "config.json"  # read first: its model_type names the family, whose importer lists the other files, beside:
WEIGHTS = ("*.safetensors", PICKLED_WEIGHTS)  # the weights, in either file (safetensors preferred: no torch)
# Hashed into a local directory's revision: what the import reads (README.md: a family's languages, the licence)
LOCAL_FILES = ("*.json", "*.spm", "*.model", "*.safetensors", "pytorch_model.bin", "README.md")
PROGRESS_EVERY_S = 10.0
MB = 1e6


class FetchError(Exception):
    """A model that cannot be fetched as named; the message is one line that says why and what to do."""


@dataclass(frozen=True)
class ModelName:
    """A model as the operator named it: a hub id with an optional revision, or a local directory."""

    text: str  # as given, e.g. "Helsinki-NLP/opus-mt-de-en@main"
    repository: str  # the hub id (a snapshot directory's too), or the directory's name
    revision: str | None  # branch, tag or commit sha (a snapshot's); None: the default branch, or a plain directory
    local: Path | None  # a directory that transformers' save_pretrained wrote, or a snapshot; else None

    @property
    def cache_folder(self) -> str:
        """The folder name huggingface_hub's cache uses for this repository: models--org--name."""
        return "models--" + self.repository.replace("/", "--")


@dataclass(frozen=True)
class HubSettings:
    """How to reach the hub, from the environment huggingface_hub documents (parsed at the entrypoint)."""

    cache: Path | None = None  # HF_HUB_CACHE (or HF_HOME/hub); None: huggingface_hub's default
    offline: bool = False  # HF_HUB_OFFLINE: resolve and read from the cache only


def parse_name(text: str) -> ModelName:
    """`org/name`, `org/name@revision`, or an existing directory (a hub snapshot's: `org/name` at its commit)."""
    path = Path(text).expanduser()
    if path.is_dir():
        directory = path.resolve()
        if repository := snapshot_repository(directory):
            return ModelName(text, repository, directory.name, directory)
        return ModelName(text, directory.name, None, directory)
    if path.exists():
        raise FetchError(f"{text} is a file; --model takes a model directory or a hub id (org/name)")
    if page := HUB_PAGE.fullmatch(text):  # the model's page, pasted from a browser
        return ModelName(text, page["repository"], page["revision"], None)
    if "," in text:
        raise FetchError(f"{text!r} names no directory: several models are --model given once each, or ':'-separated "
                         "in TRANSLATE_MODEL")  # fmt: skip
    repository, _, revision = text.partition("@")
    if why := _written_as_path(repository):
        raise FetchError(f"there is no directory {path.absolute()} ({why}; a hub id is org/name[@revision])")
    if not HUB_ID.fullmatch(repository) or (revision == "" and "@" in text):
        raise FetchError(f"{text!r} is neither a directory nor a hub id like Helsinki-NLP/opus-mt-de-en[@revision]")
    return ModelName(text, repository, revision or None, None)


def _written_as_path(text: str) -> str:
    """Why `text`, which names no directory, is read as a mistyped path, not a hub id ('' where it is not): a
    hub id has one slash at most and starts with neither `.`, `/` nor `~`. `models/opus-mt-xx-yy` is a hub id
    whether or not `models/` is a directory here (a `--local-dir` download leaves `Helsinki-NLP/` beside the
    ids it serves); where the hub has no such repository, the refusal says no such directory is here either."""
    if text.startswith((".", "/", "~")) or text.endswith("/") or text.count("/") > 1:
        return f"{text!r} is written as a path"
    return ""


def _organisation_hint(name: ModelName) -> str:
    """What a refusal of an id without its organisation adds where the name says whose it is."""
    if "/" in name.repository:
        return ""
    for prefix, organisation in HUB_ORGANISATIONS.items():
        if name.repository.startswith(prefix):
            return f"; a hub id names its organisation too: {organisation}/{name.repository}"
    return "; a hub id names its organisation too: org/name"


def _nor_directory(name: ModelName) -> str:
    """What a refusal of a hub id adds where its first part is a directory here: that the path is missing too."""
    if Path(name.repository.partition("/")[0]).is_dir():
        return f"; nor is there a directory {Path(name.repository).absolute()}"
    return ""


def snapshot_repository(directory: Path) -> str | None:
    """`org/name` where `directory` is a snapshot in a Hugging Face cache (`models--org--name/snapshots/<sha>`)."""
    snapshots, folder = directory.parent, directory.parent.parent
    if COMMIT.fullmatch(directory.name) and snapshots.name == "snapshots" and folder.name.startswith("models--"):
        return folder.name.removeprefix("models--").replace("--", "/")  # the hub forbids "--" within a name
    return None


def local_revision(directory: Path) -> str:
    """A local directory's stand-in for a commit: sha256 over its model files' names and contents."""
    digest = hashlib.sha256()
    for path in sorted(p for pattern in LOCAL_FILES for p in directory.glob(pattern) if p.is_file()):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return "sha256-" + digest.hexdigest()[:40]


def resolve_commit(name: ModelName, hub: HubSettings) -> str:
    """The commit sha `name` means now: as given when it is one, else asked of the hub (or the cache offline)."""
    if name.revision is not None and COMMIT.fullmatch(name.revision):
        return name.revision
    api = _hub_api()
    try:
        with hub_errors(name, hub):
            resolved = api.resolve_revision(
                name.repository, revision=name.revision, cache_dir=hub.cache, local_files_only=hub.offline
            )
    except OSError as err:  # offline the reference file is read as it is
        raise FetchError(_damaged_reference(name, hub, str(err.strerror or err))) from err
    commit = str(resolved.resolved)
    if not COMMIT.fullmatch(commit):  # an emptied or overwritten reference file in the cache
        raise FetchError(_damaged_reference(name, hub, f"it holds {commit[:50]!r}, not a commit"))
    return commit


def _damaged_reference(name: ModelName, hub: HubSettings, why: str) -> str:
    from huggingface_hub import constants

    ref = Path(hub.cache or constants.HF_HUB_CACHE) / name.cache_folder / "refs" / (name.revision or "main")
    return (
        f"{name.text}: {ref} in the Hugging Face cache cannot be read ({why}): a damaged cache entry; delete it "
        "and fetch the model again"
    )


def download(name: ModelName, commit: str, hub: HubSettings) -> Path:
    """The snapshot directory of `commit` with the files the importer reads, downloaded unless cached: the
    safetensors where the commit has them, else its pytorch_model.bin, fetched only where torch can read it."""
    from huggingface_hub import errors, snapshot_download

    started = time.monotonic()

    def snapshot(local_only: bool, patterns: list[str] = HUB_FILES) -> Path:
        return Path(
            snapshot_download(
                name.repository, revision=commit, cache_dir=hub.cache, local_files_only=local_only,
                allow_patterns=patterns,
            )
        )  # fmt: skip

    with hub_errors(name, hub), _progress(name, hub, started):
        asked = False
        try:  # a commit's snapshot is immutable: one already cached (and complete) needs no network
            directory = snapshot(local_only=True)
        except errors.LocalEntryNotFoundError:
            if hub.offline:
                raise
            directory, asked = snapshot(local_only=False), True
        # huggingface_hub hands back a cached snapshot without the commit's file listing as it is, and a
        # tokenizer or config fetched alone (from_pretrained, hf_hub_download) leaves one without the weights
        if not (hub.offline or asked) and (missing_files(directory) or not _holds(directory, "*.safetensors")):
            directory = snapshot(local_only=False)
        if not hub.offline and not any(_holds(directory, pattern) for pattern in WEIGHTS):
            if torch_installed():  # the commit has no safetensors: its torch pickle, where it has one
                directory = snapshot(local_only=False, patterns=[PICKLED_WEIGHTS])
            elif _lists(name, commit, PICKLED_WEIGHTS):
                raise FetchError(torch_needed(f"{name.repository}@{commit[:12]}", name.repository))
        missing = missing_files(directory)
    if missing:
        why = (
            "HF_HUB_OFFLINE is set"
            if hub.offline
            else "the hub did not send them (unreachable, or not in the repository)"
        )
        raise FetchError(
            f"the cached snapshot of {name.repository}@{commit[:12]} ({directory}) lacks {', '.join(missing)} and "
            f"{why}: a partial download; fetch it with network access"
        )
    size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    log.info("fetched %s@%s: %.1f MB in %.1f s (%s)", name.repository, commit[:12], size / MB,
             time.monotonic() - started, directory)  # fmt: skip
    return directory


def missing_files(directory: Path) -> list[str]:
    """Which of the files every snapshot of its family holds (config.json, the family's tokenizer files, and
    WEIGHTS in either file) `directory` lacks; FetchError where config.json names a family no importer serves."""
    missing = [pattern for pattern in (CONFIG, *family_files(directory)) if not _holds(directory, pattern)]
    if not any(_holds(directory, pattern) for pattern in WEIGHTS):
        missing.append(" or ".join(WEIGHTS))
    return missing


def family_files(directory: Path) -> tuple[str, ...]:
    """The files the importer of config.json's model_type reads beside it and the weights; none where config.json
    is missing or unreadable (the importer then names it)."""
    from export.importers import required_files  # the registry reads the snapshot's files; fetching needs it here

    try:
        config = json.loads((directory / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    try:
        return required_files(config.get("model_type") if isinstance(config, dict) else None)
    except UnsupportedModel as err:
        raise FetchError(f"the importer cannot carry this model: {err}") from err


def _holds(directory: Path, pattern: str) -> bool:
    """Whether `directory` holds a file matching `pattern`; a snapshot's link to a deleted blob is none, so
    that the file is fetched again."""
    return any(path.is_file() for path in directory.glob(pattern))


def _lists(name: ModelName, commit: str, filename: str) -> bool:
    """Whether the hub lists `filename` in `commit`; False where it cannot be asked (the files then missing say so)."""
    try:
        return bool(_hub_api().file_exists(name.repository, filename, revision=commit))
    except Exception as err:  # huggingface_hub's transport errors share no public base class
        log.debug("cannot ask the hub whether %s@%s holds %s: %s", name.repository, commit[:12], filename, err)
        return False


def torch_installed() -> bool:
    """Whether `import torch` would find torch, without importing it (the server never needs it)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a finder refusing it, or a module entry without a spec
        return False


def require_readable_weights(name: ModelName, commit: str, directory: Path) -> None:
    """FetchError where `directory` holds its weights only as pytorch_model.bin and torch is not installed."""
    if _holds(directory, "*.safetensors") or not _holds(directory, PICKLED_WEIGHTS) or torch_installed():
        return
    if name.local is not None and name.revision is None:  # a directory of its own: no hub revision to name
        raise FetchError(torch_needed(str(directory)))
    raise FetchError(torch_needed(f"{name.repository}@{commit[:12]}", name.repository))


@contextmanager
def _progress(name: ModelName, hub: HubSettings, started: float) -> Iterator[None]:
    """Log the bytes in the repository's cache folder every PROGRESS_EVERY_S while a download runs."""
    from huggingface_hub import constants

    folder = Path(hub.cache or constants.HF_HUB_CACHE) / name.cache_folder / "blobs"
    done = threading.Event()

    def report() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            size = sum(p.stat().st_size for p in folder.glob("*") if p.is_file()) if folder.is_dir() else 0
            log.info("downloading %s: %.1f MB after %.0f s", name.repository, size / MB, time.monotonic() - started)

    reporter = threading.Thread(target=report, name="download-progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()


def _hub_api():  # type: ignore[no-untyped-def]
    from huggingface_hub import HfApi

    return HfApi()


@contextmanager
def hub_errors(name: ModelName, hub: HubSettings) -> Iterator[None]:
    """huggingface_hub's exceptions as a FetchError naming the model and the way out."""
    from huggingface_hub import errors

    what = name.repository + (f"@{name.revision}" if name.revision else "")
    try:
        yield
    except errors.GatedRepoError as err:
        raise FetchError(f"{name.repository} is gated: accept its terms on the hub and set HF_TOKEN") from err
    except errors.RepositoryNotFoundError as err:
        raise FetchError(
            f"no repository {name.repository} on the hub, or it is private and HF_TOKEN cannot read it"
            + _organisation_hint(name)
            + _nor_directory(name)
        ) from err
    except errors.RevisionNotFoundError as err:
        raise FetchError(f"{name.repository} has no revision {name.revision!r}") from err
    except (errors.RevisionResolutionError, errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as err:
        why = "HF_HUB_OFFLINE is set" if hub.offline else "the hub cannot be reached"
        pinned = name.revision is not None and COMMIT.fullmatch(name.revision) is not None
        hint = "" if pinned else f" (a build already in --cache-dir is served by its commit: {name.repository}@SHA)"
        also = _organisation_hint(name) + _nor_directory(name)
        raise FetchError(f"{what} is not in the Hugging Face cache and {why}{hint}{also}") from err
    except errors.HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else "no response"
        raise FetchError(f"the hub refused {what} (HTTP {status})") from err
