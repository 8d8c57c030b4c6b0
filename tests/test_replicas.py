"""`translate-server --processes N`: front processes sharing one port over the parent's engine processes, on the
tiny exported model: metrics summed over the processes, SIGTERM draining every process without losing a call,
no process left behind, and startup failures stopping everything loudly. A front or an engine that dies, and
what the engines do for the fronts: tests/test_shared_engines.py."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import open_channels
from bench.run import free_port
from model.files import CONFIG_FILE, WEIGHTS_FILE
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc
from tests.serving import ROOT, health_status, request, wait_until

SERVING = re.compile(r" serving \S+ \(")  # the line a server process logs once its model is warm

MAX_SLOTS = 8
TEXTS = ["Ich habe keine Zeit.", "Wo ist der Bahnhof?", "Das Haus ist groß.", "Guten Morgen."]
DRAIN_CALLS = 48  # the calls the servers hold when SIGTERM arrives


@dataclass(frozen=True)
class Served:
    process: subprocess.Popen[str]
    address: str
    metrics_url: str
    log: Path

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples `name` whose labels include `labels`, as the parent serves them."""
        try:
            text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        except OSError:
            return -1.0
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    def processes(self, name: str) -> set[str]:
        """The `process` labels of the samples `name` the parent serves (its children's series)."""
        text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        families = text_string_to_metric_families(text)
        return {s.labels["process"] for f in families for s in f.samples if s.name == name and "process" in s.labels}

    def children(self) -> list[int]:
        """The front and engine processes (not multiprocessing's resource tracker beside them)."""
        return [pid for pid in _children(self.process.pid) if b"spawn_main" in _cmdline(pid)]

    def fronts(self) -> list[int]:
        """The front processes: the children but the engines."""
        engines = set(_engine_pids(self.log.read_text()))
        return [pid for pid in self.children() if pid not in engines]


def _engine_pids(log: str) -> list[int]:
    """Every engine the parent started so far, in the order it did, from its log."""
    return [int(pid) for pid in re.findall(r"\(pid (\d+)\) listens at", log)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it has just exited
        return b""


@contextmanager
def replicas(model_dir: Path, tmp_path: Path, *flags: str) -> Iterator[Served]:
    """`translate-server --processes 2 --engines 2` on loopback, once both fronts serve (the two engines' slots
    counted, and each front has logged that it serves its model on both)."""
    port, metrics_port = free_port(), free_port()
    log = tmp_path / "server.log"
    command = [
        sys.executable, "-m", "server.edge.main", "--processes", "2", "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", str(metrics_port), "--model-dir", str(model_dir), "--variant", "fp32",
        "--max-slots", str(MAX_SLOTS), "--shutdown-delay-seconds", "0.2", "--engines", "2", *flags,
    ]  # fmt: skip
    with log.open("w") as sink:
        # its own process group, as systemd or supervisord start it: a test may signal the whole group
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True
        )
    served = Served(process, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", log)
    started = re.compile(r"server\.edge\.server: serving .*, 2 engines\)")
    try:
        # both processes serving, not only loaded: one killed while still starting stops the whole server
        wait_until(lambda: process.poll() is not None or served.metric("translation_max_slots") == 2 * MAX_SLOTS, 120)
        wait_until(
            lambda: process.poll() is not None or len(started.findall(log.read_text())) == 2,
            120,
        )
        assert process.poll() is None, log.read_text()[-3000:]
        yield served
    finally:
        if process.poll() is None:
            process.kill()  # its server processes follow it (they ask for SIGTERM when their parent dies)
        process.wait(30)


async def translate_over(address: str, channels: int, calls: int, **options: int) -> list[grpc.StatusCode]:
    """`calls` Translate calls spread over `channels` connections at once; each call's status."""
    opened = open_channels(address, channels)
    stubs = [pb_grpc.TranslatorStub(channel) for channel in opened]

    async def one(index: int) -> grpc.StatusCode:
        try:
            reply = await stubs[index % channels].Translate(request(TEXTS, "de", "en", **options), timeout=60)
        except grpc.aio.AioRpcError as err:
            return err.code()
        assert len(reply.results) == len(TEXTS) and all(r.translation for r in reply.results)
        return grpc.StatusCode.OK

    try:
        return list(await asyncio.gather(*(one(i) for i in range(calls))))
    finally:
        await asyncio.gather(*(channel.close(None) for channel in opened))


def test_processes_share_the_port_and_their_metrics_are_summed(tiny_exported_dir: Path, tmp_path: Path) -> None:
    with replicas(tiny_exported_dir, tmp_path) as served:
        assert len(served.fronts()) == 2 and len(served.children()) == 4
        assert served.metric("translation_model_info", variant="fp32") == 1  # the same model in both: one series
        codes = asyncio.run(translate_over(served.address, channels=16, calls=40))  # all on one process: 2^-15
        assert codes == [grpc.StatusCode.OK] * 40
        wait_until(lambda: served.metric("translation_requests_total", code="OK", method="Translate") == 40, 10)
        assert served.metric("translation_sentences_total") == 40 * len(TEXTS)
        # The engine publishes its load after it delivers the last events: a moment after the answers.
        wait_until(lambda: served.metric("translation_active_slots") == 0, 10)
        per_process = {pid: requests_served_by(pid) for pid in served.fronts()}
        assert sum(per_process.values()) == 40 and all(per_process.values()), per_process  # both served
        # Each front's own series, labelled: its process (read by the parent) and its GC (reported)
        both = {"server-0", "server-1"}
        assert both <= served.processes("translation_child_process_resident_memory_bytes")
        wait_until(lambda: both <= served.processes("translation_child_python_gc_collections_total"), 10)


def requests_served_by(pid: int) -> float:
    """OK Translate calls one server process counted, from its own file in the multiprocess metrics dir."""
    from prometheus_client.multiprocess import MultiProcessCollector

    environ = dict(
        entry.split(b"=", 1) for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in entry
    )
    (counters,) = Path(environ[b"PROMETHEUS_MULTIPROC_DIR"].decode()).glob(f"counter_{pid}.db")
    return sum(
        sample.value
        for family in MultiProcessCollector.merge([str(counters)], accumulate=True)
        for sample in family.samples
        if sample.name == "translation_requests_total" and sample.labels.get("method") == "Translate"
    )


def _children(pid: int) -> list[int]:
    """Every child of `pid`, whichever of its threads started it (servers spawn engines from worker threads)."""
    pids = []
    for tasks in Path(f"/proc/{pid}/task").glob("*/children"):
        with suppress(OSError):  # the thread has just ended
            pids += [int(child) for child in tasks.read_text().split()]
    return pids


@pytest.mark.parametrize("to_group", [False, True], ids=["to-the-parent", "to-the-process-group"])
def test_sigterm_drains_every_process_and_no_call_is_lost(
    tiny_exported_dir: Path, tmp_path: Path, to_group: bool
) -> None:
    """SIGTERM to the parent, or to every process of its group at once (systemd's default KillMode, `timeout`,
    supervisord's stopasgroup): the engine processes among them wait for the fronts to drain and the parent
    to stop them."""
    with replicas(tiny_exported_dir, tmp_path, "--drain-seconds", "30") as served:

        async def calls_then_sigterm() -> list[grpc.StatusCode]:
            in_flight = asyncio.ensure_future(
                translate_over(served.address, channels=8, calls=DRAIN_CALLS, max_output_len=64, beam_size=4)
            )
            # SIGTERM once the servers hold every call (in flight, or already answered): a call still on
            # its way when the signal lands is rightly refused UNAVAILABLE, and is not what this tests
            wait = time.monotonic() + 60
            while (held := await asyncio.to_thread(received)) < DRAIN_CALLS and time.monotonic() < wait:
                await asyncio.sleep(0.01)
            assert held >= DRAIN_CALLS, f"the servers received {held} of {DRAIN_CALLS} calls"
            if to_group:
                os.killpg(served.process.pid, signal.SIGTERM)
            else:
                served.process.send_signal(signal.SIGTERM)
            return await in_flight

        def received() -> float:
            answered = served.metric("translation_requests_total", method="Translate")
            return served.metric("translation_requests_in_flight", method="Translate") + answered

        codes = asyncio.run(calls_then_sigterm())
        assert served.process.wait(60) == 0
        assert codes == [grpc.StatusCode.OK] * DRAIN_CALLS  # every call received before the signal was answered
        assert served.children() == []
        assert "stopping 2 server process(es)" in served.log.read_text()


def test_server_processes_stop_when_their_parent_is_killed(tiny_exported_dir: Path, tmp_path: Path) -> None:
    """SIGKILL leaves the parent no time to stop them: the fronts ask Linux for SIGTERM on its death and drain,
    the engines exit."""
    with replicas(tiny_exported_dir, tmp_path) as served:
        children = served.children()
        assert len(children) == 4 and len(served.fronts()) == 2  # two fronts, two engines
        served.process.kill()
        assert served.process.wait(10) == -signal.SIGKILL
        wait_until(lambda: not any(_cmdline(pid) for pid in children), 60)  # each one ends, none is left


def test_a_model_that_cannot_load_stops_the_server_with_the_reason(tmp_path: Path) -> None:
    """The parent starts the engines before any front: a model none can load is one line, status 1."""
    broken = tmp_path / "broken"  # a model directory by its files, whose model no engine can load
    broken.mkdir()
    (broken / CONFIG_FILE).write_text("not a config")
    (broken / WEIGHTS_FILE).write_bytes(b"not weights")
    port = free_port()
    command = [
        sys.executable, "-m", "server.edge.main", "--processes", "2", "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", "-1", "--model-dir", str(broken),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith(f"translate-server: building the graphs of {broken} failed")


def replicas_refused(port: int, model_dir: Path) -> subprocess.CompletedProcess[str]:
    """`--processes 2` on `port` serving `model_dir`, run until it exits."""
    command = [
        sys.executable, "-m", "server.edge.main", "--processes", "2", "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", "-1", "--model-dir", str(model_dir),
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_a_missing_model_directory_is_refused_in_one_line_with_status_2_as_by_a_single_server(tmp_path: Path) -> None:
    """Broken before: every server process failed on its own, and the parent exited 1 after their logs."""
    done = replicas_refused(free_port(), tmp_path / "missing")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines() == [f"translate-server: model directory {tmp_path / 'missing'} does not exist"]


def test_a_port_another_server_holds_is_refused_in_one_line_with_status_2(tiny_exported_dir: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = replicas_refused(port, tiny_exported_dir)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines() == [
        f"translate-server: could not bind 127.0.0.1:{port}: the port is in use (another server?)"
    ]


@pytest.mark.parametrize("argv", [["--processes", "0"], ["--processes", "2", "--port", "0"]])
def test_processes_need_one_or_more_and_a_fixed_port(argv: list[str]) -> None:
    from server.edge.flags import parse_config

    with pytest.raises(ValueError, match="processes"):
        parse_config(argv, {})


@dataclass
class _ExitedProcess:
    """What the supervisor reads of a server process that has exited."""

    pid: int
    exitcode: int = 1

    def join(self) -> None:
        pass


class _Served:
    def __init__(self, serving: bool) -> None:
        self._serving = serving

    def is_set(self) -> bool:
        return self._serving


def test_a_process_dying_again_and_again_stops_the_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Up to RESTART_LIMIT restarts within the window, then the parent gives up (exit 1) rather than loop."""
    from server.edge import replicas as module
    from server.edge.config import ServerConfig

    supervisor = module.Supervisor(ServerConfig(), str(tmp_path))
    started: list[int] = []

    def start(index: int) -> str:
        started.append(index)
        return f"server {index}"

    monkeypatch.setattr(supervisor, "start", start)
    running: dict[int, object] = {}
    for attempt in range(module.RESTART_LIMIT + 1):
        dead = module.ServerProcess(0, _ExitedProcess(1000 + attempt), _Served(True), _Served(False))  # type: ignore[arg-type]
        supervisor.ended(dead, running)  # type: ignore[arg-type]
    assert started == [0] * module.RESTART_LIMIT
    assert supervisor.stopping.is_set() and supervisor.failure is not None and "died 4 times" in supervisor.failure


def test_a_server_process_binds_the_shared_port_only_once_it_can_serve(tiny_model_dir: Path) -> None:
    """A server process of --processes (the port shared with SO_REUSEPORT) loads first and binds after: the kernel
    hands new connections to bound sockets alone, so while one (re)starts its siblings take them. (Broken once on
    purpose, bound first: a restarted process answered its share of new connections UNAVAILABLE "still loading"
    for as long as its models took.)"""
    port = free_port()
    command = [sys.executable, "-m", "tests.serving", "--tokenizer-dir", str(tiny_model_dir), "--reuse-port"]
    command += ["--step-delay", "2", "--port", str(port)]  # its warm-up steps take 2 s each
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        time.sleep(1.5)
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # still warming up: nothing listens
        assert process.stderr is not None
        for line in process.stderr:
            if "gRPC on" in line:
                break
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert health_status(channel) == "SERVING"  # bound once serving, never before
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
