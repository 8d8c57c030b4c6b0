"""How far an int8 export's log-probabilities lie from its fp32 export's, step by step.

Importable by the tests and runnable as `python -m tests.int8_check FP32_DIR INT8_DIR` (prints JSON), so
that it also runs under an emulated CPU of the other int8 class (tests/test_int8_cpu_classes.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from server.backend.working_batch import WorkingBatchRunner
from server.core.runner import EncodeItem

SOURCES = [[4, 10, 11, 12, 3], [5, 20, 21, 3]]
TARGETS = [2, 40, 41, 42, 43]


def teacher_forced_log_probs(variant_dir: Path) -> np.ndarray:
    """(steps, rows, V) log-probabilities of two rows fed the same target tokens."""
    runner = WorkingBatchRunner(variant_dir, max_slots=2, intra_op_threads=1)
    runner.encode([EncodeItem(source, [row]) for row, source in enumerate(SOURCES)])
    return np.stack([runner.step_log_probs([0, 1], [t, t], [i, i]) for i, t in enumerate(TARGETS)])


def int8_gap(fp32_dir: Path, int8_dir: Path) -> float:
    """Largest absolute log-probability difference between the two exports."""
    return float(np.abs(teacher_forced_log_probs(int8_dir) - teacher_forced_log_probs(fp32_dir)).max())


if __name__ == "__main__":
    gaps = {str(path): int8_gap(Path(sys.argv[1]), path) for path in map(Path, sys.argv[2:])}
    print(json.dumps(gaps))
