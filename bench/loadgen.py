"""Open-loop and closed-loop gRPC load generator (asyncio).

Open loop: requests are due at Poisson arrival times (seeded) whatever happened to earlier ones, so a slow server
builds a queue instead of slowing the client down (no coordinated omission); every request is awaited
after the offering window, and its status and latency are recorded. Latency counts from when the
request was due, not from when it left: a client that falls behind (its event loop busy with
responses, on cores it shares with the server) must not hide the delay a real client would see.
Closed loop: N workers each send their next request when the previous one returns, which finds the
saturation throughput.

The test set holds German-English pairs; the CLI sends the directions the server lists (ListModels) and
stops with a message when it serves neither.

Usage:
  python -m bench.loadgen --address localhost:50051 --rate 20 --duration 10
  python -m bench.loadgen --address localhost:50051 --concurrency 8 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from model.languages import AmbiguousLanguage, match
from server.proto.translation.v1 import translation_pb2, translation_pb2_grpc


@dataclass(frozen=True)
class Query:
    """The texts of one request, all in one direction."""

    texts: tuple[str, ...]
    source_language: str
    target_language: str
    model: str = ""  # the model to route to, by name; "" = the first serving the pair
    glossary: tuple[tuple[str, str], ...] = ()  # inline glossary entries (source, target) sent with the texts


@dataclass(frozen=True)
class Record:
    """What happened to one request."""

    start: float  # seconds since the run began, when the request was due (open loop) or sent (closed)
    latency: float  # seconds until its response or error
    code: str  # gRPC status name, "OK" on success
    output_tokens: int  # target tokens the server reported (0 on error)
    sent: float = 0.0  # seconds since the run began, when the request actually left (open loop: >= start)


# Sends one query; returns output tokens or raises grpc.aio.AioRpcError.
Sender = Callable[[Query], Awaitable[int]]


MIN_P99_SAMPLES = 100  # below it, a p99 is just the maximum: reported as NaN instead


def p99(values: Sequence[float]) -> float:
    """The 99th percentile, NaN under MIN_P99_SAMPLES values (where it would only be the maximum)."""
    return percentile(values, 99) if len(values) >= MIN_P99_SAMPLES else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of `values`; NaN when empty."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class Summary:
    """Aggregate of one load run."""

    mode: str  # "open" (fixed offered rate) or "closed" (fixed concurrency)
    offered_rate: float  # requests per second offered (open loop), 0 for closed loop
    concurrency: int  # workers (closed loop), 0 for open loop
    requests: int
    ok: int
    errors: dict[str, int] = field(default_factory=dict)  # gRPC status name -> count, OK excluded
    elapsed_s: float = 0.0  # first send to last response
    achieved_rps: float = 0.0  # successful requests per second
    tokens_per_s: float = 0.0  # target tokens per second over successful requests
    p50_ms: float = math.nan
    p95_ms: float = math.nan
    p99_ms: float = math.nan  # NaN under MIN_P99_SAMPLES successful requests


def summarize(records: Sequence[Record], mode: str, offered_rate: float = 0.0, concurrency: int = 0) -> Summary:
    """Latency percentiles of successful requests, throughput and error counts."""
    ok = [r for r in records if r.code == "OK"]
    errors = Counter(r.code for r in records if r.code != "OK")
    elapsed = max((r.start + r.latency for r in records), default=0.0) - min((r.start for r in records), default=0.0)
    latencies_ms = [r.latency * 1000 for r in ok]
    rate = (lambda n: n / elapsed) if elapsed > 0 else (lambda n: 0.0)
    return Summary(
        mode=mode,
        offered_rate=offered_rate,
        concurrency=concurrency,
        requests=len(records),
        ok=len(ok),
        errors=dict(errors),
        elapsed_s=elapsed,
        achieved_rps=rate(len(ok)),
        tokens_per_s=rate(sum(r.output_tokens for r in ok)),
        p50_ms=percentile(latencies_ms, 50),
        p95_ms=percentile(latencies_ms, 95),
        p99_ms=p99(latencies_ms),
    )


async def _timed(send: Sender, query: Query, t0: float, due: float | None = None) -> Record:
    sent = time.perf_counter()
    start = sent if due is None else due
    try:
        tokens, code = await send(query), "OK"
    except grpc.aio.AioRpcError as err:
        tokens, code = 0, err.code().name
    return Record(start - t0, time.perf_counter() - start, code, tokens, sent - t0)


def send_times(rate: float, duration_s: float, seed: int = 0) -> list[float]:
    """Offsets (seconds) at which an open-loop run sends: a Poisson process of `rate` per second.

    Independent clients arrive in bursts and lulls; evenly spaced arrivals would never let a queue
    build below saturation, and understate its latency. Seeded, so that a rerun offers the same load.
    """
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be positive, got {rate} and {duration_s}")
    rng = random.Random(seed)
    times = [0.0]
    while (after := times[-1] + rng.expovariate(rate)) < duration_s:
        times.append(after)
    return times


async def open_loop(send: Sender, queries: Sequence[Query], offsets: Sequence[float]) -> list[Record]:
    """Send request i at `offsets[i]` seconds (`send_times`), cycling through `queries`; await every response."""
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[Record]] = []
    for i, offset in enumerate(offsets):
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(_timed(send, queries[i % len(queries)], t0, due=t0 + offset)))
    return list(await asyncio.gather(*tasks))


async def closed_loop(
    send: Sender, queries: Sequence[Query], concurrency: int, duration_s: float, max_requests: int = 0
) -> list[Record]:
    """`concurrency` workers send back to back until `duration_s` has passed, or `max_requests` were sent
    (0 = no cap): at concurrency 1, a cap of n sends exactly the first n queries."""
    t0 = time.perf_counter()
    counter = itertools.count()  # shared by the workers: they walk the queries together
    records: list[Record] = []

    async def worker() -> None:
        while time.perf_counter() - t0 < duration_s:
            if (i := next(counter)) >= max_requests > 0:
                return
            records.append(await _timed(send, queries[i % len(queries)], t0))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def grpc_sender(
    channels: Sequence[grpc.aio.Channel], beam_size: int, timeout_s: float, max_output_len: int = 0
) -> Sender:
    """A Sender calling Translator.Translate with each query's texts (max_output_len 0: the server's default),
    the requests taking the channels in turn.

    The length penalty is sent, 1.0, as the offline engines decode: the server's default may be tuned per
    direction (decoding.json), and a comparison must decode the same search on both sides.
    """
    stubs = itertools.cycle([translation_pb2_grpc.TranslatorStub(channel) for channel in channels])

    async def send(query: Query) -> int:
        stub = next(stubs)
        options = translation_pb2.TranslationOptions(
            source_language=query.source_language,
            target_language=query.target_language,
            model=query.model,
            beam_size=beam_size,
            length_penalty=1.0,
            max_output_len=max_output_len,
        )
        options.glossary.extend(translation_pb2.GlossaryEntry(source=s, target=t) for s, t in query.glossary)
        request = translation_pb2.TranslateRequest(texts=list(query.texts), options=options)
        response = await stub.Translate(request, timeout=timeout_s)
        return sum(r.output_tokens for r in response.results)

    return send


async def run_grpc(
    address: str,
    queries: Sequence[Query],
    beam_size: int,
    duration_s: float,
    rate: float = 0.0,
    concurrency: int = 0,
    max_output_len: int = 0,
    max_requests: int = 0,
    channels: int = 1,
) -> Summary:
    """One open-loop (rate > 0) or closed-loop (concurrency > 0, at most `max_requests` if set) run, over
    `channels` connections (a server of several processes on one port spreads connections, not calls)."""
    if (rate > 0) == (concurrency > 0):
        raise ValueError("give exactly one of rate or concurrency")
    opened = open_channels(address, channels)
    try:
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in opened)), timeout=30)
        send = grpc_sender(opened, beam_size, timeout_s=max(30.0, 4 * duration_s), max_output_len=max_output_len)
        if rate > 0:
            records = await open_loop(send, queries, send_times(rate, duration_s))
            return summarize(records, "open", offered_rate=rate)
        records = await closed_loop(send, queries, concurrency, duration_s, max_requests)
        return summarize(records, "closed", concurrency=concurrency)
    finally:
        await asyncio.gather(*(c.close(None) for c in opened))


def open_channels(address: str, count: int) -> list[grpc.aio.Channel]:
    """`count` channels with a connection each: grpc otherwise shares one subchannel among equal channels."""
    return [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(count)]


def load_queries(tsv: Path, texts_per_request: int = 1, glossary: Path | None = None) -> list[Query]:
    """Both directions of every test pair, interleaved: each query the next `texts_per_request` sentences of
    its direction. With a `glossary` (a German-English TSV file, as `translate --glossary` reads), every German
    request carries its entries."""
    from model.data import read_tsv
    from server.client.glossary_file import read_glossary

    pairs = read_tsv(tsv)
    entries = tuple(read_glossary(glossary)) if glossary is not None else ()
    queries: list[Query] = []
    for start in range(0, len(pairs), texts_per_request):
        chunk = pairs[start : start + texts_per_request]
        queries += [
            Query(tuple(p.de for p in chunk), "de", "en", glossary=entries),
            Query(tuple(p.en for p in chunk), "en", "de"),
        ]
    return queries


def translates(models: Sequence[translation_pb2.ModelInfo], source: str, target: str) -> bool:
    """Whether one of the listed models translates `source` into `target`, each code matched by the server's own
    rule (`model.languages.match`: `de` reaches NLLB's `deu_Latn`, `zh` never `zh-Hant`)."""

    def reaches(code: str, listed: Sequence[str]) -> bool:
        try:
            return match(code, listed) is not None
        except AmbiguousLanguage:
            return False

    for model in models:
        for pair in model.pairs:
            if reaches(source, [pair.source]) and reaches(target, [pair.target]):
                return True
        sources, targets = model.any_to_any.sources, model.any_to_any.targets
        if reaches(source, [lang.code for lang in sources]) and reaches(target, [lang.code for lang in targets]):
            return True
    return False


def servable(address: str, queries: Sequence[Query]) -> list[Query]:
    """The queries whose direction the server at `address` translates; SystemExit naming what it serves if none."""
    with grpc.insecure_channel(address) as channel:
        reply = translation_pb2_grpc.TranslatorStub(channel).ListModels(translation_pb2.ListModelsRequest(), timeout=30)
    kept = [q for q in queries if translates(reply.models, q.source_language, q.target_language)]
    if not kept:
        offered = sorted({f"{q.source_language}-{q.target_language}" for q in queries})
        names = ", ".join(m.name for m in reply.models) or "no model"
        raise SystemExit(f"the server ({names}) translates none of the test set's directions {offered}")
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="localhost:50051")
    parser.add_argument("--data", type=Path, default=Path("data/test.tsv"))
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of offered load")
    parser.add_argument("--max-output-len", type=int, default=0, help="tokens per sentence; 0 = the server's default")
    parser.add_argument("--channels", type=int, default=1, help="connections the requests take in turn")
    parser.add_argument("--texts-per-request", type=int, default=1, help="sentences of one direction per request")
    parser.add_argument("--glossary", type=Path, help="a de-en TSV glossary sent with every German source")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, default=0.0, help="open loop: requests per second")
    mode.add_argument("--concurrency", type=int, default=0, help="closed loop: concurrent workers")
    args = parser.parse_args()
    queries = servable(args.address, load_queries(args.data, args.texts_per_request, args.glossary))
    summary = asyncio.run(
        run_grpc(
            args.address, queries, args.beam_size, args.duration, args.rate, args.concurrency, args.max_output_len,
            channels=args.channels,
        )
    )  # fmt: skip
    print(json.dumps(asdict(summary), indent=2))


if __name__ == "__main__":
    main()
