"""Where a model named on the command line comes from: a transformers directory, or a hub id pinned to a commit.

`ID[@REVISION]` resolves with huggingface_hub, which honours HF_TOKEN, HF_ENDPOINT and its cache layout
(`models--org--name/{refs,snapshots,blobs}`): a commit sha is used as given, without the network; a branch or
tag is resolved to its sha online, or from the cache's `refs/` offline. Every hub failure becomes a FetchError
whose message is one line for the operator.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
COMMIT = re.compile(r"[0-9a-f]{40}")
# What the importer (export/hf.py) reads; pytorch_model.bin is left out: OPUS-MT repositories carry safetensors.
HUB_FILES = ["*.json", "*.spm", "*.safetensors", "README.md"]
REQUIRED_FILES = ("config.json", "*.safetensors", "source.spm", "target.spm", "vocab.json")  # what the importer reads
LOCAL_FILES = ("*.json", "*.spm", "*.safetensors", "pytorch_model.bin")  # hashed into a local directory's revision
PROGRESS_EVERY_S = 10.0
MB = 1e6


class FetchError(Exception):
    """A model that cannot be fetched as named; the message is one line that says why and what to do."""


@dataclass(frozen=True)
class ModelName:
    """A model as the operator named it: a hub id with an optional revision, or a local directory."""

    text: str  # as given, e.g. "Helsinki-NLP/opus-mt-de-en@main"
    repository: str  # the hub id, or the directory's name
    revision: str | None  # branch, tag or commit sha; None: the repository's default branch
    local: Path | None  # a directory that transformers' save_pretrained wrote, else None

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
    """`org/name`, `org/name@revision`, or an existing directory."""
    path = Path(text).expanduser()
    if path.is_dir():
        return ModelName(text, path.resolve().name, None, path.resolve())
    repository, _, revision = text.partition("@")
    if not HUB_ID.fullmatch(repository) or (revision == "" and "@" in text):
        raise FetchError(f"{text!r} is neither a directory nor a hub id like Helsinki-NLP/opus-mt-de-en[@revision]")
    return ModelName(text, repository, revision or None, None)


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
    with hub_errors(name, hub):
        resolved = api.resolve_revision(
            name.repository, revision=name.revision, cache_dir=hub.cache, local_files_only=hub.offline
        )
    return str(resolved.resolved)


def download(name: ModelName, commit: str, hub: HubSettings) -> Path:
    """The snapshot directory of `commit` with the files the importer reads, downloaded unless cached."""
    from huggingface_hub import errors, snapshot_download

    started = time.monotonic()

    def snapshot(local_only: bool) -> Path:
        return Path(
            snapshot_download(
                name.repository, revision=commit, cache_dir=hub.cache, local_files_only=local_only,
                allow_patterns=HUB_FILES,
            )
        )  # fmt: skip

    with hub_errors(name, hub), _progress(name, hub, started):
        try:  # a commit's snapshot is immutable: one already cached (and complete) needs no network
            directory = snapshot(local_only=True)
        except errors.LocalEntryNotFoundError:
            if hub.offline:
                raise
            directory = snapshot(local_only=False)
        # huggingface_hub hands back a cached snapshot without the commit's file listing as it is, and a
        # tokenizer or config fetched alone (from_pretrained, hf_hub_download) leaves one without the weights
        if (missing := missing_files(directory)) and not hub.offline:
            directory = snapshot(local_only=False)
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
    """Which of the files every OPUS-MT snapshot holds (REQUIRED_FILES) `directory` lacks."""
    return [pattern for pattern in REQUIRED_FILES if not any(directory.glob(pattern))]


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
        ) from err
    except errors.RevisionNotFoundError as err:
        raise FetchError(f"{name.repository} has no revision {name.revision!r}") from err
    except (errors.RevisionResolutionError, errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as err:
        why = "HF_HUB_OFFLINE is set" if hub.offline else "the hub cannot be reached"
        pinned = name.revision is not None and COMMIT.fullmatch(name.revision) is not None
        hint = "" if pinned else f" (a build already in --cache-dir is served by its commit: {name.repository}@SHA)"
        raise FetchError(f"{what} is not in the Hugging Face cache and {why}{hint}") from err
    except errors.HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else "no response"
        raise FetchError(f"the hub refused {what} (HTTP {status})") from err
