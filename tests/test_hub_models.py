"""`translate-server --model ID[@REVISION]`: resolved from a hand-built Hugging Face cache with the network blocked,
imported, built, published once into the cache of built models and served under its id; replicas racing or
killed mid-build leave one complete directory or none; every bad input ends the server with one line, status 2."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import export.hf
import export.hub
from export import publish
from export.fetch import FetchError, HubSettings
from export.hub import BuildPlan, ensure_model, plan_for
from model.directory import FORMAT_VERSION
from server.edge.config import EnginesConfig, ModelsConfig, ObservabilityConfig, ServerConfig, ServingConfig
from server.edge.flags import parse_config
from server.edge.loading import StartupError, load_models
from server.edge.server import TranslationServer
from server.processes.engines import close_model
from server.proto.translation.v1 import translation_pb2 as pb
from tests.hub_cache import (
    REPO,
    SHA,
    cache_folder,
    closed_endpoint,
    fake_hub,
    hub,
    hub_cache,
    marian,
    offline,
    tiny_marian,
)
from tests.serving import ROOT, RunningServer, health_status, request, running_server, server_loop, wait_until
from tests.test_client_cli import cli

BLOCKED = "from tests.hub_cache import block_network; block_network(); "

HUB_FIXTURES = (marian, hub, offline)  # tests/hub_cache.py's fixtures, imported for pytest to find


def published(cache: Path) -> list[Path]:
    """The complete build directories in `cache` (staging and trash directories start with a dot)."""
    return [p.parent for p in cache.rglob(publish.MANIFEST_FILE) if not any(part.startswith(".") for part in p.parts)]


def leftovers(cache: Path) -> list[Path]:
    return [p for p in cache.rglob(".*") if p.name.startswith((publish.STAGING_PREFIX, publish.TRASH_PREFIX))]


def server_config(tmp_path: Path, hub: Path, *models: str, variant: str = "auto") -> ServerConfig:
    return ServerConfig(
        serving=ServingConfig(port=0, host="localhost"),
        models=ModelsConfig(models=models or (REPO,), cache_dir=tmp_path / "cache", hf_hub_cache=hub, hf_offline=True),
        engines=EnginesConfig(variant=variant, provider="cpu", engines=1),
        observability=ObservabilityConfig(metrics_port=-1),
    )


def hub_env(hub: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSLATE_"))}
    return {**env, "PYTHONPATH": str(ROOT), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", **extra}


def test_model_flags_and_hub_variables_are_parsed_once() -> None:
    env = {"TRANSLATE_MODEL": f"a/b{os.pathsep}c/d@v1", "HF_HOME": "/h", "HF_HUB_OFFLINE": "1"}
    models = parse_config([], env).models
    assert models.models == ("a/b", "c/d@v1") and models.hf_offline
    assert models.hf_hub_cache == Path("/h/hub") and models.model_cache == Path("/h/translate-service")
    argv = ["--model", "x/y", "--model", "z/w", "--cache-dir", "/c"]
    models = parse_config(argv, {**env, "HF_HUB_CACHE": "/x/hub"}).models
    assert models.models == ("x/y", "z/w") and models.model_cache == Path("/c")
    assert models.hf_hub_cache == Path("/x/hub")
    beside = parse_config([], {"HF_HUB_CACHE": "/x/hub", "HF_HUB_OFFLINE": "0"}).models
    assert beside.model_cache == Path("/x/translate-service") and not beside.hf_offline
    xdg = parse_config([], {"XDG_CACHE_HOME": "/x"}).models
    assert xdg.model_cache == Path("/x/huggingface/translate-service")
    default = parse_config([], {}).models
    assert not default.hf_offline and default.model_cache == Path.home() / ".cache/huggingface/translate-service"


def test_served_by_id_offline_and_a_second_start_builds_nothing(
    tmp_path: Path, hub: Path, offline: HubSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = server_config(tmp_path, hub)
    logging.getLogger("huggingface_hub").addHandler(logging.StreamHandler())  # as huggingface_hub does at import
    with running_server(load_models(config), config) as server:
        # huggingface_hub's records reach the server's handler alone (its own would print plain lines beside JSON)
        assert logging.getLogger("huggingface_hub").handlers == []
        (info,) = server.stub.ListModels(pb.ListModelsRequest(), timeout=30).models
        assert (info.name, info.revision, info.variant) == (REPO, SHA, "fp32")
        reply = server.stub.Translate(request(["Das Haus ist groß."], model=REPO), timeout=60)
        assert len(reply.results) == 1
        # the translate CLI names it the same way: --list-models shows id and commit, --model ID picks it
        code, listed, _ = cli(server, "--list-models")
        assert code == 0 and listed.startswith(f"{REPO} at {SHA[:12]}: de-en")
        code, out, _ = cli(server, "--model", REPO, texts=["Das Haus ist groß."])
        assert code == 0 and out.strip() == reply.results[0].translation.strip()
        assert cli(server, "--model", "Helsinki-NLP/opus-mt-xx-yy", texts=["Haus"])[0] == 3  # INVALID_ARGUMENT
    (directory,) = published(tmp_path / "cache")
    before = [(p, p.stat().st_ino, p.stat().st_mtime_ns) for p in [directory, *directory.rglob("*")]]

    def no_build(*args: object) -> None:
        raise AssertionError("a cached build was built again")

    monkeypatch.setattr(export.hub, "build", no_build)
    (again,) = load_models(config)
    close_model(again.runner)  # its engine process: only what it loaded is looked at
    assert again.description.name == REPO
    assert [(p, p.stat().st_ino, p.stat().st_mtime_ns) for p in [directory, *directory.rglob("*")]] == before


def test_the_cache_key_changes_with_the_format_version_and_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    base = BuildPlan().folder()
    assert base.startswith(f"f{FORMAT_VERSION}-fp32-")
    int8 = BuildPlan(("fp32", "int8"))
    assert len({base, int8.folder(), BuildPlan(opset=17).folder(), replace(int8, int8_7bit=True).folder()}) == 4
    fp16 = BuildPlan(("fp32", "fp16"))
    assert fp16.folder() != replace(fp16, fp16_gate="cuda").folder()  # a gated build is never an ungated one
    monkeypatch.setattr(export.hub, "FORMAT_VERSION", FORMAT_VERSION + 1)
    assert BuildPlan().folder() != base
    monkeypatch.setattr(export.hub, "FORMAT_VERSION", FORMAT_VERSION)
    monkeypatch.setattr(export.hf, "IMPORT_RULES", export.hf.IMPORT_RULES + 1)  # an import that now differs
    assert BuildPlan().folder() != base


def test_auto_builds_fp32_and_an_asked_variant_is_built_alone(tmp_path: Path, hub: Path, offline: HubSettings) -> None:
    """auto on CPU: no BLEU gate can price a fetched model's int8 without a test set, so fp32 is built and
    served (on CUDA fp16 is built beside it and gated against it: tests/test_fp16_gate.py); int8 asked for is
    built alone, from the weights (7-bit weights per channel where the CPU has no int8 dot products)."""
    assert plan_for("auto", "cpu", "vnni") == BuildPlan()
    assert plan_for("auto", "cuda", "plain") == BuildPlan(("fp32", "fp16"), fp16_gate="cuda")
    assert plan_for("int8", "cpu", "plain") == BuildPlan(("int8",), int8_7bit=True)
    assert plan_for("fp16", "cuda", "plain") == BuildPlan(("fp16",))
    (model,) = load_models(server_config(tmp_path, hub, variant="int8"))
    close_model(model.runner)
    assert model.description.variant == "int8" and model.description.available_variants == ["int8"]


def test_a_branch_resolves_offline_from_the_cache_and_a_sha_needs_no_ref(
    tmp_path: Path, hub: Path, offline: HubSettings
) -> None:
    built = ensure_model(f"{REPO}@main", BuildPlan(), tmp_path / "cache", offline)
    assert built.revision == SHA and built.built
    (cache_folder(hub) / "refs" / "main").unlink()
    again = ensure_model(f"{REPO}@{SHA}", BuildPlan(), tmp_path / "cache", offline)
    assert again.directory == built.directory and not again.built
    with pytest.raises(FetchError, match="not in the Hugging Face cache and HF_HUB_OFFLINE is set"):
        ensure_model(REPO, BuildPlan(), tmp_path / "cache", offline)


def test_an_unreachable_hub_falls_back_to_the_cached_ref(tmp_path: Path, hub: Path, offline: HubSettings) -> None:
    """Online, but every connection refused (the network blocked): the branch resolves from refs/ and builds."""
    built = ensure_model(REPO, BuildPlan(), tmp_path / "cache", HubSettings(hub, offline=False))
    assert built.revision == SHA and built.built


def test_a_local_transformers_directory_is_served_under_its_name(
    tmp_path: Path, marian: Path, offline: HubSettings
) -> None:
    built = ensure_model(str(marian), BuildPlan(), tmp_path / "cache", offline)
    assert built.name == marian.name and built.revision.startswith("sha256-") and built.built
    assert not ensure_model(str(marian), BuildPlan(), tmp_path / "cache", offline).built


@contextmanager
def loading_server(config: ServerConfig) -> Iterator[tuple[RunningServer, concurrent.futures.Future[None]]]:
    """A started server and its `load()` running in the background: health answers while models are fetched."""

    async def started() -> tuple[TranslationServer, int]:  # grpc.aio binds a server to the loop that makes it
        server = TranslationServer(config)
        return server, await server.start()

    with server_loop() as loop:
        server, port = asyncio.run_coroutine_threadsafe(started(), loop).result(60)
        running = RunningServer(server, port, loop)
        try:
            yield running, running.start(server.load())
        finally:
            running.channel.close()
            if not server.stopping.is_set():
                running.run(server.shutdown(0.0))


def test_health_is_not_serving_until_the_build_is_published(
    tmp_path: Path, hub: Path, offline: HubSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    building, release = threading.Event(), threading.Event()
    real_build = export.hub.build

    def held_build(*args: object) -> None:
        building.set()
        assert release.wait(60)
        real_build(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(export.hub, "build", held_build)
    with loading_server(server_config(tmp_path, hub)) as (running, loading):
        try:
            assert building.wait(60)
            assert health_status(running.channel) == "NOT_SERVING"
            assert health_status(running.channel, "translation.v1.Translator") == "NOT_SERVING"
            release.set()
            loading.result(120)
            assert health_status(running.channel) == "SERVING"
        finally:
            release.set()


class PollCounter:
    """Stands for the `time` module in `export.publish`: counts the waiting replica's polls (`sleep`)."""

    def __init__(self) -> None:
        self.sleeps = 0

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        time.sleep(seconds)

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def test_shutdown_stops_a_start_waiting_for_another_replicas_build(
    tmp_path: Path,
    hub: Path,
    offline: HubSettings,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another replica holds the build lock (fresh); a SIGTERM'd server stops waiting at its next look at the
    lock (no further poll), builds nothing. Broken once on purpose (ten polls between looks at the lock),
    the count showed the stopped server sleeping through all ten."""
    final = tmp_path / "cache" / cache_folder(hub).name / SHA / BuildPlan().folder()
    final.parent.mkdir(parents=True)
    lock = final.with_name(final.name + ".lock")
    lock.write_text("another-host 1\n")
    caplog.set_level(logging.INFO, logger="export.publish")
    polls = PollCounter()
    monkeypatch.setattr(publish, "time", polls)
    with loading_server(server_config(tmp_path, hub)) as (running, loading):
        wait_until(lambda: "another replica is building" in caplog.text, timeout=60)  # waiting on the lock
        assert not loading.done() and health_status(running.channel) == "NOT_SERVING"
        polled_before_stop = polls.sleeps
        running.run(running.server.shutdown(0.0))
        with pytest.raises(StartupError, match="stopped waiting for another replica to build"):
            loading.result(30)
        assert polls.sleeps <= polled_before_stop + 1  # the poll under way when it stopped, none after it
    assert not published(tmp_path / "cache") and lock.exists()  # the other replica's lock is left to it


def test_a_build_asked_to_stop_stops_between_its_steps_and_leaves_nothing(tmp_path: Path, offline: HubSettings) -> None:
    with pytest.raises(publish.Stopped, match=f"stopped building {REPO}"):
        ensure_model(REPO, BuildPlan(), tmp_path / "cache", offline, stopped=lambda: True)
    assert not published(tmp_path / "cache") and not leftovers(tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.lock"))


def test_a_corrupt_published_directory_is_detected_and_rebuilt(tmp_path: Path, offline: HubSettings) -> None:
    """Broken once on purpose (`mismatch` comparing only sizes, not the sha256), the flipped byte went
    unseen: the corrupt graph would have been served."""
    built = ensure_model(REPO, BuildPlan(), tmp_path / "cache", offline)
    graph = built.directory / "onnx" / "fp32" / "encoder.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    graph.write_bytes(bytes(data))
    identity = json.loads((built.directory / publish.MANIFEST_FILE).read_text())["identity"]
    assert publish.mismatch(built.directory, identity) == "onnx/fp32/encoder.onnx differs from MANIFEST.json"
    rebuilt = ensure_model(REPO, BuildPlan(), tmp_path / "cache", offline)
    assert rebuilt.built and rebuilt.directory == built.directory
    assert graph.read_bytes() != bytes(data) and published(tmp_path / "cache") == [built.directory]
    assert not leftovers(tmp_path / "cache")


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: (d / publish.MANIFEST_FILE).unlink(), "no readable MANIFEST.json"),
        (lambda d: (d / "onnx" / "graph.bin").unlink(), "onnx/graph.bin is missing"),
        (lambda d: (d / "onnx" / "graph.bin").write_bytes(b"\0" * 10), "onnx/graph.bin differs"),
        (lambda d: (d / publish.MANIFEST_FILE).write_text('{"identity": {}, "files": {}}'), "names another build"),
    ],
    ids=["no-manifest", "missing-file", "truncated-file", "other-identity"],
)
def test_a_partial_or_foreign_directory_is_rebuilt(tmp_path: Path, damage: Any, reason: str) -> None:
    final, identity = tmp_path / "model", {"repository": "x", "revision": "y"}

    def build(staging: Path) -> None:
        (staging / "onnx").mkdir()
        (staging / "onnx" / "graph.bin").write_bytes(bytes(range(256)) * 100)

    assert publish.obtain(final, identity, build) == (final, True)
    damage(final)
    assert reason in (publish.mismatch(final, identity) or "")
    assert publish.obtain(final, identity, build) == (final, True)
    assert publish.mismatch(final, identity) is None and not leftovers(tmp_path)


def test_two_builders_without_the_lock_still_publish_one_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Correctness rests on the rename, not the lock: with the lock taken by nobody, both build, one publishes."""
    monkeypatch.setattr(publish.BuildLock, "acquire", lambda self: True)
    monkeypatch.setattr(publish.BuildLock, "held_elsewhere", lambda self: False)
    monkeypatch.setattr(publish.BuildLock, "release", lambda self: None)
    both = threading.Barrier(2)
    final = tmp_path / "cache" / "model"
    identity = {"repository": "x", "revision": "y"}

    def build(staging: Path) -> None:
        (staging / "weights.bin").write_text(threading.current_thread().name * 1000)
        both.wait(30)  # both are building at once

    results: list[tuple[Path, bool]] = []
    threads = [
        threading.Thread(target=lambda: results.append(publish.obtain(final, identity, build)), name=f"builder{i}")
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [path for path, _ in results] == [final, final] and all(built for _, built in results)
    assert publish.mismatch(final, identity) is None
    assert (final / "weights.bin").read_text() in ("builder0" * 1000, "builder1" * 1000)
    assert sorted(p.name for p in final.parent.iterdir()) == ["model"]


def test_racing_processes_publish_one_directory(tmp_path: Path, hub: Path) -> None:
    command = [sys.executable, "-c", BLOCKED + "import sys, export.hub; sys.exit(export.hub.main())", REPO,
               "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    processes = [
        subprocess.Popen(command, env=hub_env(hub), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=300) for process in processes]
    assert [p.returncode for p in processes] == [0, 0], [err for _, err in outputs]
    (directory,) = published(tmp_path / "cache")
    assert [out.strip() for out, _ in outputs] == [str(directory)] * 2
    identity = json.loads((directory / publish.MANIFEST_FILE).read_text())["identity"]
    assert publish.mismatch(directory, identity) is None
    assert not leftovers(tmp_path / "cache") and not list((tmp_path / "cache").rglob("*.lock"))


def test_a_build_killed_midway_leaves_no_directory_and_the_next_start_builds(
    tmp_path: Path, hub: Path, offline: HubSettings
) -> None:
    """The killed builder's lock and staging directory are dated back past STALE_AFTER_S, as its stopped
    heartbeat leaves them. Broken once on purpose (`sweep_stale` deleting nothing), its staging directory
    was left behind."""
    flag = tmp_path / "graphs-written"
    script = BLOCKED + (
        "import sys, time, pathlib, export.hub as h\n"
        "real = h._export\n"
        "def slow(out, plan):\n"
        f"    real(out, plan); pathlib.Path({str(flag)!r}).touch(); time.sleep(300)\n"
        "h._export = slow\n"
        "sys.exit(h.main())\n"
    )
    command = [sys.executable, "-c", script, REPO, "--cache-dir", str(tmp_path / "cache")]
    process = subprocess.Popen(command, env=hub_env(hub), cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        wait_until(flag.exists, timeout=120)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    assert not published(tmp_path / "cache") and leftovers(tmp_path / "cache")  # the staging directory only
    untouched = time.time() - publish.STALE_AFTER_S - 1  # as the dead builder left them, the heartbeat stopped
    for path in [*leftovers(tmp_path / "cache"), *(tmp_path / "cache").rglob("*.lock")]:
        os.utime(path, (untouched, untouched))
    built = ensure_model(REPO, BuildPlan(), tmp_path / "cache", offline)
    assert built.built and published(tmp_path / "cache") == [built.directory]
    assert not leftovers(tmp_path / "cache")


def _serve(hub: Path, model: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    args = ["--model", model, "--cache-dir", str(tmp_path / "cache"), "--port", "0", "--metrics-port", "-1"]
    return subprocess.run(
        [sys.executable, "-c", BLOCKED + "from server.edge.main import main; main()", *args],
        env=hub_env(hub, **env), cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("model", "online", "says"),
    [
        ("nobody/no-such-model", False, "nobody/no-such-model is not in the Hugging Face cache and HF_HUB_OFFLINE"),
        ("nobody/no-such-model", True, "no repository nobody/no-such-model on the hub, or it is private"),
        (REPO, None, f"{REPO} is not in the Hugging Face cache and the hub cannot be reached"),
        (f"{REPO}@no-such-branch", True, f"{REPO} has no revision 'no-such-branch'"),
        ("some-org/gated-model", True, "some-org/gated-model is gated: accept its terms on the hub and set HF_TOKEN"),
        ("not a hub id!", False, "is neither a directory nor a hub id"),
        ("./modles/opus-mt-de-en", False, "there is no directory"),
    ],
)
def test_bad_input_ends_the_server_in_one_line_with_status_2(
    tmp_path: Path, hub: Path, model: str, online: bool | None, says: str
) -> None:
    """online True: the stand-in hub answers; None: the hub's address refuses connections; False: HF_HUB_OFFLINE.
    Unreachable or offline, the Hugging Face cache is empty."""
    empty = tmp_path / "empty-hub"  # nothing cached
    with fake_hub() as endpoint:
        env = {"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0"} if online else {}
        if online is None:
            env = {"HF_ENDPOINT": closed_endpoint(), "HF_HUB_OFFLINE": "0"}
        result = _serve(hub if online else empty, model, tmp_path, **env)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and last.startswith("translate-server: ") and says in last, result.stderr
    assert not published(tmp_path / "cache") and not leftovers(tmp_path / "cache")


def test_an_architecture_the_importer_cannot_carry_ends_with_its_reason(tmp_path: Path, marian: Path) -> None:
    hub = hub_cache(tmp_path / "hub", marian, repo="google/t5-small")
    config = cache_folder(hub, "google/t5-small") / "snapshots" / SHA / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "t5"}))
    result = _serve(hub, "google/t5-small", tmp_path)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2, result.stderr
    assert "the importer cannot carry this model: model_type is 't5'" in last
    assert not published(tmp_path / "cache") and not leftovers(tmp_path / "cache")


@pytest.mark.parametrize(
    ("repo", "damage", "says"),
    [
        ("acme/opus-mt-de-en", lambda d: (d / "config.json").write_text('{"model_type": "mar'),
         "SNAPSHOT/config.json is not valid JSON"),
        ("acme/opus-mt-de-en", lambda d: (d / "source.spm").write_bytes(b"\x00not a sentencepiece model"),
         "SNAPSHOT/source.spm cannot be read"),
        ("acme/my-model", lambda d: (d / "tokenizer_config.json").unlink(missing_ok=True),
         "import it with python -m export.hf --model ID --out DIR --source-lang"),
        ("acme/opus-mt-de-en", lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 100),
         "SNAPSHOT/model.safetensors cannot be read"),
        ("acme/opus-mt-de-en", lambda d: (d / "model.safetensors").unlink(),
         "lacks *.safetensors or pytorch_model.bin and HF_HUB_OFFLINE is set: a partial download; fetch it with "
         "network access"),
        ("acme/opus-mt-de-en", lambda d: (d / "config.json").write_text(
            json.dumps({**json.loads((d / "config.json").read_text()), "d_model": 32})),
         "config.json and model.safetensors of"),
    ],
)  # fmt: skip
def test_a_damaged_or_unnamed_model_ends_in_one_line_and_leaves_no_folders(
    tmp_path: Path, marian: Path, repo: str, damage: Any, says: str
) -> None:
    """Broken once on purpose (the importer reading the files as they came), a truncated config.json ended in a
    JSONDecodeError traceback and exit 1, a corrupt source.spm imported and failed at export; a name that gives
    no languages was told to pass flags translate-server does not have, and left empty folders in the cache.
    Weights cut short or disagreeing with the config ended in a SafetensorError or WeightsError traceback and
    exit 1, and a snapshot without its weights was taken for complete and blamed on the architecture."""
    hub = hub_cache(tmp_path / "hub", marian, repo=repo)
    snapshot = cache_folder(hub, repo) / "snapshots" / SHA
    damage(snapshot)
    result = _serve(hub, repo, tmp_path)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert says.replace("SNAPSHOT", str(snapshot.resolve())) in last, last
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_dir()]  # no folder left behind, empty or not


def test_a_snapshot_without_its_weights_is_fetched_again_when_the_hub_is_reachable(
    tmp_path: Path, marian: Path
) -> None:
    """A cached snapshot that lacks the weights (a tokenizer fetched alone leaves one) is not taken for complete:
    with a network the files are asked for again, here of a hub that cannot be reached, and the line says what
    the snapshot lacks. (Broken once on purpose, the local snapshot taken as it came: it ended in "the importer
    cannot carry this model: no model.safetensors".)"""
    repo = "acme/opus-mt-de-en"
    hub = hub_cache(tmp_path / "hub", marian, repo=repo)
    (cache_folder(hub, repo) / "snapshots" / SHA / "model.safetensors").unlink()
    result = _serve(hub, f"{repo}@{SHA}", tmp_path, HF_ENDPOINT=closed_endpoint(), HF_HUB_OFFLINE="0")
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "cannot carry" not in last, last
    assert "lacks *.safetensors or pytorch_model.bin and the hub did not send them" in last, last


def test_a_local_directorys_revision_follows_every_file_the_import_reads(tmp_path: Path) -> None:
    """The model card decides a language family's sources: a changed README.md is another build. (Broken once on
    purpose, the card left out of the hash: the cached build kept the old languages.)"""
    from export.fetch import local_revision

    directory = tiny_marian(tmp_path / "opus-mt-zle-en")
    (directory / "README.md").write_text("* source language(s): bel rus\n")
    before = local_revision(directory)
    (directory / "README.md").write_text("* source language(s): bel rus ukr\n")
    assert local_revision(directory) != before
