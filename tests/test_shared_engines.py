"""`--processes N`: engines the parent starts once and every front process uses over a Unix socket
(server/edge/shared_engines.py, server/processes/engine_process.py `SharedModel`).

Two servers on one engine get the same answers as its own server would, the engine frees what a server that
leaves held, refuses a connection without the parent's key, and fails every server's calls UNAVAILABLE when
it dies; served, the steps gather both servers' calls, the metrics count each engine once, SIGTERM drains
every call, and a dead engine stops the server with the reason.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import grpc
import pytest

from bench.run import free_port
from server.core.events import EngineLimits, Event, FailureReason, RequestDone, RequestFailed, SentenceDone
from server.core.work import DecodeOptions
from server.processes.engine_process import EngineProcess, ModelProcess, SharedModel
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc
from tests.hub_cache import REPO, SHA, hub_cache, tiny_marian
from tests.serving import ROOT, request, wait_until
from tests.test_engine_process import pid_alive, settings
from tests.test_hub_models import BLOCKED, hub_env
from tests.test_replicas import (
    DRAIN_CALLS,
    MAX_SLOTS,
    SERVING,
    TEXTS,
    _children,
    _cmdline,
    _engine_pids,
    replicas,
    translate_over,
)

SLOTS = 4
LIMITS = EngineLimits(max_slots=SLOTS, max_queue_sentences=256)
SOURCE = [[4, 5, 6, 3], [7, 8, 3], [9, 10, 11, 12, 3]]
GREEDY = DecodeOptions(beam_size=1, max_output_len=6)
LONG = DecodeOptions(beam_size=1, max_output_len=60)


class Outcomes:
    """What one request's events ended in, waited for."""

    def __init__(self) -> None:
        self.final: Event | None = None
        self.sentences: dict[int, list[tuple[int, ...]]] = {}  # each sentence's hypotheses' tokens
        self.done = threading.Event()

    def __call__(self, event: Event) -> None:
        if isinstance(event, SentenceDone):
            self.sentences[event.sentence_index] = [h.tokens for h in event.hypotheses]
        if isinstance(event, RequestDone | RequestFailed):
            self.final = event
            self.done.set()

    def wait(self, timeout: float = 60) -> Event:
        assert self.done.wait(timeout), "no answer"
        assert self.final is not None
        return self.final


class SharedEngineUnderTest:
    """A shared engine on the tiny model, as the parent starts it, and the servers attached to it."""

    def __init__(self, model_dir: Path, socket: Path) -> None:
        self.socket = str(socket)
        self.process = ModelProcess(settings(model_dir, SLOTS), listen_at=self.socket)
        self.control = self.process.start_engine(LIMITS, None, None, 0.0, 0)
        self.control.warmup()
        self.servers: list[EngineProcess] = []
        self.failures: list[int] = []

    def attach(self) -> EngineProcess:
        index = len(self.servers)
        engine = SharedModel(self.socket).start_engine(LIMITS, None, lambda: self.failures.append(index))
        engine.warmup()  # warm already: answered at once
        self.servers.append(engine)
        return engine

    def close(self) -> None:
        for engine in self.servers:
            engine.stop(5)
        self.control.stop(5)


@pytest.fixture
def shared_engine(tiny_exported_dir: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    engine = SharedEngineUnderTest(tiny_exported_dir, tmp_path / "engine.sock")
    try:
        yield engine
    finally:
        engine.close()


def translate(engine: EngineProcess, options: DecodeOptions = GREEDY) -> Outcomes:
    outcome = Outcomes()
    engine.submit(SOURCE, options, outcome)
    outcome.wait()
    return outcome


def test_two_servers_on_one_shared_engine_get_what_an_engine_of_their_own_gives(
    shared_engine: SharedEngineUnderTest, tiny_exported_dir: Path
) -> None:
    own = ModelProcess(settings(tiny_exported_dir, SLOTS))
    alone = own.start_engine(LIMITS, None, None, 0.0, 0)
    try:
        alone.warmup()
        expected = translate(alone)
    finally:
        alone.stop(5)
    assert isinstance(expected.final, RequestDone) and len(expected.sentences) == len(SOURCE)
    first, second = shared_engine.attach(), shared_engine.attach()
    answers: list[Outcomes] = [Outcomes() for _ in range(6)]
    for index, outcome in enumerate(answers):  # both servers' calls in the engine at once
        (first if index % 2 else second).submit(SOURCE, GREEDY, outcome)
    for outcome in answers:
        assert isinstance(outcome.wait(), RequestDone) and outcome.sentences == expected.sentences
    wait_until(lambda: first.load == 0 and second.load == 0, 10)  # each saw the engine empty again


def test_a_server_that_leaves_frees_what_it_held_and_the_other_goes_on(shared_engine: SharedEngineUnderTest) -> None:
    leaving, staying = shared_engine.attach(), shared_engine.attach()
    held = Outcomes()
    leaving.submit(SOURCE * 40, LONG, held)  # 120 sentences over 4 slots: still decoding when it leaves
    wait_until(lambda: staying.load > 0, 10)  # the other server sees the shared queue
    leaving.stop(0)
    final = held.wait(10)
    assert isinstance(final, RequestFailed) and final.reason == FailureReason.UNAVAILABLE
    wait_until(lambda: staying.load == 0, 10)  # the engine dropped the sentences nobody waits for
    assert isinstance(translate(staying).final, RequestDone)
    assert shared_engine.failures == []


def test_a_connection_without_the_parents_key_is_refused(shared_engine: SharedEngineUnderTest) -> None:
    with pytest.raises(AuthenticationError):
        Client(shared_engine.socket, family="AF_UNIX", authkey=b"not the parent's key")
    assert isinstance(translate(shared_engine.attach()).final, RequestDone)


def test_a_shared_engine_that_dies_fails_every_servers_calls_unavailable(shared_engine: SharedEngineUnderTest) -> None:
    first, second = shared_engine.attach(), shared_engine.attach()
    calls = [Outcomes(), Outcomes()]
    first.submit(SOURCE * 40, LONG, calls[0])
    second.submit(SOURCE * 40, LONG, calls[1])
    wait_until(lambda: first.load > 0 and second.load > 0, 10)
    pid = shared_engine.process.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    for outcome in calls:
        final = outcome.wait(10)
        assert isinstance(final, RequestFailed) and final.reason == FailureReason.UNAVAILABLE
    wait_until(lambda: sorted(shared_engine.failures) == [0, 1], 10)  # each server is told, and stops serving
    assert first.failed and second.failed


def test_servers_share_the_parents_engines_and_drain_on_sigterm(tiny_exported_dir: Path, tmp_path: Path) -> None:
    """Served: the engines are the parent's children, not the servers'; both servers' calls reach them, the
    slots are counted once, the engines' process series are the parent's; SIGTERM answers every call held."""
    with replicas(tiny_exported_dir, tmp_path) as served:
        servers = served.children()
        engines = [int(pid) for pid in re.findall(r"\(pid (\d+)\) listens at", served.log.read_text())]
        assert len(servers) == 4 and len(engines) == 2 and set(engines) <= set(servers)  # all four the parent's
        fronts = [pid for pid in servers if pid not in engines]
        assert not [pid for front in fronts for pid in _children(front) if b"spawn_main" in _cmdline(pid)]
        assert served.metric("translation_max_slots") == 2 * MAX_SLOTS  # two engines, not two per server
        codes = asyncio.run(translate_over(served.address, channels=16, calls=40))  # all on one server: 2^-15
        assert codes == [grpc.StatusCode.OK] * 40
        wait_until(lambda: served.metric("translation_sentences_total") == 40 * len(TEXTS), 10)
        wait_until(lambda: served.metric("translation_active_slots") == 0, 10)
        name = tiny_exported_dir.resolve().name
        labels = served.processes("translation_child_process_resident_memory_bytes")
        assert {f"engine-{name}#0", f"engine-{name}#1"} <= labels  # read by the parent, once each

        async def calls_then_sigterm() -> list[grpc.StatusCode]:
            in_flight = asyncio.ensure_future(
                translate_over(served.address, channels=8, calls=DRAIN_CALLS, max_output_len=64, beam_size=4)
            )
            # SIGTERM once the servers hold every call (test_replicas: a call still on its way is refused)
            await asyncio.to_thread(wait_until, lambda: received() >= DRAIN_CALLS, 60)
            served.process.send_signal(signal.SIGTERM)
            return await in_flight

        def received() -> float:
            answered = served.metric("translation_requests_total", method="Translate") - 40
            return served.metric("translation_requests_in_flight", method="Translate") + answered

        codes = asyncio.run(calls_then_sigterm())
        assert served.process.wait(60) == 0
        assert codes == [grpc.StatusCode.OK] * DRAIN_CALLS  # every call held at the signal was answered
        wait_until(lambda: not any(_cmdline(pid) for pid in servers), 10)
        assert not any(Path(p).exists() for p in re.findall(r"listens at (\S+)", served.log.read_text()))


def test_a_server_process_that_dies_leaves_the_engines_and_its_restart_reconnects(
    tiny_exported_dir: Path, tmp_path: Path
) -> None:
    with replicas(tiny_exported_dir, tmp_path) as served:
        engines = {int(pid) for pid in re.findall(r"\(pid (\d+)\) listens at", served.log.read_text())}
        killed = next(pid for pid in served.children() if pid not in engines)
        held = asyncio.run(_calls_until_killed(served.address, killed))
        assert set(held) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}  # never INTERNAL
        # its requests left the engines with it: the slots free again, the engines go on
        wait_until(lambda: served.metric("translation_active_slots") == 0, 30)
        wait_until(lambda: len(SERVING.findall(served.log.read_text())) == 3, 120)  # one more: the restart's
        assert engines <= set(served.children())  # the same engines
        assert asyncio.run(translate_over(served.address, channels=8, calls=16)) == [grpc.StatusCode.OK] * 16
        assert "while serving: starting it again" in served.log.read_text()


async def _calls_until_killed(address: str, pid: int) -> list[grpc.StatusCode]:
    """Long calls over many connections, one server process killed (SIGKILL) while they decode."""
    in_flight = asyncio.ensure_future(translate_over(address, channels=8, calls=16, max_output_len=64, beam_size=4))
    await asyncio.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    return await in_flight


def test_a_shared_engine_that_dies_is_started_again_and_the_servers_attach_to_it(
    tiny_exported_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL to a shared engine: the parent starts it again at the same socket, the server processes that ended
    with it are started again (without counting against the budget: the engine's restart counted) and attach to
    it, and every call then succeeds; none ever ends INTERNAL."""
    with replicas(tiny_exported_dir, tmp_path) as served:
        first, other = _engine_pids(served.log.read_text())
        servers = set(served.children()) - {first, other}
        held = asyncio.run(_calls_until_killed(served.address, first))
        assert set(held) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
        wait_until(lambda: len(_engine_pids(served.log.read_text())) == 3, 120)
        restarted = _engine_pids(served.log.read_text())[2]
        log = served.log.read_text()
        assert re.search(r"shared engine engine-\S+#0 ended \(killed by signal 9\): starting it again", log)
        sockets = re.findall(r"engine-\S+#0 \(pid \d+\) listens at (\S+)", log)
        assert len(sockets) == 2 and sockets[0] == sockets[1]  # the same socket, which the servers know
        wait_until(lambda: len(SERVING.findall(served.log.read_text())) == 4, 120)  # both servers, twice
        assert not pid_alive(first) and pid_alive(other) and pid_alive(restarted)
        assert servers and not servers & set(served.children())  # the servers ended with their engine, started again
        assert "ended with its shared engine: starting it again" in served.log.read_text()
        assert asyncio.run(translate_over(served.address, channels=8, calls=16)) == [grpc.StatusCode.OK] * 16
        assert served.process.poll() is None


def test_shared_engines_that_keep_dying_stop_the_server_with_the_reason(
    tiny_exported_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine killed again and again: its restarts count against the budget (RESTART_LIMIT), and past it the
    parent stops every server process and exits 1 with the reason."""
    from server.edge.replicas import RESTART_LIMIT

    with replicas(tiny_exported_dir, tmp_path) as served:

        def engines_started() -> int:
            return len(_engine_pids(served.log.read_text()))

        def servers_serving() -> int:
            return len(SERVING.findall(served.log.read_text()))

        for killed in range(RESTART_LIMIT + 1):
            wait_until(lambda: engines_started() == killed + 2, 120)  # noqa: B023  (waited for within the iteration)
            os.kill(_engine_pids(served.log.read_text())[-1], signal.SIGKILL)  # engine #0, the last started
            if killed < RESTART_LIMIT:  # each restart serves before the next kill: both servers again
                wait_until(lambda: servers_serving() == 2 * (killed + 2), 120)  # noqa: B023
        assert served.process.wait(120) == 1
        log = served.log.read_text()
        assert log.count("starting it again") >= RESTART_LIMIT
        ended = rf"shared engine engine-\S+#\d ended \(killed by signal 9\): stopping the server after {RESTART_LIMIT}"
        assert re.search(ended + r" restarts in \d+ s", log)
        wait_until(lambda: not any(pid_alive(pid) for pid in _engine_pids(log)), 10)


def test_a_hub_model_is_built_by_the_parent_and_served_by_every_server_process(tmp_path: Path) -> None:
    """`--model ID` with `--processes`: the parent resolves and builds it once (network blocked, offline cache);
    the server processes attach to its engine and serve it under its id and commit."""
    hub = hub_cache(tmp_path / "hub", tiny_marian(tmp_path / "marian" / "opus-mt-de-en"))
    port, metrics_port = free_port(), free_port()
    log = tmp_path / "server.log"
    command = [
        sys.executable, "-c", BLOCKED + "from server.edge.main import main; main()", "--processes", "2",
        "--engines", "1", "--provider", "cpu", "--model", REPO, "--cache-dir",
        str(tmp_path / "cache"), "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
        "--shutdown-delay-seconds", "0.2",
    ]  # fmt: skip
    with log.open("w") as sink:
        process = subprocess.Popen(command, env=hub_env(hub), cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: process.poll() is not None or len(SERVING.findall(log.read_text())) == 2, 240)
        assert process.poll() is None, log.read_text()[-3000:]
        assert log.read_text().count("listens at") == 1  # one engine, built and opened by the parent alone
        for _ in range(4):  # new connections: the kernel hands them to either server process
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.TranslatorStub(channel)
                (info,) = stub.ListModels(pb.ListModelsRequest(), timeout=30).models
                assert (info.name, info.revision) == (REPO, SHA)
                reply = stub.Translate(request(["Das Haus ist groß."], model=REPO), timeout=60)
                assert len(reply.results) == 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
