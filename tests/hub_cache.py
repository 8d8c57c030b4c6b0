"""A Hugging Face cache built by hand, the network blocked, and a stand-in hub that answers with errors.

`hub_cache` lays out `models--org--name/{refs/main, snapshots/<sha>/}` holding a tiny random Marian
(bench/marian_random.py), as huggingface_hub's snapshot_download leaves it. `block_network` makes every
outbound connection but loopback fail, so a test that passes made no call to the hub. `FakeHub` serves the
error answers the hub gives (its `X-Error-Code` header) for repositories and revisions that do not exist
or are gated, on a loopback port that `HF_ENDPOINT` points huggingface_hub at.
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from export.fetch import HubSettings
from tests.marian_tiny import build_marian_dir

REPO = "Helsinki-NLP/opus-mt-de-en"
SHA = "0123456789abcdef0123456789abcdef01234567"
# path fragment of the hub's API -> (status, X-Error-Code) it answers there
HUB_ERRORS = {
    "/api/models/nobody/no-such-model": (404, "RepoNotFound"),
    f"/api/models/{REPO}/revision/no-such-branch": (404, "RevisionNotFound"),
    "/api/models/some-org/gated-model": (403, "GatedRepo"),
}


def cache_folder(hub: Path, repo: str = REPO) -> Path:
    return hub / ("models--" + repo.replace("/", "--"))


def hub_cache(hub: Path, source: Path, repo: str = REPO, sha: str = SHA) -> Path:
    """`source`'s files as the snapshot `sha` of `repo` in the cache at `hub`, with refs/main naming it."""
    folder = cache_folder(hub, repo)
    shutil.copytree(source, folder / "snapshots" / sha)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(sha)
    return hub


def tiny_marian(out: Path) -> Path:
    """A tiny random opus-mt-de-en-like transformers directory (save_pretrained's layout)."""
    return build_marian_dir(out)


def _loopback(address: Any) -> bool:
    host = address[0] if isinstance(address, tuple) else address
    if isinstance(host, bytes | str) and str(host) in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


def block_network(patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Every Python socket connection to anything but loopback raises ConnectionRefusedError; `patch` sets the
    guards (pytest's monkeypatch.setattr undoes them after the test)."""
    connect = socket.socket.connect

    def guarded(self: socket.socket, address: Any) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address):
            raise ConnectionRefusedError(f"the test blocks outbound connections ({address})")
        connect(self, address)

    patch(socket.socket, "connect", guarded)
    original = socket.create_connection

    def create_connection(address: Any, *args: Any, **kwargs: Any) -> socket.socket:
        if not _loopback(address):
            raise ConnectionRefusedError(f"the test blocks outbound connections ({address})")
        return original(address, *args, **kwargs)

    patch(socket, "create_connection", create_connection)


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status, code = next(((s, c) for path, (s, c) in HUB_ERRORS.items() if path in self.path), (500, ""))
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        body = b'{"error": "answered by the test hub"}'
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def fake_hub() -> Iterator[str]:
    """A loopback HTTP server answering as the hub does for HUB_ERRORS; yields its URL for HF_ENDPOINT."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def closed_endpoint() -> str:
    """A loopback URL where nothing listens: the hub unreachable, as without a network."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# The hub tests' fixtures (tests/test_hub_models.py, tests/test_hub_sources.py import them)
@pytest.fixture(scope="module")
def marian(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random OPUS-MT model directory, as save_pretrained writes one."""
    return tiny_marian(tmp_path_factory.mktemp("marian") / "opus-mt-de-en")


@pytest.fixture
def hub(tmp_path: Path, marian: Path) -> Path:
    """A Hugging Face cache holding `marian` as the hub would: refs, snapshot, blobs."""
    return hub_cache(tmp_path / "hub", marian)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, hub: Path) -> HubSettings:
    """Hub settings reading `hub` offline, any network use failing the test."""
    block_network(monkeypatch.setattr)
    return HubSettings(hub, offline=True)
