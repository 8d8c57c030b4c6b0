"""Publish a built model directory into a cache that replicas share (a Kubernetes volume, NFS).

A build writes into a staging directory beside its final place (same filesystem), records every file's
size and sha256 in a manifest, and is renamed into place in one step: a reader sees the whole directory or
none. A directory is trusted only while its manifest matches its files; one that does not (disk damage, a
hand edit) is moved aside and built again. The lock file beside the final directory only spares other
replicas the same work: it is ignored once its heartbeat stops, and two builders that both run anyway
publish one directory, the second finding the place taken and discarding its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST_FILE = "MANIFEST.json"
STAGING_PREFIX = ".staging-"  # builds in progress (or killed): never read, swept once stale
TRASH_PREFIX = ".trash-"  # directories moved aside before deletion, so none is ever half-deleted in place
STALE_AFTER_S = 120.0  # a lock (or staging directory) untouched this long belongs to a builder that died
HEARTBEAT_S = 10.0  # how often a builder touches its lock
POLL_S = 0.5  # how often a waiting replica looks for the published directory
MAX_BUILDS = 2  # a build whose own output fails verification is a bug, not a reason to loop


class PublishError(RuntimeError):
    """A built directory does not match its own manifest; the message says which file."""


class Stopped(Exception):
    """The caller stopped waiting for, or building, a directory (the server is shutting down)."""


def never() -> bool:
    return False


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        os.fsync(f.fileno())  # on disk before the rename that makes the directory visible
    return digest


def write_manifest(directory: Path, identity: Mapping[str, object]) -> None:
    """MANIFEST.json: what the directory is (`identity`) and every file in it with its size and sha256."""
    files = {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE
    }
    path = directory / MANIFEST_FILE
    path.write_text(json.dumps({"identity": dict(identity), "files": files}, indent=1, sort_keys=True) + "\n")
    file_sha256(path)


def mismatch(directory: Path, identity: Mapping[str, object]) -> str | None:
    """Why `directory` is not the published build of `identity`, or None when every file matches."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as err:
        return f"no readable {MANIFEST_FILE} ({err})"
    if manifest.get("identity") != dict(identity):
        return f"{MANIFEST_FILE} names another build: {manifest.get('identity')}"
    for name, expected in manifest.get("files", {}).items():
        path = directory / name
        try:  # another replica may move a bad directory aside while this one reads it
            if path.stat().st_size != expected["size"] or file_sha256(path) != expected["sha256"]:
                return f"{name} differs from {MANIFEST_FILE}"
        except FileNotFoundError:
            return f"{name} is missing"
    return None


def discard(directory: Path) -> None:
    """Move `directory` aside in one rename, then delete it; a replica that renamed it first wins."""
    trash = directory.with_name(f"{TRASH_PREFIX}{directory.name}-{uuid.uuid4().hex[:8]}")
    try:
        directory.rename(trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def publish(staging: Path, final: Path) -> bool:
    """Rename `staging` to `final`; False (staging deleted) when another builder published there first."""
    try:
        staging.rename(final)
    except OSError:  # ENOTEMPTY / EEXIST: the place is taken
        if not final.is_dir():
            raise
        shutil.rmtree(staging, ignore_errors=True)
        return False
    return True


class BuildLock:
    """`<final>.lock`, created exclusively and touched by a heartbeat while its builder lives."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> bool:
        """True when this process now holds the lock; a stale lock is removed and taken over."""
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self.stale():
                    return False
                log.warning("ignoring the stale lock %s (untouched for over %.0f s)", self.path, STALE_AFTER_S)
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{socket.gethostname()} {os.getpid()}\n")
            self._heartbeat = threading.Thread(target=self._beat, name="build-lock", daemon=True)
            self._heartbeat.start()
            return True
        return False

    def stale(self) -> bool:
        try:
            return time.time() - self.path.stat().st_mtime > STALE_AFTER_S
        except FileNotFoundError:
            return True

    def held_elsewhere(self) -> bool:
        return self.path.exists() and not self.stale()

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(FileNotFoundError):
                os.utime(self.path)


def sweep_stale(parent: Path) -> None:
    """Delete staging and trash directories whose builders died (untouched for STALE_AFTER_S)."""
    for leftover in parent.glob(".*-*"):
        if leftover.name.startswith((STAGING_PREFIX, TRASH_PREFIX)) and leftover.is_dir():
            with contextlib.suppress(FileNotFoundError):
                if time.time() - leftover.stat().st_mtime > STALE_AFTER_S:
                    shutil.rmtree(leftover, ignore_errors=True)


def obtain(
    final: Path, identity: Mapping[str, object], build: Callable[[Path], None], stopped: Callable[[], bool] = never
) -> tuple[Path, bool]:
    """`final`, verified against its manifest, built by `build(staging)` and published unless a valid one is
    there already or another replica publishes it meanwhile; returns it and whether this call built it.
    Raises Stopped once `stopped()` is true while it waits for another replica's build."""
    final.parent.mkdir(parents=True, exist_ok=True)
    lock = BuildLock(final.with_name(final.name + ".lock"))
    builds = 0
    waiting_logged = False
    while True:
        if final.exists():
            reason = mismatch(final, identity)
            if reason is None:
                return final, builds > 0
            if builds >= MAX_BUILDS:
                raise PublishError(f"{final} fails its own manifest after building: {reason}")
            log.warning("%s is not a complete build (%s): building it again", final, reason)
            discard(final)
        if lock.held_elsewhere():
            if stopped():
                raise Stopped(f"stopped waiting for another replica to build {final}")
            if not waiting_logged:
                log.info("another replica is building %s (lock %s): waiting for it", final, lock.path)
                waiting_logged = True
            time.sleep(POLL_S)
        elif lock.acquire():
            try:
                if not final.exists():  # another replica may have published between the check and the lock
                    build_and_publish(final, identity, build)
                    builds += 1
            finally:
                lock.release()


def build_and_publish(final: Path, identity: Mapping[str, object], build: Callable[[Path], None]) -> None:
    """Build into a fresh staging directory beside `final`, write its manifest, rename it into place; a build
    that raises leaves nothing behind."""
    sweep_stale(final.parent)
    staging = final.with_name(f"{STAGING_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        build(staging)
        write_manifest(staging, identity)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not publish(staging, final):
        log.info("another replica published %s first: using it", final)
