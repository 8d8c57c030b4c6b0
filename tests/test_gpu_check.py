"""bench.gpu_check, the one command for a GPU node, checked here where no GPU is: its wheel install, its steps
on the CPU provider, and its refusal to pass when onnxruntime has no CUDA."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_check import STARTUP_RUNS, install_wheel, main


def tiny_wheel(out: Path, module: str = "gpu_check_probe", source: str = "ANSWER = 42\n") -> Path:
    """A valid pure-Python wheel of one module."""
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / f"{module}-1.0-py3-none-any.whl"
    info = f"{module}-1.0.dist-info"
    files = {
        f"{module}.py": source.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for name, data in files.items()
    ]
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]))
    return wheel


def test_a_wheel_in_parts_is_joined_and_installed_into_the_target(tmp_path: Path) -> None:
    wheel = tiny_wheel(tmp_path)
    parts = tmp_path / "parts"
    parts.mkdir()
    data = wheel.read_bytes()
    for index, start in enumerate(range(0, len(data), 200)):  # as `split -b` names them: aa, ab, ...
        (parts / f"{wheel.name}.part{chr(97 + index // 26)}{chr(97 + index % 26)}").write_bytes(
            data[start : start + 200]
        )
    assert len(list(parts.iterdir())) > 1
    beside = tiny_wheel(tmp_path / "beside", "gpu_check_beside", "ANSWER = 7\n")  # a whole wheel next to the parts
    shutil.copy(beside, parts / beside.name)
    site = tmp_path / "site"
    subprocess.run(install_wheel(parts, site), check=True, capture_output=True)
    assert (site / "gpu_check_probe.py").read_text() == "ANSWER = 42\n"
    assert (site / "gpu_check_beside.py").read_text() == "ANSWER = 7\n"


def test_a_packed_site_in_parts_is_unpacked_onto_every_steps_path(tmp_path: Path) -> None:
    """--site-parts: an installed folder packed as tar.xz and split is unpacked into the site that every
    later step has first on its path."""
    packed = tmp_path / "packed"
    (packed / "gpu_check_site_probe").mkdir(parents=True)
    (packed / "gpu_check_site_probe" / "__init__.py").write_text("ANSWER = 13\n")
    archive = tmp_path / "site.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(packed, arcname=".")
    data, parts = archive.read_bytes(), tmp_path / "parts"
    parts.mkdir()
    for index, start in enumerate(range(0, len(data), 100)):
        (parts / f"site.tar.xz.{index:02d}").write_bytes(data[start : start + 100])
    assert len(list(parts.iterdir())) > 1
    out = tmp_path / "out"
    assert main(["--provider", "cpu", "--site-parts", str(parts), "--out", str(out), "--steps", "onnxruntime"]) == 0
    probe = subprocess.run(
        [sys.executable, "-c", "import gpu_check_site_probe as p; print(p.ANSWER)"],
        env=os.environ | {"PYTHONPATH": str(out / "site")}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert probe.stdout.strip() == "13"


def test_the_steps_run_and_are_summarised(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    out = tmp_path / "out"
    steps = "onnxruntime,export,parity"
    assert (
        main(["--provider", "cpu", "--model-dir", str(model), "--out", str(out), "--limit", "3", "--steps", steps]) == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and [s["name"] for s in summary["steps"]] == steps.split(",")
    assert "parity: PASS" in (out / "parity.log").read_text()
    assert (out / "site" / "sitecustomize.py").is_file()  # every step's interpreter preloads the CUDA libraries


def test_the_startup_step_times_a_replica_to_serving_on_the_built_graphs(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    out = tmp_path / "out"
    steps = "onnxruntime,export,startup"
    assert main(["--provider", "cpu", "--model-dir", str(model), "--out", str(out), "--steps", steps]) == 0
    starts = json.loads((out / "startup.json").read_text())
    assert [s["case"] for s in starts] == ["dir"] * STARTUP_RUNS
    assert all(0 < s["seconds_to_serving"] < 300 for s in starts)


# Appended to the steps' sitecustomize: their onnxruntime offers no CUDA, whether or not this host has it
HIDE_CUDA = """
import onnxruntime as _ort
_offered = _ort.get_available_providers
_ort.get_available_providers = lambda: [p for p in _offered() if p != "CUDAExecutionProvider"]
"""


def test_no_cuda_fails_at_the_first_step(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run on every host: on a GPU node too, the steps' onnxruntime is made to offer no CUDA."""
    monkeypatch.setattr(gpu_check, "SITECUSTOMIZE", gpu_check.SITECUSTOMIZE + HIDE_CUDA)
    out = tmp_path / "out"
    assert main(["--model-dir", str(tiny_model_dir), "--out", str(out)]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["passed"] and [s["name"] for s in summary["steps"]] == ["onnxruntime"]


def test_the_prepared_command_at_a_shape_measures_generate_beside_the_served_path(tmp_path: Path) -> None:
    """`--shape` (tiny-capturable here, opus-mt-de-en on a GPU node): a random Marian built through the importer,
    its parity, the captured step against the uncaptured one, and the benchmark with
    transformers' batched generate on the same weights as the baseline."""
    out = tmp_path / "out"
    bench = "--offline-s 0.5 --load-s 0.5 --latency-requests 2 --sentences 12 --served-variants fp32 --concurrency 2"
    assert main(["--provider", "cpu", "--shape", "tiny-capturable", "--out", str(out), "--limit", "3", "--quick",
                 "--bench-args", bench]) == 0  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == [
        "onnxruntime", "model", "parity", "static", "fp16gate", "bench", "startup"
    ]  # fmt: skip
    assert '"passed": true' in (out / "fp16gate.log").read_text()  # fp16 against fp32, as auto gates it on CUDA
    assert len(json.loads((out / "startup.json").read_text())) == STARTUP_RUNS  # the replica's start to SERVING
    # the capturable graphs built (head_dim 8) and run on the CPU provider: the fused fp16 step against the
    # uncaptured working batch, greedy and beam 4
    static = (out / "static.log").read_text()
    assert all(f"fp16 fused beam {beam}: identical token ids" in static for beam in (1, 4)), static
    assert "static parity: PASS" in static
    results = json.loads((out / "bench" / "results.json").read_text())
    generate = results["offline"]["transformers-generate"]
    # generate on the same weights decodes what our PyTorch reference decodes (the import is exact)
    assert generate["beam1"]["agreement_with_pytorch"]["rate"] == 1.0
    assert results["budget"]["concurrency"] == [2]
    ratios = results["ratios_to_transformers"]["beam1"]["served-fp32"]
    assert ratios["throughput"] > 0 and ratios["latency_p50"] > 0
    assert "Served against transformers' batched `generate`" in (out / "bench" / "results.md").read_text()


def test_the_tiny_capturable_shape_has_a_head_size_the_captured_step_takes() -> None:
    """`tiny` (head_dim 4) has no capturable step; the CPU rehearsal's shape must have one."""
    from bench.marian_random import SHAPES
    from model.directory import capturable_head_dim

    shape = SHAPES["tiny-capturable"]
    assert capturable_head_dim(shape.d_model // shape.heads)
    assert not capturable_head_dim(SHAPES["tiny"].d_model // SHAPES["tiny"].heads)


def test_every_gpu_arm_is_a_server_config_and_spreads_its_calls_over_its_server_processes() -> None:
    """The arms run only on a GPU: a flag misspelt there would be found only after the device time is spent."""
    import shlex

    from bench.gpu_check import GPU_ARMS
    from bench.run import CHANNELS_PER_PROCESS, connections_for
    from server.edge.flags import parse_config

    arms = GPU_ARMS[1::2]
    assert GPU_ARMS[::2] == ["--served-arm"] * len(arms)
    for arm in arms:
        _, _, rest = arm.partition("=")
        variant, *flags = shlex.split(rest)
        processes = parse_config(["--port", "50051", "--variant", variant, *flags], {}).serving.processes
        assert connections_for(flags) == (CHANNELS_PER_PROCESS * processes if processes > 1 else 1)
    argvs = [["--port", "1", *shlex.split(a.partition("=")[2])[1:]] for a in arms]
    assert any(parse_config(argv, {}).serving.processes > 1 for argv in argvs)
    assert connections_for(["--processes", "4"]) == 4 * CHANNELS_PER_PROCESS
    assert connections_for(["--engines", "1"]) == 1
