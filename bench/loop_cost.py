"""What one call costs the server's event loop: its thread's CPU time per call over bursts of no-op calls.

Starts `translate-server` (the shipped model unless told otherwise) with the given server flags, warms it,
then sends `--bursts` bursts of 400 `ListModels` calls (the floor of `bench.burst`: calls that do no work)
over 4 channels and reads the CPU time of the server process's main thread, which runs the event loop, from
`/proc` (Linux) before and after. Reports the loop's CPU microseconds per call and the calls answered per
second. Everything a call costs the loop beside its own work (gRPC's Cython layer, the interceptors, the
access record, the metrics) is in this figure, and so every call's floor.

Usage:
  python -m bench.loop_cost --bursts 30
  python -m bench.loop_cost --bursts 30 -- --log-level WARNING   # without the access records
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc.aio

from bench.burst import BURST, CHANNELS, burst, server_process
from bench.cache_repeats import cpu_seconds
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc


def thread_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) the main thread of process `pid` has run."""
    return cpu_seconds(pid, thread=pid)  # the main thread's id is the process's


async def measure(address: str, pid: int, bursts: int) -> dict[str, Any]:
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(CHANNELS)
    ]
    stubs: list[Any] = [pb_grpc.TranslatorStub(channel) for channel in channels]
    no_op = ("ListModels", pb.ListModelsRequest(), 60.0)
    await burst(stubs, [no_op] * BURST)  # warm
    cpu, started = thread_cpu_s(pid), time.perf_counter()
    for _ in range(bursts):
        answers = await burst(stubs, [no_op] * BURST)
        assert all(code == "OK" for code, _, _ in answers), "a no-op call failed"
    calls, wall = bursts * BURST, time.perf_counter() - started
    loop_s = thread_cpu_s(pid) - cpu
    for channel in channels:
        await channel.close(None)
    return {"calls": calls, "loop_us_per_call": round(loop_s / calls * 1e6, 1), "calls_per_s": round(calls / wall)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bursts", type=int, default=30, help="bursts of 400 no-op calls measured")
    parser.add_argument("--log", type=Path, default=Path("/tmp/bench-loop-cost-server.log"), help="the server's log")
    parser.add_argument("server_flags", nargs="*", help="translate-server flags (after --)")
    args = parser.parse_args()
    with server_process(args.server_flags, args.log) as (address, pid):
        result = asyncio.run(measure(address, pid, args.bursts))
    print(json.dumps({"flags": args.server_flags, **result}))


if __name__ == "__main__":
    main()
