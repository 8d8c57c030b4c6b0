"""int8 on the other class of x86 CPU, under emulation, so that both classes are tested wherever CI runs.

onnxruntime picks its int8 matrix kernel from the CPU: with VNNI the u8 x s8 dot products are exact; without
it they pass through int16 sums that saturate on full-range 8-bit weights. The native tests
(tests/test_export.py, tests/test_runtime.py) check the recipe for this CPU's class. Here the fp32 and int8
graphs run under `qemu-x86_64 -cpu EPYC-Rome` (AVX2, no VNNI): the 7-bit recipe must stay as close there,
and 8-bit per tensor must not (so the emulation is known to take the saturating path). QEMU emulates no
AVX-512, so on a host without VNNI only that host's class runs; an Arm host runs its own class natively.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from export.quantize import export_int8
from tests.ci_tools import missing
from tests.int8_check import int8_gap

QEMU = "qemu-x86_64"
NO_VNNI_CPU = "EPYC-Rome"  # AVX2 without VNNI, as on a 2nd-generation EPYC
TOLERANCE = 0.2  # the native tests' bound
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qemu() -> str:
    path = shutil.which(QEMU)
    if platform.machine() != "x86_64":
        pytest.skip("emulates an x86 CPU without VNNI; this host is not x86_64")
    if path is None:
        missing(f"{QEMU} is missing: apt-get install qemu-user (.ci/run does)")
    return path


def gaps_without_vnni(qemu: str, fp32_dir: Path, int8_dirs: list[Path]) -> dict[str, float]:
    """`tests.int8_check` run on an emulated CPU without VNNI."""
    cmd = [qemu, "-cpu", NO_VNNI_CPU, sys.executable, "-m", "tests.int8_check", str(fp32_dir), *map(str, int8_dirs)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return {Path(k).name: v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def test_int8_recipes_on_a_cpu_without_vnni(qemu: str, tiny_exported_dir: Path, tmp_path: Path) -> None:
    fp32 = tiny_exported_dir / "onnx" / "fp32"
    seven_bit = export_int8(tiny_exported_dir, tmp_path / "seven_bit", per_channel=True, reduce_range=True)
    eight_bit = export_int8(tiny_exported_dir, tmp_path / "eight_bit")
    emulated = gaps_without_vnni(qemu, fp32, [seven_bit, eight_bit])
    assert emulated["seven_bit"] <= TOLERANCE, emulated
    assert emulated["eight_bit"] > TOLERANCE, f"the emulated CPU did not saturate 8-bit weights: {emulated}"
    # the 7-bit recipe computes exactly on both classes: its int16 sums cannot saturate
    assert emulated["seven_bit"] == pytest.approx(int8_gap(fp32, seven_bit), abs=1e-4)
