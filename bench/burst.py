"""How fast a burst the queue cannot take is refused, against the floor of as many no-op calls.

Starts `translate-server` (the shipped model unless told otherwise) with the given server flags, then
per round fires BURST Translate calls of one 6-sentence German text (`--text`: short sentences, or
news-length ones of 20-25 words) at once over a few channels, each
with a deadline; then, the engines idle, BURST ListModels calls (the floor: what gRPC and the event loop
take to answer calls that do no work) and BURST Translate calls without texts (INVALID_ARGUMENT before
admission). Reports per round each p50/p95 (from a call's sending to its status), the Translate status
counts, the OK throughput (sentences of OK calls over the time to the last OK answer), and whether the
refusals' p95 is within FLOOR_MARGIN_MS of the floor's p95 measured in the same round (a round without
refusals fails: it proves nothing). The server is warm (a call per channel, then a burst of no-op calls,
before the first round).
`--beside` also sends BURST ListModels calls between the Translate calls: no-op calls under the same
decoding load. The exit status is 1 when a round fails.

Usage:
  python -m bench.burst --rounds 20                    # the server's defaults, 20 rounds in a row
  python -m bench.burst --rounds 5 --text news         # news-length sentences: longer preparation per call
  python -m bench.burst --rounds 20 -- --max-queue 64  # a small queue
  python -m bench.burst --rounds 3 --out bench/results/burst-q64.json -- --max-queue 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.loadgen import percentile
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
BURST = 400
CHANNELS = 4
TEXTS = {
    "short": (  # 6 sentences of 4-6 words
        "Das Haus ist groß. Er wartete lange auf den Zug. Sie schrieben ein Buch über die Stadt. "
        "Es hörte auf zu regnen. Wir gingen nach Hause. Der Hund schläft im Garten."
    ),
    "news": (  # 6 sentences of 20-25 words
        "Die Bundesregierung hat am Mittwoch in Berlin ein umfangreiches Gesetzespaket zur Förderung erneuerbarer "
        "Energien beschlossen, das bereits im kommenden Frühjahr in Kraft treten soll. "
        "Nach Angaben des Wirtschaftsministeriums sollen private Haushalte und kleine Unternehmen dadurch in den "
        "nächsten fünf Jahren insgesamt mehrere Milliarden Euro an Energiekosten sparen. "
        "Vertreter der Opposition kritisierten jedoch, dass die geplanten Maßnahmen zu spät kämen und die "
        "ärmeren Regionen im Osten des Landes kaum erreichen würden. "
        "Der Verband der Stadtwerke begrüßte die Pläne grundsätzlich, forderte aber zusätzliche Mittel für den "
        "Ausbau der Stromnetze in ländlichen Gegenden und kleineren Gemeinden. "
        "In mehreren Landeshauptstädten demonstrierten am Wochenende tausende Menschen für einen schnelleren "
        "Ausstieg aus der Kohle und eine gerechtere Verteilung der Kosten. "
        "Das Parlament wird sich voraussichtlich noch vor der Sommerpause in erster Lesung mit dem Entwurf "
        "befassen, wie ein Sprecher des Bundestages am Donnerstag mitteilte."
    ),
}
START_TIMEOUT_S = 300.0
FLOOR_MARGIN_MS = 100.0  # how far above the floor's p95 the refusals' p95 may be


@dataclass(frozen=True)
class Round:
    """One burst of Translate calls (with no-op calls between them with `--beside`), then a burst of each
    floor alone."""

    codes: dict[str, int]  # Translate status name -> count
    refused_p50_ms: float  # RESOURCE_EXHAUSTED answers, from sending to status
    refused_p95_ms: float
    noop_p95_ms: float  # a burst of no-op calls alone, the engines idle: the floor
    passed: bool  # there were refusals, and their p95 is within FLOOR_MARGIN_MS of the floor's
    invalid_p95_ms: float  # a burst of Translate calls with no texts: refused INVALID_ARGUMENT before admission
    ok_sentences_per_s: float  # sentences of OK calls over the first send to the last OK answer
    wall_s: float  # first send to last answer of the Translate burst
    beside_noop_p50_ms: float | None  # with --beside: the no-op calls sent between the Translate calls
    beside_noop_p95_ms: float | None


async def _timed(call: grpc.aio.UnaryUnaryCall, sent: float) -> tuple[str, float, int]:  # type: ignore[type-arg]
    try:
        response = await call
    except grpc.aio.AioRpcError as err:
        return err.code().name, time.perf_counter() - sent, 0
    sentences = sum(r.sentences for r in getattr(response, "results", ()))
    return "OK", time.perf_counter() - sent, sentences


Call = tuple[str, object, float]  # method, request, deadline in seconds


async def burst(stubs: list[Any], calls: list[Call]) -> list[tuple[str, float, int]]:
    """Send the calls without awaiting any, round robin over the stubs; (code, seconds, sentences) of each."""
    pending = []
    for index, (method, message, deadline_s) in enumerate(calls):
        sent = time.perf_counter()
        pending.append(_timed(getattr(stubs[index % len(stubs)], method)(message, timeout=deadline_s), sent))
    return list(await asyncio.gather(*pending))


async def run_rounds(
    address: str, rounds: int, beam: int, deadline_s: float, beside: bool, text: str = TEXTS["short"]
) -> list[Round]:
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(CHANNELS)
    ]
    stubs: list[Any] = [pb_grpc.TranslatorStub(channel) for channel in channels]  # the async stubs
    options = pb.TranslationOptions(source_language="de", target_language="en", beam_size=beam)
    translate: Call = ("Translate", pb.TranslateRequest(texts=[text], options=options), deadline_s)
    for stub in stubs:  # connected and warm
        await stub.Translate(translate[1], timeout=START_TIMEOUT_S)
    no_op: Call = ("ListModels", pb.ListModelsRequest(), 60.0)
    await burst(stubs, [no_op] * BURST)  # both sides' gRPC machinery has held a burst's calls once
    measured = []
    for index in range(rounds):
        started = time.perf_counter()
        if beside:
            mixed = await burst(stubs, [call for _ in range(BURST) for call in (translate, no_op)])
            translations, loaded = mixed[0::2], mixed[1::2]
        else:
            translations, loaded = await burst(stubs, [translate] * BURST), []
        wall = time.perf_counter() - started
        idle = await burst(stubs, [no_op] * BURST)
        invalid = await burst(stubs, [("Translate", pb.TranslateRequest(options=options), 60.0)] * BURST)
        measured.append(judge_round(translations, loaded, idle, invalid, wall))
        verdict = "PASS" if measured[-1].passed else "FAIL"
        print(json.dumps({"round": index + 1, "verdict": verdict, **asdict(measured[-1])}), flush=True)
    for channel in channels:
        await channel.close(None)
    return measured


Answers = list[tuple[str, float, int]]


def judge_round(translations: Answers, loaded: Answers, idle: Answers, invalid: Answers, wall: float) -> Round:
    """A round from its answers: the Translate burst, the no-op calls beside it, the floor, the invalid calls."""

    def p(answers: Answers, q: float) -> float:
        return round(percentile([s * 1000 for _, s, _ in answers], q), 1)

    ok_end = max((s for c, s, _ in translations if c == "OK"), default=0.0)
    ok_sentences = sum(n for c, _, n in translations if c == "OK")
    refused = [a for a in translations if a[0] == "RESOURCE_EXHAUSTED"]
    return Round(
        codes=dict(Counter(c for c, _, _ in translations)),
        refused_p50_ms=p(refused, 50) if refused else 0.0,
        refused_p95_ms=p(refused, 95) if refused else 0.0,
        noop_p95_ms=p(idle, 95),
        passed=bool(refused) and p(refused, 95) <= p(idle, 95) + FLOOR_MARGIN_MS,
        invalid_p95_ms=p(invalid, 95),
        ok_sentences_per_s=round(ok_sentences / ok_end, 1) if ok_end else 0.0,
        wall_s=round(wall, 2),
        beside_noop_p50_ms=p(loaded, 50) if loaded else None,
        beside_noop_p95_ms=p(loaded, 95) if loaded else None,
    )


@contextmanager
def server(flags: list[str], log: Path) -> Iterator[str]:
    """`translate-server` with `flags` on a free loopback port, its log in `log`; yields its address once
    health says SERVING (every model loaded and warm)."""
    with server_process(flags, log) as (address, _):
        yield address


@contextmanager
def server_process(flags: list[str], log: Path) -> Iterator[tuple[str, int]]:
    """As `server`, yielding its address and its process id."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "server.edge.main", "--port", str(port), "--host", "localhost"]
    with log.open("w") as sink:
        process = subprocess.Popen([*command, "--metrics-port", "-1", *flags], stderr=sink, cwd=ROOT)
    address = f"localhost:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        with grpc.insecure_channel(address) as channel:
            while not serving(channel):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start; see {log}")
                time.sleep(0.5)
        yield address, process.pid
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def serving(channel: grpc.Channel) -> bool:
    """Whether the server on `channel` answers its health check SERVING (every model loaded and warm)."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="a running server instead of starting one")
    parser.add_argument("--rounds", type=int, default=3, help="bursts in a row, each checked against its floor")
    parser.add_argument("--beam", type=int, default=8)
    parser.add_argument("--deadline", type=float, default=30.0, help="each Translate call's deadline, seconds")
    parser.add_argument("--text", choices=sorted(TEXTS), default="short", help="the Translate calls' sentences")
    parser.add_argument("--beside", action="store_true", help="no-op calls between the Translate calls too")
    parser.add_argument("--out", type=Path, help="write the rounds and their medians here as JSON")
    parser.add_argument("--log", type=Path, default=Path("/tmp/bench-burst-server.log"), help="the server's log")
    parser.add_argument("server_flags", nargs="*", help="translate-server flags (after --)")
    args = parser.parse_args()
    measure = partial(
        run_rounds,
        rounds=args.rounds,
        beam=args.beam,
        deadline_s=args.deadline,
        beside=args.beside,
        text=TEXTS[args.text],
    )
    if args.address:
        rounds = asyncio.run(measure(args.address))
    else:
        with server(args.server_flags, args.log) as address:
            rounds = asyncio.run(measure(address))
    names = ("refused_p95_ms", "noop_p95_ms", "ok_sentences_per_s", "refused_p50_ms")
    medians = {name: statistics.median(getattr(r, name) for r in rounds) for name in names}
    passed = sum(r.passed for r in rounds)
    summary = {"flags": args.server_flags, "text": args.text, "passed": f"{passed} of {len(rounds)}"}
    summary["median_of_rounds"] = medians
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps({**summary, "rounds": [asdict(r) for r in rounds]}, indent=1) + "\n")
    sys.exit(0 if passed == len(rounds) else 1)


if __name__ == "__main__":
    main()
