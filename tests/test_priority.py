"""`--engine-nice`: the engine processes below the threads that answer calls (server/processes/priority.py)."""

from __future__ import annotations

import os
from pathlib import Path

from server.core.events import EngineLimits
from server.processes.engine_child import RunnerSettings
from server.processes.engine_process import ModelProcess

NICE = 5


def niceness(native_id: int = 0) -> int:
    return os.getpriority(os.PRIO_PROCESS, native_id)


def test_an_engine_process_lowers_every_thread_it_runs(tiny_exported_dir: Path) -> None:
    before = niceness()
    settings = RunnerSettings(tiny_exported_dir / "onnx" / "fp32", 4, "cpu", 2, "working", False)  # a thread pool too
    process = ModelProcess(settings)
    engine = process.start_engine(EngineLimits(max_slots=4), None, None, 0.0, NICE)
    try:
        engine.warmup()  # answered once the child has started its engine: after it lowered itself
        tasks = os.listdir(f"/proc/{process.pid}/task")
        assert len(tasks) > 2 and {niceness(int(tid)) for tid in tasks} == {min(before + NICE, 19)}
        assert niceness() == before
    finally:
        engine.stop(10.0)
        process.close()
