"""The weightless kv_* graphs equal their numpy definitions, and really run in place."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from export.kv_ops import export_kv_ops
from model.directory import KV_MOVE_FILE, KV_WRITE_FILE

N_CACHES, HEADS, DH = 4, 3, 5  # two layers' keys and values


@pytest.fixture(scope="module", params=["float32", "float16"])
def graphs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, type]:
    out = tmp_path_factory.mktemp(f"kv-{request.param}")
    export_kv_ops(out, N_CACHES // 2, HEADS, request.param)
    return out, np.float16 if request.param == "float16" else np.float32


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def caches(dtype: type, slots: int = 8, length: int = 16, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((slots, HEADS, length, DH)).astype(dtype) for _ in range(N_CACHES)]


def named(prefix: str, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {f"{prefix}_{i}": a for i, a in enumerate(arrays)}


def test_move_is_a_gather_of_the_state_before_the_call(graphs: tuple[Path, type]) -> None:
    directory, dtype = graphs
    kv = caches(dtype)
    feeds = named("cache", kv) | {"src": np.array([1, 0, 0]), "dst": np.array([0, 1, 6]), "length": np.array(4)}
    for got, cache in zip(session(directory / KV_MOVE_FILE).run(None, feeds), kv, strict=True):
        want = cache.copy()
        want[[0, 1, 6], :, :4] = cache[[1, 0, 0], :, :4]
        np.testing.assert_array_equal(got, want)


def test_write_puts_each_encoded_source_into_its_slots(graphs: tuple[Path, type]) -> None:
    directory, dtype = graphs
    kv, encoded = caches(dtype), caches(dtype, slots=2, length=3, seed=2)
    feeds = (
        named("cache", kv) | named("encoded", encoded) | {"items": np.array([0, 1, 1]), "slots": np.array([6, 2, 4])}
    )
    for got, cache, enc in zip(session(directory / KV_WRITE_FILE).run(None, feeds), kv, encoded, strict=True):
        want = cache.copy()
        want[6, :, :3], want[[2, 4], :, :3] = enc[0], enc[1]
        np.testing.assert_array_equal(got, want)


def test_move_bound_in_place_updates_the_callers_buffer(graphs: tuple[Path, type]) -> None:
    """What the captured runner relies on: output bound to the input's OrtValue writes into it, so the buffers
    keep the addresses its captured step is bound at."""
    directory, dtype = graphs
    kv = [ort.OrtValue.ortvalue_from_numpy(c) for c in caches(dtype)]
    before = [c.numpy().copy() for c in kv]
    addresses = [c.data_ptr() for c in kv]
    sess = session(directory / KV_MOVE_FILE)
    binding = sess.io_binding()
    for i, cache in enumerate(kv):
        binding.bind_ortvalue_input(f"cache_{i}", cache)
        binding.bind_ortvalue_output(f"out_{i}", cache)
    binding.bind_cpu_input("src", np.array([4]))
    binding.bind_cpu_input("dst", np.array([2]))
    binding.bind_cpu_input("length", np.array(9))
    sess.run_with_iobinding(binding)
    for cache, old, address in zip(kv, before, addresses, strict=True):
        old[2, :, :9] = old[4, :, :9]
        np.testing.assert_array_equal(cache.numpy(), old)
        assert cache.data_ptr() == address
