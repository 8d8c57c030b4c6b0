"""A real Translator server on an ephemeral loopback port, for tests that call it over gRPC.

The server runs on its own asyncio loop in a background thread, exactly as `translate-server` runs
it; tests talk to it with ordinary synchronous stubs. Models: the tiny ONNX export (the real runtime)
or the deterministic `tests.fakes.FakeRunner` behind the tiny tokenizer, optionally throttled or
gated so that queueing, deadlines and draining can be provoked on purpose.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from model.tokenizer import TOKENIZER_FILE, Tokenizer
from server.core.runner import Candidates, EncodeItem, ModelSpec, RowBias, Runner
from server.edge.config import EnginesConfig, ModelsConfig, ObservabilityConfig, ServerConfig, ServingConfig
from server.edge.convert import ModelDescription
from server.edge.loading import LoadedModel, load_model
from server.edge.server import TranslationServer, create_server
from server.processes.engine_process import ModelProcess, SharedModel
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc
from tests.fakes import FAKE_SPEC, FakeRunner

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0
# Test servers bind the IPv4 loopback alone: "localhost" binds ::1 and 127.0.0.1 on one ephemeral port, and
# where another socket holds that port on 127.0.0.1 grpc binds ::1 only, so a client could reach the other.
TEST_HOST = "127.0.0.1"
# The engines of a test that loads a tiny export: fp32 graphs on the CPU, eight slots, one intra-op thread each.
FP32_ON_CPU = EnginesConfig(variant="fp32", provider="cpu", max_slots=8, threads=1)
FAKE_DESCRIPTION = ModelDescription(
    name="fake", variant="fp32", available_variants=["fp32"], provider="fake", opset=18, model_sha256="0" * 64,
    dtype="float32",
)  # fmt: skip


class GatedRunner:
    """Wraps a runner: every `step` first waits for `gate` (open by default) and then sleeps `delay` s.

    Closing the gate holds the engine mid-request, so tests can fill the queue, let a deadline pass,
    cancel, or start a drain while work is provably in flight.
    """

    def __init__(self, inner: Runner, delay: float = 0.0) -> None:
        self.inner = inner
        self.spec: ModelSpec = inner.spec
        self.max_slots = inner.max_slots
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.steps_waiting = threading.Semaphore(0)  # released once per step that reached the gate

    def close_gate(self) -> None:
        """Hold every later step at the gate; forget steps counted before (warmup)."""
        self.gate.clear()
        self.steps_waiting = threading.Semaphore(0)

    def wait_for_step(self, timeout: float = START_TIMEOUT_S) -> None:
        """Block until a step has reached the gate: some request is provably decoding."""
        if not self.steps_waiting.acquire(timeout=timeout):
            raise TimeoutError("no step reached the gate")

    def encode(self, items: list[EncodeItem]) -> None:
        self.inner.encode(items)

    def step(
        self, slots: list[int], tokens: list[int], positions: list[int], row_scores: list[float], k: int,
        bias: RowBias | None = None,
    ) -> Candidates:  # fmt: skip
        self.steps_waiting.release()
        if not self.gate.wait(START_TIMEOUT_S):
            raise TimeoutError("the test never opened the gate")
        if self.delay:
            time.sleep(self.delay)
        return self.inner.step(slots, tokens, positions, row_scores, k, bias)

    def copy_slots(self, sources: list[int], destinations: list[int]) -> None:
        self.inner.copy_slots(sources, destinations)


class EngineKilled(BaseException):
    """Past the engine's recovery (it catches Exception): its loop dies, as on a fault it cannot survive."""


class KillableRunner(GatedRunner):
    """A GatedRunner whose steps raise EngineKilled once `kill` is set (from a signal handler, say)."""

    def __init__(self, inner: Runner, delay: float = 0.0) -> None:
        super().__init__(inner, delay)
        self.kill = threading.Event()

    def step(
        self, slots: list[int], tokens: list[int], positions: list[int], row_scores: list[float], k: int,
        bias: RowBias | None = None,
    ) -> Candidates:  # fmt: skip
        if self.kill.is_set():
            raise EngineKilled("the test killed the engine")
        return super().step(slots, tokens, positions, row_scores, k, bias)


def fake_model(
    tokenizer_dir: Path, max_slots: int = 8, max_source_len: int = 48, max_target_len: int = 12
) -> LoadedModel:
    """FakeRunner (pure numpy, deterministic per source) behind the tiny model's real tokenizer."""
    tokenizer = Tokenizer(tokenizer_dir / TOKENIZER_FILE)
    spec = replace(
        FAKE_SPEC,
        vocab_size=tokenizer.vocab_size,
        source_vocab_size=tokenizer.vocab_size,
        max_source_len=max_source_len,
        max_target_len=max_target_len,
        tag_ids=tokenizer.tag_ids,
    )
    return LoadedModel(FakeRunner(max_slots, spec), tokenizer, FAKE_DESCRIPTION)


def export_tiny_onnx(model_dir: Path) -> Path:
    """Export the fp32 ONNX graphs of a model artifact (once; reused when present)."""
    variant_dir = model_dir / "onnx" / "fp32"
    if not (variant_dir / "metadata.json").is_file():
        command = [sys.executable, "-m", "export", "--model-dir", str(model_dir), "--variants", "fp32"]
        subprocess.run(command, check=True, capture_output=True, timeout=600)
    return variant_dir


def runner_of(model: LoadedModel) -> Runner:
    """The model's runner, which tests that wrap or drive it directly open in the server's own process."""
    assert not isinstance(model.runner, ModelProcess | SharedModel), "this test needs the runner in its own process"
    return model.runner


def onnx_model(model_dir: Path, max_slots: int = 8, kv_cache: str = "auto") -> LoadedModel:
    """The real runtime (onnxruntime on CPU) over an exported model directory, in this process (the test drives
    or wraps it); the caches where the server's default puts them (`auto`: the working batch on CPU) unless
    `kv_cache` names another place."""
    config = ServerConfig(
        models=ModelsConfig(model_dirs=(model_dir,)),
        engines=EnginesConfig(variant="fp32", provider="cpu", max_slots=max_slots, threads=1, kv_cache=kv_cache),
    )
    return load_model(config, model_dir, in_process=True)


@dataclass
class RunningServer:
    """A started server, its loop thread and a channel to it."""

    server: TranslationServer
    port: int
    loop: asyncio.AbstractEventLoop
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.address)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def stub(self) -> pb_grpc.TranslatorStub:
        return pb_grpc.TranslatorStub(self.channel)

    @property
    def registry(self) -> CollectorRegistry:
        return self.server.registry

    def run(self, coroutine: Awaitable[T], timeout: float = START_TIMEOUT_S) -> T:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(_awaited(coroutine), self.loop).result(timeout)

    def start(self, coroutine: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Start a coroutine on the server's loop without waiting for it (e.g. a shutdown)."""
        return asyncio.run_coroutine_threadsafe(_awaited(coroutine), self.loop)


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


@contextmanager
def server_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An asyncio loop running in a daemon thread until the context exits."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server-loop", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(START_TIMEOUT_S)
        loop.close()


@contextmanager
def running_server(
    model: LoadedModel | list[LoadedModel], config: ServerConfig | None = None
) -> Iterator[RunningServer]:
    """A loaded, SERVING server (of one model or several) on an ephemeral port; shut down (no grace) when the
    context exits."""
    config = config or server_config()
    with server_loop() as loop:
        future = asyncio.run_coroutine_threadsafe(create_server(config, model, CollectorRegistry()), loop)
        server, port = future.result(START_TIMEOUT_S)
        running = RunningServer(server, port, loop)
        try:
            yield running
        finally:
            running.channel.close()
            for each in model if isinstance(model, list) else [model]:
                if isinstance(each.runner, GatedRunner):
                    each.runner.gate.set()
            running.run(server.shutdown(0.0))


def loopback(**overrides: Any) -> ServingConfig:
    """A test server's serving: an ephemeral port on the IPv4 loopback, with `overrides`."""
    return ServingConfig(**{"port": 0, "host": TEST_HOST, **overrides})


def server_config(**groups: Any) -> ServerConfig:
    """A test server's config: `loopback()` serving, no metrics HTTP server; each group given replaces its
    default (a `serving` given should start from `loopback`)."""
    defaults = {"serving": loopback(), "observability": ObservabilityConfig(metrics_port=-1)}
    return ServerConfig(**{**defaults, **groups})


def request(texts: list[str], source: str = "de", target: str = "en", **options: Any) -> pb.TranslateRequest:
    return pb.TranslateRequest(
        texts=texts, options=pb.TranslationOptions(source_language=source, target_language=target, **options)
    )


def sample_value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels` (a server's series also carry `model`);
    0 when there is none yet."""
    return sum(
        sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


@dataclass(frozen=True)
class Status:
    code: grpc.StatusCode
    details: str


def status_of(call: Callable[[], object]) -> Status:
    """The status a call fails with (it must fail)."""
    try:
        call()
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call), "stub errors carry their status"
        return Status(error.code(), error.details() or "")
    raise AssertionError("the call succeeded; it was expected to fail")


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)


def health_status(channel: grpc.Channel, service: str = "") -> str:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@contextmanager
def server_process(tokenizer_dir: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`main()` in its own process (real signal handling) with the server `flags`; yields it and its address."""
    command = [sys.executable, "-m", "tests.serving", "--tokenizer-dir", str(tokenizer_dir), *flags]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert process.stderr is not None
        address = ""
        for line in process.stderr:
            if match := re.search(r"gRPC on (\S+):(\d+)", line):
                address = f"{match.group(1)}:{match.group(2)}"
            if "serving" in line and address:
                break
        assert address, "the server never logged its address"
        yield process, address
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def main() -> None:
    """`python -m tests.serving --tokenizer-dir DIR [server flags]`: `serve()` a slowed FakeRunner, for
    process-level tests. Other flags are the server's own (`--max-queue 8`); it binds an ephemeral
    loopback port, serves no metrics, drains for 30 s and keeps the port open 1 s after a signal
    unless they say otherwise.

    SIGUSR1 makes the next decoder step kill the engine's loop.
    """
    import argparse
    import logging
    import signal

    from server.edge.flags import parse_config
    from server.edge.server import run

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--step-delay", type=float, default=0.05, help="seconds added to every decoder step")
    parser.add_argument("--reuse-port", action="store_true", help="serve as a server process of --processes does")
    args, server_flags = parser.parse_known_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    base = fake_model(args.tokenizer_dir)
    runner = KillableRunner(runner_of(base), args.step_delay)
    signal.signal(signal.SIGUSR1, lambda *_: runner.kill.set())  # the next decoder step kills the engine's loop
    model = LoadedModel(runner, base.tokenizer, base.description)
    defaults = ["--port", "0", "--host", TEST_HOST, "--metrics-port", "-1", "--drain-seconds", "30"]
    defaults += ["--shutdown-delay-seconds", "1"]
    config = parse_config([*defaults, *server_flags], {})  # the later flag wins
    run(replace(config, serving=replace(config.serving, reuse_port=args.reuse_port)), model)


if __name__ == "__main__":
    main()
