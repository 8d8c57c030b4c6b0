"""The CPU default served end to end: `--kv-cache auto` on CPU serves the working batch, and over gRPC it
answers exactly what a working batch of its own decodes offline, one text at a time, and what PyTorch
(`model/training/decode.py`) decodes, greedy and beam, while sentences join a running batch, calls are
cancelled mid-decoding and the batch compacts."""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from model.tokenizer import TextTokenizer
from model.training.artifact import load_artifact
from model.training.decode import beam_search
from server.backend.working_batch import WorkingBatchRunner
from server.core.offline import translate_ids
from server.core.scheduler import output_limit
from server.edge.config import EnginesConfig
from server.edge.loading import LoadedModel
from server.text.splitter import join, split
from tests.serving import (
    RunningServer,
    onnx_model,
    request,
    runner_of,
    running_server,
    sample_value,
    server_config,
    wait_until,
)
from tests.tiny import TINY_PAIRS

MAX_SLOTS = 6  # two beams of 3 at once: every other sentence joins a running batch as slots free
MAX_OUTPUT = 20  # as tests/test_parity.py: the tiny random model's outputs agree with PyTorch this far
CLIENTS = 3
CALLS_PER_CLIENT = 6


@dataclass
class Spies:
    """How often the working batch did what this test must go through."""

    counts: Counter[str] = field(default_factory=Counter)

    def wrap(self, runner: WorkingBatchRunner, name: str, counted: Callable[[], bool] = lambda: True) -> None:
        inner = getattr(runner, name)

        def spy(*args: object, **kwargs: object) -> object:
            self.counts[name] += counted()
            return inner(*args, **kwargs)

        setattr(runner, name, spy)


@pytest.fixture(scope="module")
def served(tiny_exported_dir: Path) -> Iterator[tuple[RunningServer, LoadedModel, Spies]]:
    model = onnx_model(tiny_exported_dir, max_slots=MAX_SLOTS)  # kv_cache "auto", as the server's default
    runner = runner_of(model)
    assert isinstance(runner, WorkingBatchRunner), f"auto on CPU serves the working batch, got {type(runner)}"
    spies = Spies()
    spies.wrap(runner, "encode", lambda: bool(runner.stepped_last.any()))  # a source joining a running batch
    spies.wrap(runner, "_compact")
    spies.wrap(runner, "_park")
    with running_server(model, server_config(engines=EnginesConfig(max_slots=MAX_SLOTS, max_queue=512))) as running:
        yield running, model, spies


@dataclass(frozen=True)
class Asked:
    text: str
    source: str
    target: str
    beam: int


def expected_translation(asked: Asked, tokenizer: TextTokenizer, decode: Callable[[list[int]], list[int]]) -> str:
    """The text decoded sentence by sentence by `decode` (source ids -> best output ids), joined as served."""
    parts = split(asked.text, asked.source)
    if not parts.pieces:
        return asked.text
    pieces = [tokenizer.decode(decode(tokenizer.encode_source(p, asked.target))) for p in parts.pieces]
    return join(pieces, parts.separators)


def test_the_working_batch_serves_what_it_and_pytorch_decode_offline(
    served: tuple[RunningServer, LoadedModel, Spies], tiny_exported_dir: Path
) -> None:
    """Three clients send unary and streaming calls (greedy and beam 3, both directions) while a fourth
    starts long streams and cancels each after its first result; every answer equals an offline working
    batch's and PyTorch's, and the run went through joins, cancels, parked rows and compactions.

    Deliberate break: compaction dropping one column too many (`_dead_columns(used) + 1` in
    `WorkingBatchRunner._compact`) fails this test on the first answer compared (the served text differs
    from the offline decode's)."""
    running, model, spies = served
    answers: dict[Asked, set[str]] = {}
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(CALLS_PER_CLIENT):
            side = rng.randint(0, 1)
            source, target = ("de", "en") if side == 0 else ("en", "de")
            asked = [Asked(rng.choice(TINY_PAIRS)[side], source, target, rng.choice([1, 3])) for _ in range(3)]
            beams = {a.beam for a in asked}
            for beam in beams:  # one call per beam size
                mine = [a for a in asked if a.beam == beam]
                message = request([a.text for a in mine], source, target, beam_size=beam, length_penalty=1.0,
                                  max_output_len=MAX_OUTPUT)  # fmt: skip
                if rng.random() < 0.5:
                    results = list(running.stub.Translate(message, timeout=120).results)
                else:
                    stream = running.stub.TranslateStream(message, timeout=120)
                    results = [m.result for m in stream if m.HasField("result")]
                with lock:
                    for result in results:
                        answers.setdefault(mine[result.index], set()).add(result.translation)

    def canceller() -> None:
        for _ in range(3):
            long = request([TINY_PAIRS[i][0] for i in range(6)] * 2, beam_size=3, max_output_len=MAX_OUTPUT)
            stream = running.stub.TranslateStream(long, timeout=120)
            next(m for m in stream if m.HasField("result"))  # decoding is under way: cancel the rest
            stream.cancel()

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENTS)]
    threads.append(threading.Thread(target=canceller))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    engine = running.server.engine
    assert engine is not None
    wait_until(lambda: engine.queue_depth == 0 and engine.active_slots == 0)  # cancelled slots were freed
    cancelled = sample_value(running.registry, "translation_requests_total", code=grpc.StatusCode.CANCELLED.name)
    assert cancelled == 3

    tokenizer = model.tokenizer
    offline = WorkingBatchRunner(tiny_exported_dir / "onnx" / "fp32", MAX_SLOTS, intra_op_threads=1)
    torch_model = load_artifact(tiny_exported_dir)

    def by_offline(beam: int) -> Callable[[list[int]], list[int]]:
        return lambda ids: list(translate_ids(offline, [ids], beam, 1.0, MAX_OUTPUT)[0][0].tokens)

    def by_pytorch(beam: int) -> Callable[[list[int]], list[int]]:
        def decode(ids: list[int]) -> list[int]:
            limit = output_limit(MAX_OUTPUT, len(ids), offline.spec.max_target_len)  # the server's limit
            return list(beam_search(torch_model, ids, beam, limit, 1.0)[0].tokens)

        return decode

    assert len(answers) >= 10, "too few distinct texts were asked"
    for asked, got in answers.items():
        assert len(got) == 1, f"one text, several answers: {asked} {got}"
        want = expected_translation(asked, tokenizer, by_offline(asked.beam))
        assert got == {want}, asked
        assert expected_translation(asked, tokenizer, by_pytorch(asked.beam)) == want, asked
    assert spies.counts["encode"] > 0, "no source joined a running batch"
    assert spies.counts["_park"] > 0 and spies.counts["_compact"] > 0, spies.counts
