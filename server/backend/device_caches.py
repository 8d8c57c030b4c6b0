"""`DeviceCaches`: the key/value caches as OrtValues on the session's device, written in place by the export's
weightless kv_* graphs through IO binding, so that no cache is copied to the host and back.

The move and write graphs are bound with their output on their input's own buffer: the ScatterND inside
writes only the rows it updates (onnxruntime skips its copy when input and output share memory), so no call
ever copies a whole cache, and the buffers keep the addresses a captured step is bound at.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from model.directory import KV_MOVE_FILE, KV_WRITE_FILE

OpenSession = Callable[[Path], ort.InferenceSession]


class DeviceCaches:
    """2L self-attention caches (slots, H, T, Dh) and 2L cross caches (slots, H, S, Dh) on `device`, zeroed once:
    a never-written entry is masked, and masking must not meet NaN garbage (0 * NaN)."""

    def __init__(
        self, open_session: OpenSession, variant_dir: Path, device: str, dtype: type,
        self_shape: tuple[int, ...], cross_shape: tuple[int, ...], n_caches: int,
    ) -> None:  # fmt: skip
        self.device, self.dtype = device, dtype
        self.kv_move = open_session(variant_dir / KV_MOVE_FILE)
        self.kv_write = open_session(variant_dir / KV_WRITE_FILE)
        self.self_kv = [self.zeros(self_shape) for _ in range(n_caches)]
        self.cross_kv = [self.zeros(cross_shape) for _ in range(n_caches)]
        self.lengths = {"self": self_shape[2], "cross": cross_shape[2]}  # each kind's full cache length
        self._zero_blocks: dict[int, ort.OrtValue] = {}  # by power-of-two length: no upload per encode
        self._block_shape = (1, self_shape[1], 0, self_shape[3])

    def zeros(self, shape: tuple[int, ...], dtype: type | None = None) -> ort.OrtValue:
        # Device id 0 everywhere: the server drives one GPU per process (one container per GPU).
        return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype or self.dtype), self.device, 0)

    def write(self, encoded: dict[str, ort.OrtValue], items: np.ndarray, slots: np.ndarray) -> None:
        """kv_write: cross cache i of slot slots[j] gets row items[j] of encoded_i (the encoder's output)."""
        self._run_in_place(self.kv_write, self.cross_kv, {**encoded, "items": items, "slots": slots})

    def move(self, kind: str, src: np.ndarray, dst: np.ndarray, length: int) -> None:
        """kv_move: the first `length` entries of the `kind` caches of slots `src` into slots `dst`."""
        caches = self.self_kv if kind == "self" else self.cross_kv
        self._run_in_place(self.kv_move, caches, {"src": src, "dst": dst, "length": np.asarray(length, dtype=np.int64)})

    def zero(self, kind: str, slots: np.ndarray, length: int) -> None:
        """kv_write of one zero block into every slot: the graph that writes encoder output, reused."""
        caches = self.self_kv if kind == "self" else self.cross_kv
        zeros = self._zero_block(length, self.lengths[kind])
        blocks: dict[str, object] = {f"encoded_{i}": zeros for i in range(len(caches))}
        self._run_in_place(self.kv_write, caches, blocks | {"items": np.zeros(len(slots), np.int64), "slots": slots})

    def _zero_block(self, length: int, cache_len: int) -> ort.OrtValue:
        """A device-resident zero block at least `length` long: zeroing past the stale part is harmless."""
        bucket = min(1 << (length - 1).bit_length(), cache_len)
        if bucket not in self._zero_blocks:
            batch, heads, _, head_dim = self._block_shape
            self._zero_blocks[bucket] = self.zeros((batch, heads, bucket, head_dim))
        return self._zero_blocks[bucket]

    def _run_in_place(
        self, session: ort.InferenceSession, caches: list[ort.OrtValue], extra: dict[str, object]
    ) -> None:
        """Run a kv graph whose outputs out_i are written into the buffers of its inputs cache_i."""
        binding = session.io_binding()
        for i, cache in enumerate(caches):
            binding.bind_ortvalue_input(f"cache_{i}", cache)
            binding.bind_ortvalue_output(f"out_{i}", cache)
        for name, value in extra.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, np.asarray(value))
        session.run_with_iobinding(binding)
