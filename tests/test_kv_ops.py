"""The weightless kv_* graphs equal their numpy definitions, and append/move really run in place."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from export.kv_ops import export_kv_ops
from model.directory import KV_APPEND_FILE, KV_GATHER_FILE, KV_MOVE_FILE, KV_WRITE_FILE

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


def test_gather_takes_rows_up_to_a_length(graphs: tuple[Path, type]) -> None:
    directory, dtype = graphs
    kv, rows = caches(dtype), np.array([3, 1, 3])
    for length in (0, 6):
        out = session(directory / KV_GATHER_FILE).run(
            None, named("cache", kv) | {"rows": rows, "length": np.array(length)}
        )
        for got, cache in zip(out, kv, strict=True):
            np.testing.assert_array_equal(got, cache[rows, :, :length])


def test_append_writes_each_row_at_its_own_position(graphs: tuple[Path, type]) -> None:
    directory, dtype = graphs
    kv, new = caches(dtype), caches(dtype, slots=2, length=1, seed=1)
    feeds = named("cache", kv) | named("new", new) | {"rows": np.array([2, 5]), "positions": np.array([0, 7])}
    for got, cache, row in zip(session(directory / KV_APPEND_FILE).run(None, feeds), kv, new, strict=True):
        want = cache.copy()
        want[2, :, 0], want[5, :, 7] = row[0, :, 0], row[1, :, 0]
        np.testing.assert_array_equal(got, want)


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


def test_append_bound_in_place_updates_the_callers_buffer(graphs: tuple[Path, type]) -> None:
    """What DeviceCacheRunner relies on: output bound to the input's OrtValue writes into it."""
    directory, dtype = graphs
    kv = [ort.OrtValue.ortvalue_from_numpy(c) for c in caches(dtype)]
    before = [c.numpy().copy() for c in kv]
    new = caches(dtype, slots=1, length=1, seed=3)
    sess = session(directory / KV_APPEND_FILE)
    binding = sess.io_binding()
    for i, cache in enumerate(kv):
        binding.bind_ortvalue_input(f"cache_{i}", cache)
        binding.bind_ortvalue_output(f"out_{i}", cache)
        binding.bind_cpu_input(f"new_{i}", new[i])
    binding.bind_cpu_input("rows", np.array([4]))
    binding.bind_cpu_input("positions", np.array([9]))
    sess.run_with_iobinding(binding)
    for cache, old, row in zip(kv, before, new, strict=True):
        old[4, :, 9] = row[0, :, 0]
        np.testing.assert_array_equal(cache.numpy(), old)
