"""The engines' decoding at a lower OS scheduling priority than the threads that answer calls.

On a CPU the engines' threads and the gRPC event loop compete for the same cores; a refusal or a health
check is cheap, but it waits for a core while decoding holds them all. Raising the decoding threads'
niceness lets the kernel run the event loop first whenever both are ready, so those answers wait less for
a core, and decoding takes every cycle the event loop leaves. This relies on Linux, where niceness is per
thread and `setpriority` names a thread by its native id.
"""

from __future__ import annotations

import os

TASKS = "/proc/self/task"  # one entry per thread of this process, named by its native id


def lower_thread_priority(native_id: int, nice: int) -> None:
    """Add `nice` to the niceness of thread `native_id` (0: the calling thread); 0 changes nothing."""
    if nice:
        current = os.getpriority(os.PRIO_PROCESS, native_id)
        os.setpriority(os.PRIO_PROCESS, native_id, current + nice)


def lower_process_priority(nice: int) -> None:
    """Add `nice` to the niceness of every thread of this process (an engine process: onnxruntime's
    threads too), and of those it starts later, which inherit their creator's."""
    threads = [int(tid) for tid in os.listdir(TASKS)] if os.path.isdir(TASKS) else [0]
    for native_id in threads:
        lower_thread_priority(native_id, nice)
