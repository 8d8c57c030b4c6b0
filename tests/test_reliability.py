"""Overload, faults and lifecycle against a real server on loopback (docs/reliability.md lists each guarantee).

Queue-full, deadline, cancel, drain, signals and a failing single-request batch are proven in
test_servicer.py and test_engine.py; this file covers what they do not: refusing exactly the excess
at once, a client process that dies mid-request, fault isolation inside one batch, a dead engine
loop, and startup that fails loudly.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import grpc
import numpy as np
import numpy.typing as npt
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model.tokenizer import TextTokenizer
from server.client.channels import CLIENT_SERVICE_CONFIG, open_channel
from server.core.engine import Engine
from server.core.events import EngineLimits, Event, FailureReason, RequestDone, RequestFailed, SentenceDone
from server.core.runner import Candidates, RowBias
from server.core.scheduler import Scheduler
from server.core.work import DecodeOptions
from server.edge import servicer as servicer_module
from server.edge.config import EnginesConfig
from server.edge.errors import DRAINING_MESSAGE, QUEUE_FULL_MESSAGE
from server.edge.loading import LoadedModel, StartupError
from server.edge.server import MIN_STOP_GRACE_S, SERVICE_NAME, create_server
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc
from server.text.documents import prepare_texts
from tests.fakes import FAKE_SPEC, FakeRunner, InjectedFailure, execute, reference_decode
from tests.serving import (
    GatedRunner,
    RunningServer,
    export_tiny_onnx,
    fake_model,
    health_status,
    loopback,
    request,
    runner_of,
    running_server,
    sample_value,
    server_loop,
    server_process,
    status_of,
    wait_until,
)
from tests.serving import (
    server_config as config,
)

ROOT = Path(__file__).resolve().parents[1]
HOUSE, POLICE, CONSOLE = "Das Haus ist groß.", "Geheimpolizei", "Steuerpult"


def gated(tiny_model_dir: Path, max_slots: int, runner: FakeRunner | None = None) -> tuple[LoadedModel, GatedRunner]:
    base = fake_model(tiny_model_dir, max_slots=max_slots)
    gate = GatedRunner(runner if runner is not None else runner_of(base))
    return LoadedModel(gate, base.tokenizer, base.description), gate


def engine_of(served: RunningServer) -> Engine:
    engine = served.server.engine
    assert engine is not None, "a running server has an engine"
    return engine


def wait_submitted(engine: Engine, sentences: int) -> None:
    """Wait until `sentences` sentences reached the engine while its first step is held at the gate.

    Until that step returns nothing is published, so `queue_depth` counts every sentence submitted
    since, the decoding ones included (it may overestimate for one iteration, by design).
    """
    wait_until(lambda: engine.queue_depth == sentences)


def count(served: RunningServer, code: str, method: str = "Translate", lang_pair: str = "de-en") -> float:
    return sample_value(served.registry, "translation_requests_total", method=method, code=code, lang_pair=lang_pair)


def test_overload_refuses_exactly_the_excess_at_once_and_health_stays_quick(tiny_model_dir: Path) -> None:
    max_queue, excess = 4, 5
    model, gate = gated(tiny_model_dir, max_slots=1)
    with running_server(model, config(engines=EnginesConfig(max_slots=1, max_queue=max_queue))) as served:
        engine = engine_of(served)
        gate.close_gate()
        admitted = [served.stub.Translate.future(request([HOUSE], beam_size=1))]
        gate.wait_for_step()  # the engine is frozen mid-step: what follows can only queue
        while (depth := engine.queue_depth) < max_queue:  # the depth the admission check sees
            admitted.append(served.stub.Translate.future(request([POLICE], beam_size=1)))
            wait_until(lambda: engine.queue_depth == depth + 1)
        refused = [served.stub.Translate.future(request([CONSOLE], beam_size=1)) for _ in range(excess)]
        errors = [status_of(lambda f=f: f.result(60)) for f in refused]  # type: ignore[misc]
        assert not any(f.done() for f in admitted), "refusals come at once, while the queue cannot move"
        assert {e.code for e in errors} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert all("queue is full" in e.details for e in errors)
        assert count(served, "RESOURCE_EXHAUSTED") == excess
        assert engine.queue_depth == max_queue, "nothing of a refused request was queued"
        for service in ("", SERVICE_NAME):  # answered while the engine is frozen: health never waits on it
            assert health_status(served.channel, service) == "SERVING"
        gate.gate.set()
        assert [f.result(30).results[0].sentences for f in admitted] == [1] * len(admitted)
        wait_until(lambda: engine.queue_depth == 0 and engine.active_slots == 0)
        assert count(served, "OK") == len(admitted) >= max_queue


BURST = 400  # calls sent at once


@pytest.mark.parametrize("max_queue", [64, EnginesConfig().queue_for("cpu")], ids=["small-queue", "default-queue"])
def test_a_burst_prepares_no_refused_call_and_no_call_twice(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, max_queue: int
) -> None:
    """400 calls of 4 sentences at once against a small queue and the default one (2 slots, 50 ms steps),
    the engine held at a gate until every call has reached the service: admission holds 4 places per call
    before any splitting, so the calls admitted hold at most the queue's places (plus those of the few
    sentences that took the slots before the gate held), and every other call is refused "queue full"
    without its texts ever being split or tokenized; each admitted call is prepared at most once (an OK one
    exactly once) and answered OK or DEADLINE_EXCEEDED, and nothing is left queued. (bench/burst.py
    measures the refusals' latency against no-op calls; docs/reliability.md has its figures.) Broken once
    on purpose (admission holding one place per call, whatever its sentences), calls were refused at
    submit after being split and tokenized."""
    prepared: list[str] = []

    def spy(texts: list[str], *args: Any, **kwargs: Any) -> Any:
        prepared.append(texts[0])
        return prepare_texts(texts, *args, **kwargs)

    monkeypatch.setattr(servicer_module, "prepare_texts", spy)
    model = fake_model(tiny_model_dir, max_slots=2)
    inner = runner_of(model)
    assert isinstance(inner, FakeRunner)
    gated_runner = GatedRunner(inner, delay=0.05)
    slow = LoadedModel(gated_runner, model.tokenizer, model.description)
    with running_server(slow, config(engines=EnginesConfig(max_slots=2, max_queue=max_queue))) as served:
        warm = len(inner.encode_calls)
        gated_runner.close_gate()  # the queue frees no place while the burst arrives
        texts = [f"Das Haus {i} ist groß. Er wartete lange. Sie schrieben ein Buch. Es regnet." for i in range(BURST)]
        futures = [served.stub.Translate.future(request([text], beam_size=1), timeout=2.0) for text in texts]

        def reached() -> float:  # calls the service holds or has answered
            held = sample_value(served.registry, "translation_requests_in_flight", method="Translate")
            return held + sample_value(served.registry, "translation_requests_total", method="Translate")

        wait_until(lambda: reached() == BURST)
        took_slots = sum(len(items) for items in inner.encode_calls[warm:])  # before the gate held
        gated_runner.gate.set()
        answers = [(future.code(), future.details()) for future in futures]
        wait_until(lambda: engine_of(served).queue_depth == 0 and engine_of(served).active_slots == 0)
    refused = grpc.StatusCode.RESOURCE_EXHAUSTED
    admitted = [text for text, (code, _) in zip(texts, answers, strict=True) if code != refused]
    assert took_slots <= 2 and 1 <= len(admitted) <= (max_queue + took_slots) // 4 < BURST
    assert {code for code, _ in answers if code != refused} <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}
    assert all(details == QUEUE_FULL_MESSAGE for code, details in answers if code == refused)
    assert len(prepared) == len(set(prepared)), "no call is prepared twice"
    assert set(prepared) <= set(admitted), "no refused call is ever prepared"
    answered = {text for text, (code, _) in zip(texts, answers, strict=True) if code == grpc.StatusCode.OK}
    assert answered <= set(prepared), "every call answered OK was prepared"  # one whose deadline came first need not


CLIENT = """
import sys, grpc
from server.proto.translation.v1 import translation_pb2 as pb, translation_pb2_grpc as pb_grpc
stub = pb_grpc.TranslatorStub(grpc.insecure_channel(sys.argv[1]))
options = pb.TranslationOptions(source_language="de", target_language="en", beam_size=1)
unary = stub.Translate.future(pb.TranslateRequest(texts=[sys.argv[2]], options=options))
stream = stub.TranslateStream(pb.TranslateRequest(texts=[sys.argv[3]], options=options))
print("sent", flush=True)
unary.result(); list(stream)
"""


def test_a_client_killed_mid_request_leaves_nothing_behind(tiny_model_dir: Path) -> None:
    model, gate = gated(tiny_model_dir, max_slots=1)
    with running_server(model, config(engines=EnginesConfig(max_slots=1))) as served:
        engine = engine_of(served)
        gate.close_gate()
        client = subprocess.Popen(
            [sys.executable, "-c", CLIENT, served.address, HOUSE, POLICE], cwd=ROOT, stdout=subprocess.PIPE
        )
        try:
            gate.wait_for_step(timeout=60)  # one request decodes, held at the gate; the other waits for its slot
            wait_submitted(engine, 2)
        finally:
            client.kill()
            client.wait(30)

        def cancelled() -> float:
            return count(served, "CANCELLED") + count(served, "CANCELLED", method="TranslateStream")

        wait_until(lambda: cancelled() == 2)  # the server saw the connection go and cancelled both calls
        gate.gate.set()
        wait_until(lambda: engine.queue_depth == 0 and engine.active_slots == 0)
        assert sample_value(served.registry, "translation_sentences_total", lang_pair="de-en") == 0
        assert served.stub.Translate(request([CONSOLE], beam_size=1), timeout=30).results[0].sentences == 1


class PoisonRunner(FakeRunner):
    """A FakeRunner that breaks on one token: it raises, returns NaN rows, or ranks a candidate id outside
    the vocabulary (above it, or negative) first, for the rows of that source."""

    BAD_IDS: ClassVar[dict[str, Callable[[int], int]]] = {
        "id_over_vocab": lambda vocab: vocab + 5,
        "negative_id": lambda vocab: -1,
    }

    def __init__(self, max_slots: int, base: FakeRunner, poison: int, fault: str) -> None:
        super().__init__(max_slots, base.spec)
        self.poison, self.fault = poison, fault
        self.faulty_batches: list[int] = []  # distinct sources in each step call that met the poison

    def _poisoned(self, slots: list[int]) -> list[int]:
        return [i for i, s in enumerate(slots) if self.poison in (self.slots[s].source or ())]

    def step(
        self, slots: list[int], tokens: list[int], positions: list[int], row_scores: list[float], k: int,
        bias: RowBias | None = None,
    ) -> Candidates:  # fmt: skip
        candidates = super().step(slots, tokens, positions, row_scores, k, bias)
        if self.fault not in self.BAD_IDS:
            return candidates
        ids = candidates.ids.copy()
        ids[self._poisoned(slots), 0] = self.BAD_IDS[self.fault](self.spec.vocab_size)
        return Candidates(candidates.scores, ids, candidates.bias_scores)

    def step_log_probs(self, slots: list[int], tokens: list[int], positions: list[int]) -> npt.NDArray[np.float32]:
        poisoned = self._poisoned(slots)
        if poisoned:
            self.faulty_batches.append(len({self.slots[s].source for s in slots}))
            if self.fault == "raise":
                raise InjectedFailure("poisoned input")
        rows = super().step_log_probs(slots, tokens, positions)
        if self.fault == "nan":
            rows[poisoned] = np.nan
        return rows


def poison_token(tokenizer: TextTokenizer, bad: str, good: list[str]) -> int:
    """A piece of `bad` that none of `good` contains."""
    clean = {t for text in good for t in tokenizer.encode_source(text, "en")}
    return next(t for t in tokenizer.encode_source(bad, "en") if t not in clean)


@pytest.mark.parametrize("fault", ["raise", "nan", "id_over_vocab", "negative_id"])
def test_a_poisoned_input_fails_only_its_own_request_in_a_shared_batch(tiny_model_dir: Path, fault: str) -> None:
    base = fake_model(tiny_model_dir)
    assert isinstance(base.runner, FakeRunner)
    poison = poison_token(base.tokenizer, POLICE, [HOUSE, CONSOLE])
    runner = PoisonRunner(base.runner.max_slots, base.runner, poison, fault)
    model, gate = gated(tiny_model_dir, max_slots=8, runner=runner)
    with running_server(model, config()) as served:
        engine = engine_of(served)
        gate.close_gate()
        first = served.stub.Translate.future(request([HOUSE], beam_size=2))
        gate.wait_for_step()
        bad = served.stub.Translate.future(request([POLICE], beam_size=2))
        other = served.stub.Translate.future(request([CONSOLE], beam_size=2))
        wait_submitted(engine, 3)
        gate.gate.set()  # the next step holds all three requests' rows
        error = status_of(lambda: bad.result(30))
        assert (error.code, error.details) == (grpc.StatusCode.INTERNAL, "internal error while translating")
        good = [first.result(30).results[0].translation, other.result(30).results[0].translation]
        assert runner.faulty_batches[0] == 3, "the poisoned rows shared a step with both other requests"
        again = served.stub.Translate(request([HOUSE, CONSOLE], beam_size=2), timeout=30)
        assert good == [r.translation for r in again.results], "the survivors' output is exact"
        assert (count(served, "INTERNAL"), count(served, "OK")) == (1, 3)
        wait_until(lambda: engine.queue_depth == 0 and engine.active_slots == 0)


def drive(scheduler: Scheduler, runner: FakeRunner, raises: Callable[[set[int]], bool]) -> IsolationRun:
    """Run the scheduler to idle as the engine does: a runner call that `raises` for its requests is
    handed to `isolate`. Records every call's requests and each request's outcome."""
    run = IsolationRun()
    while not scheduler.idle:
        batch = scheduler.schedule(0.0)
        run.events += batch.events
        ids = batch.request_ids()
        run.calls.append(ids)
        if raises(ids):
            run.failed_calls.append(ids)
            run.events += scheduler.isolate(ids, FailureReason.INTERNAL, "failed")
            continue
        run.events += scheduler.update(batch, execute(runner, batch))
    return run


@dataclass
class IsolationRun:
    calls: list[set[int]] = field(default_factory=list)  # each runner call's request ids
    failed_calls: list[set[int]] = field(default_factory=list)
    events: list[tuple[int, Event]] = field(default_factory=list)

    def hypotheses(self, request_id: int) -> list[tuple[int, ...]]:
        (done,) = [e for r, e in self.events if r == request_id and isinstance(e, SentenceDone)]
        return [h.tokens for h in done.hypotheses]

    def failed(self) -> set[int]:
        return {r for r, e in self.events if isinstance(e, RequestFailed)}


def test_isolate_reruns_a_shared_batch_in_halves_that_never_share_a_call() -> None:
    """The scheduler rule behind the test above: restart in two groups, each runs apart from the other."""
    scheduler = Scheduler(FAKE_SPEC, EngineLimits(max_slots=8))
    runner = FakeRunner(max_slots=8)
    options = DecodeOptions(beam_size=2, num_hypotheses=2)
    sources = {1: [5, 6, 7, 3], 2: [5, 8, 3], 3: [5, 9, 9, 10, 3]}
    for request_id, source in sources.items():
        scheduler.add(request_id, [source], options, None, 0.0)
    first = scheduler.schedule(0.0)
    assert first.request_ids() == {1, 2, 3} and len(first.queue_waits) == 3
    assert scheduler.isolate({1, 2, 3}, FailureReason.INTERNAL, "failed") == []  # nobody fails yet
    assert (scheduler.active_slots, scheduler.queue_depth) == (0, 3)
    run = drive(scheduler, runner, lambda ids: False)
    assert all(ids <= {1} or ids <= {2, 3} for ids in run.calls), "the two groups never share a call"
    assert {2, 3} in run.calls, "a group still runs as a batch"
    for request_id, source in sources.items():
        assert run.hypotheses(request_id) == [h.tokens for h in reference_decode(source, 2, 1.0, 12)][:2]
    scheduler.add(4, [sources[1]], options, None, 0.0)
    scheduler.schedule(0.0)
    events = scheduler.isolate({4}, FailureReason.INTERNAL, "failed")
    assert events == [(4, RequestFailed(FailureReason.INTERNAL, "failed"))], "a request alone is the cause"


@pytest.mark.parametrize("poisoned", [1, 6, 16])
def test_one_bad_request_in_a_full_batch_is_found_by_halving_and_the_rest_stay_batched(poisoned: int) -> None:
    """16 requests share a call that raises for one of them: about log2(16) failed reruns find it, and
    the others finish exactly, in batches: far fewer calls than running them one at a time would take."""
    scheduler = Scheduler(FAKE_SPEC, EngineLimits(max_slots=16))
    runner = FakeRunner(max_slots=16)
    options = DecodeOptions(beam_size=1)
    sources = {r: [5, 6 + r, 7, 3] for r in range(1, 17)}
    for request_id, source in sources.items():
        scheduler.add(request_id, [source], options, None, 0.0)
    run = drive(scheduler, runner, lambda ids: poisoned in ids)
    assert run.failed() == {poisoned}
    assert 4 <= len(run.failed_calls) <= 5  # 16 -> 8 -> 4 -> 2 -> 1 (the last one fails it)
    for request_id, source in sources.items():
        if request_id != poisoned:
            assert run.hypotheses(request_id) == [reference_decode(source, 1, 1.0, 12)[0].tokens]
    serial_calls = sum(len(reference_decode(source, 1, 1.0, 12)[0].tokens) + 1 for source in sources.values())
    assert len(run.calls) < serial_calls / 2, (len(run.calls), serial_calls)
    assert max(len(ids) for ids in run.calls[len(run.failed_calls) + 1 :]) >= 4, "the innocent halves stay batched"


class BrokenRunner(FakeRunner):
    def step_log_probs(self, slots: list[int], tokens: list[int], positions: list[int]) -> npt.NDArray[np.float32]:
        raise InjectedFailure("the device is gone")


def test_a_runner_that_always_fails_fails_every_request_and_none_hangs() -> None:
    runner = BrokenRunner(max_slots=4)
    engine = Engine(runner, EngineLimits(max_slots=4))
    engine.start()
    outcomes: list[Future[Event]] = []
    for seed in range(5):
        outcome: Future[Event] = Future()
        outcomes.append(outcome)

        def deliver(event: Event, outcome: Future[Event] = outcome) -> None:
            if isinstance(event, RequestDone | RequestFailed):
                outcome.set_result(event)

        engine.submit([[5, 6 + seed, 7, 3], [5, 8, 3]], DecodeOptions(beam_size=2), deliver)
    try:
        results = [o.result(30) for o in outcomes]
        assert all(isinstance(r, RequestFailed) and r.message == "internal error while translating" for r in results)
        wait_until(lambda: engine.queue_depth == 0 and engine.active_slots == 0)
    finally:
        engine.stop()


def test_a_dead_engine_loop_turns_not_serving_and_fails_waiting_requests_unavailable(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, gate = gated(tiny_model_dir, max_slots=1)
    with running_server(model, config(engines=EnginesConfig(max_slots=1))) as served:
        engine = engine_of(served)
        gate.close_gate()
        decoding = served.stub.Translate.future(request([HOUSE], beam_size=1))  # no deadline: it would wait forever
        gate.wait_for_step()
        queued = served.stub.Translate.future(request([POLICE], beam_size=1))
        wait_submitted(engine, 2)

        def corrupt(*args: object) -> None:
            raise RuntimeError("scheduler state corrupted")

        monkeypatch.setattr(engine._scheduler, "update", corrupt)  # a bug outside the runner ...
        monkeypatch.setattr(engine._scheduler, "fail", corrupt)  # ... that the loop's recovery cannot survive
        gate.gate.set()
        for call in (decoding, queued):
            error = status_of(lambda c=call: c.result(30))  # type: ignore[misc]
            assert error.code == grpc.StatusCode.UNAVAILABLE
            assert "engine failed" in error.details and "corrupted" not in error.details
        assert engine.failed
        wait_until(lambda: [health_status(served.channel, s) for s in ("", SERVICE_NAME)] == ["NOT_SERVING"] * 2)
        error = status_of(lambda: served.stub.Translate(request([CONSOLE], beam_size=1), timeout=30))
        assert error.code == grpc.StatusCode.UNAVAILABLE and "engine failed" in error.details


def test_a_hung_runner_call_fails_its_requests_and_turns_not_serving(tiny_model_dir: Path) -> None:
    model, gate = gated(tiny_model_dir, max_slots=1)
    with running_server(model, config(engines=EnginesConfig(max_slots=1, stall_seconds=0.5))) as served:
        gate.close_gate()
        try:
            hung = served.stub.Translate.future(request([HOUSE], beam_size=1))  # no deadline: it would wait forever
            gate.wait_for_step()
            error = status_of(lambda: hung.result(30))
            assert error.code == grpc.StatusCode.UNAVAILABLE and "engine failed" in error.details
            wait_until(served.server.engine_died.is_set)  # what makes `serve` exit non-zero (set on the loop, after)
            wait_until(lambda: health_status(served.channel) == "NOT_SERVING")
        finally:
            gate.gate.set()  # release the abandoned thread


def start_server_process(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "server.edge.main", "--host", "localhost", "--metrics-port", "-1", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture()
def broken_model_dirs(tiny_model_dir: Path, tmp_path: Path) -> dict[str, Path]:
    """Model directories a deployment can end up with: absent, empty, torn metadata, corrupt graph."""
    export_tiny_onnx(tiny_model_dir)
    torn = tmp_path / "torn"
    shutil.copytree(tiny_model_dir, torn)
    (torn / "onnx/fp32/metadata.json").write_text('{"variant": "fp3')
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, corrupt)
    (corrupt / "onnx/fp32/decoder_step.onnx").write_bytes(b"\x00not an onnx graph" * 64)
    (tmp_path / "empty").mkdir()
    return {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "torn": torn, "corrupt": corrupt}


@pytest.mark.parametrize("case", ["missing", "empty", "torn", "corrupt"])
def test_startup_without_a_usable_model_fails_loudly(broken_model_dirs: dict[str, Path], case: str) -> None:
    model_dir = broken_model_dirs[case]
    done = start_server_process("--port", "0", "--model-dir", str(model_dir), "--provider", "cpu")
    assert done.returncode != 0
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("translate-server: ") and str(model_dir) in last_line
    assert "Traceback" not in done.stderr, "one clear line, not a stack trace"


def test_a_second_instance_on_the_same_port_fails_loudly(tiny_model_dir: Path) -> None:
    # the first binds as the second will, both loopbacks of "localhost": the second finds each taken
    with running_server(fake_model(tiny_model_dir), config(serving=loopback(host="localhost"))) as first:
        with server_loop() as loop:
            taken = config(serving=loopback(port=first.port))
            second = asyncio.run_coroutine_threadsafe(create_server(taken, fake_model(tiny_model_dir)), loop)
            with pytest.raises(StartupError, match="could not bind"):
                second.result(60)
        done = start_server_process("--port", str(first.port), "--model-dir", str(tiny_model_dir))
        assert done.returncode != 0
        last_line = done.stderr.strip().splitlines()[-1]
        assert last_line.startswith(f"translate-server: could not bind localhost:{first.port}")
        assert first.stub.Translate(request([HOUSE]), timeout=30).results[0].sentences == 1


def test_a_taken_metrics_port_or_a_certificate_that_is_not_pem_ends_in_one_line(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Broken once on purpose (the metrics port tried after gRPC had started), the right line came followed by
    an "Event loop is closed" traceback; a DER or empty certificate was reported as a port another instance held."""
    with socket.socket() as taken:
        taken.bind(("localhost", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = start_server_process("--port", "0", "--model-dir", str(tiny_model_dir), "--metrics-port", str(port))
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"translate-server: could not serve metrics on port {port}")
    (tmp_path / "cert.der").write_bytes(b"0\x82\x01\n")
    (tmp_path / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\n-----END PRIVATE KEY-----\n")
    tls = ["--tls-cert", str(tmp_path / "cert.der"), "--tls-key", str(tmp_path / "key.pem")]
    done = start_server_process("--port", "0", "--model-dir", str(tiny_model_dir), *tls)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "is not PEM" in done.stderr.strip().splitlines()[-1]


SHUTDOWN_REPEATS = int(os.environ.get("SHUTDOWN_REPEATS", "3"))  # the bar: 20 in a row
SHUTDOWN_DELAY_S, DRAIN_S = 1.0, 20.0
SPACED_CALLS, CALLS_AS_SIGTERM_GOES = 50, 10  # calls sent 2 ms apart before SIGTERM; calls sent at once as it goes
# An HTML page of one sentence and about 0.2 s of parsing (98,000 characters of comments): three of them in a
# call keep it in the preparation pool, admitted and not yet submitted, for about a second
PAGE = f"<p>{HOUSE}</p>" + "<!---->" * 14_000


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> Callable[..., float]:
    """One scrape of the server's /metrics: the sum of the samples `name` whose labels include `labels`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        samples = [s for f in text_string_to_metric_families(reply.read().decode()) for s in f.samples]

    def metric(name: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())

    return metric


def test_a_signal_before_serving_exits_without_the_shutdown_delay(tiny_model_dir: Path) -> None:
    """SIGTERM while the model warms up: nothing was ever served, so no balancer sends here and the port is not
    held open for --shutdown-delay-seconds; the server exits as soon as its warm-up work is answered. (Broken once
    on purpose, the delay applied whatever the state: the exit took the full 60 s.)"""
    command = [sys.executable, "-m", "tests.serving", "--tokenizer-dir", str(tiny_model_dir), "--step-delay", "1"]
    command += ["--shutdown-delay-seconds", "60"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert process.stderr is not None
        for line in process.stderr:
            if "gRPC on" in line:
                break
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=45)  # fails on its own should the exit wait the 60 s
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    assert process.returncode == 0 and "serving " not in rest, rest
    assert "closing the port after 0.0 s" in rest, rest


@pytest.mark.parametrize("repeat", range(SHUTDOWN_REPEATS))
def test_calls_admitted_before_sigterm_end_ok_and_calls_sent_as_it_goes_ok_or_unavailable_never_cancelled(
    tiny_model_dir: Path, repeat: int
) -> None:
    """Every call the server held when SIGTERM went ends OK: those decoding, and two still being prepared (their
    pages parsing in the pool, admitted and not yet submitted); the server's /metrics says which calls it held.
    Calls sent as the signal goes may come after it: OK or UNAVAILABLE, never CANCELLED (grpc's stop cancels calls
    it has received but not yet handed to the service, grpc/grpc#41785: the server answers and drains first,
    keeping the port open, and stops grpc only then). Broken once on purpose (`AdmissionLedger.accept` refusing every
    submit once draining), the two calls still parsing their pages were answered UNAVAILABLE."""
    metrics_port = free_port()
    flags = ["--shutdown-delay-seconds", str(SHUTDOWN_DELAY_S), "--drain-seconds", str(DRAIN_S), "--step-delay", "0.01"]
    flags += ["--metrics-port", str(metrics_port)]
    with server_process(tiny_model_dir, *flags) as (process, address), grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TranslatorStub(channel)
        assert stub.Translate(request([HOUSE], beam_size=1), timeout=30).results[0].sentences == 1  # channel open
        pages = request([PAGE] * 3, beam_size=1, text_type=pb.TEXT_TYPE_HTML)
        held = [stub.Translate.future(pages, timeout=60) for _ in range(2)]
        for _ in range(SPACED_CALLS):
            held.append(stub.Translate.future(request([POLICE], beam_size=1), timeout=60))
            time.sleep(0.002)

        def held_with_the_pages_in_preparation() -> bool:  # the first call counted too
            metric = scrape(metrics_port)
            held_or_answered = metric("translation_requests_in_flight", method="Translate") + metric(
                "translation_requests_total", method="Translate"
            )
            prepared = metric("translation_preparation_seconds_count")
            return held_or_answered == 1 + len(held) and prepared == 1 + SPACED_CALLS

        wait_until(held_with_the_pages_in_preparation)  # every call admitted: nothing is refused before a drain
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        calls = [request([POLICE], beam_size=1)] * CALLS_AS_SIGTERM_GOES
        sent_after = [stub.Translate.future(call, timeout=60) for call in calls]
        answers = [(call.code(), call.details()) for call in held]
        answers_after = [(call.code(), call.details()) for call in sent_after]
        process.wait(max(SHUTDOWN_DELAY_S, DRAIN_S) + MIN_STOP_GRACE_S + 5)  # the documented bound, with slack
        exit_s = time.monotonic() - signalled
    assert answers == [(grpc.StatusCode.OK, "")] * len(held), f"admitted before SIGTERM: {collections.Counter(answers)}"
    codes = [code for code, _ in answers_after]
    print(collections.Counter(codes), exit_s)
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, answers_after
    assert all(details == DRAINING_MESSAGE for code, details in answers_after if code != grpc.StatusCode.OK)
    assert process.returncode == 0
    assert exit_s >= SHUTDOWN_DELAY_S, "the port stays open for the shutdown delay"


def test_a_client_with_the_clis_service_config_rides_out_a_replica_shutting_down(tiny_model_dir: Path) -> None:
    """Two replicas behind one round-robin channel, one sent SIGTERM mid-traffic: with the service config the
    `translate` CLI uses (each replica's health, a retry of UNAVAILABLE) every call ends OK, and the draining
    replica's exit is as usual. (Broken once on purpose, the channel with plain round robin: the calls sent to
    the draining replica ended UNAVAILABLE until it closed.)"""
    assert json.loads(CLIENT_SERVICE_CONFIG)["healthCheckConfig"]["serviceName"] == SERVICE_NAME
    flags = ("--shutdown-delay-seconds", "2", "--drain-seconds", "5", "--step-delay", "0.01")
    with (
        server_process(tiny_model_dir, *flags) as (leaving, first),
        server_process(tiny_model_dir, *flags) as (_, second),
    ):
        target = "ipv4:" + ",".join(address.replace("localhost", "127.0.0.1") for address in (first, second))
        with open_channel(target, service_config=CLIENT_SERVICE_CONFIG) as channel:
            stub = pb_grpc.TranslatorStub(channel)
            for _ in range(10):  # both replicas in the rotation
                assert stub.Translate(request([HOUSE], beam_size=1), timeout=30).results
            codes: list[grpc.StatusCode] = []
            started = time.monotonic()
            while time.monotonic() - started < 5:
                if len(codes) == 10:
                    leaving.send_signal(signal.SIGTERM)
                try:
                    stub.Translate(request([HOUSE], beam_size=1), timeout=30)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.append(err.code())
        assert leaving.wait(30) == 0
    assert len(codes) > 20 and set(codes) == {grpc.StatusCode.OK}, collections.Counter(codes)


class FailsOnceShared(FakeRunner):
    """Raises once, on the second step call whose rows come from more than one source."""

    def __init__(self, max_slots: int) -> None:
        super().__init__(max_slots)
        self.shared_steps = 0

    def step_log_probs(self, slots: list[int], tokens: list[int], positions: list[int]) -> npt.NDArray[np.float32]:
        if len({self.slots[s].source for s in slots}) > 1:
            self.shared_steps += 1
            if self.shared_steps == 2:
                raise InjectedFailure("out of memory")
        return super().step_log_probs(slots, tokens, positions)


def test_a_runner_error_with_a_full_queue_reruns_the_batch_and_answers_everyone() -> None:
    """isolate() puts the running sentences back in a queue that admitted work has already filled: the
    work admitted while the step ran must still be queued, not refused on the engine thread."""
    gate = GatedRunner(FailsOnceShared(max_slots=2))
    engine = Engine(gate, EngineLimits(max_slots=2, max_queue_sentences=2))
    engine.start()
    answers: dict[str, Future[Event]] = {}

    def submit(name: str, source: list[int]) -> None:
        answer: Future[Event] = Future()
        answers[name] = answer

        def deliver(event: Event) -> None:
            if isinstance(event, RequestDone | RequestFailed):
                answer.set_result(event)

        engine.submit([source], DecodeOptions(beam_size=1), deliver)

    try:
        gate.close_gate()
        submit("A", [5, 6, 7, 3])
        submit("B", [5, 8, 3])
        gate.wait_for_step()  # A and B share the first step
        gate.gate.set()
        gate.close_gate()
        gate.wait_for_step()  # the second shared step, which will raise, is held
        submit("C", [5, 9, 3])
        submit("D", [5, 10, 3])  # the queue is at its bound of 2
        gate.gate.set()
        outcomes = {name: answer.result(30) for name, answer in answers.items()}
        assert all(isinstance(o, RequestDone) for o in outcomes.values()), outcomes
        wait_until(lambda: engine.queue_depth == 0 and engine.active_slots == 0)
        submit("E", [5, 11, 3])
        assert isinstance(answers["E"].result(30), RequestDone)
    finally:
        engine.stop()
