"""`DeviceCacheRunner`: the key/value caches as OrtValues on the session's device (`--kv-cache device`, the
CUDA default). Rows move with the export's weightless kv_* graphs through IO binding, so a CUDA step
transfers only token ids and positions in and each row's few best candidates out, never the caches. It
cannot look at its caches without copying them back, so it zeroes every slot past what a new sentence
writes (a stale NaN times a masked weight of 0 would still be NaN)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from model.directory import KV_APPEND_FILE, KV_GATHER_FILE, KV_MOVE_FILE, KV_WRITE_FILE
from server.backend.runtime import OnnxRunner
from server.backend.sessions import PROVIDERS, Feeds


def gather_rows(
    kv_gather: ort.InferenceSession, caches: list[ort.OrtValue], rows: np.ndarray, length: int, device: str
) -> list[ort.OrtValue]:
    """The export's kv_gather graph: out_i = caches[i][rows, :, :length], left on `device`."""
    binding = kv_gather.io_binding()
    for i, cache in enumerate(caches):
        binding.bind_ortvalue_input(f"cache_{i}", cache)
        binding.bind_output(f"out_{i}", device, 0)
    binding.bind_cpu_input("rows", rows)
    binding.bind_cpu_input("length", np.asarray(length, dtype=np.int64))
    kv_gather.run_with_iobinding(binding)
    return list(binding.get_outputs())


class DeviceCacheRunner(OnnxRunner):
    """Caches as OrtValues on the session's device, moved by the kv_* graphs through IO binding.

    The append and move graphs are bound with their output on their input's own buffer: the
    ScatterND inside writes only the rows it updates (onnxruntime skips its copy when input and
    output share memory), so no step ever copies a whole cache.
    """

    kv_cache = "device"

    def _open_caches(self, variant_dir: Path) -> None:
        self.device = "cuda" if self.provider == PROVIDERS["cuda"] else "cpu"
        self.kv_gather = self._session(variant_dir / KV_GATHER_FILE)
        self.kv_append = self._session(variant_dir / KV_APPEND_FILE)
        self.kv_move = self._session(variant_dir / KV_MOVE_FILE)
        self.kv_write = self._session(variant_dir / KV_WRITE_FILE)
        # Zeroed once: a never-written entry is masked, and masking must not meet NaN garbage (0 * NaN).
        self.self_kv = [self._zeros(self.self_shape) for _ in range(2 * self.n_layers)]
        self.cross_kv = [self._zeros(self.cross_shape) for _ in range(2 * self.n_layers)]
        self._cross_values: list[ort.OrtValue] = []
        self._zero_blocks: dict[int, ort.OrtValue] = {}  # by power-of-two length: no upload per encode

    def _slots_to_zero(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Device caches are not read back to be checked: every slot is zeroed past its new sentence."""
        return slots

    def _zeros(self, shape: tuple[int, ...]) -> ort.OrtValue:
        # Device id 0 everywhere: the server drives one GPU per process (one container per GPU).
        return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self.dtype), self.device, 0)

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

    def _gather(self, caches: list[ort.OrtValue], rows: np.ndarray, length: int) -> list[ort.OrtValue]:
        return gather_rows(self.kv_gather, caches, rows, length, self.device)

    def _encode_into(self, ids: np.ndarray, mask: np.ndarray, item_of_slot: np.ndarray, slots: np.ndarray) -> None:
        binding = self.encoder.io_binding()
        binding.bind_cpu_input("src_ids", ids)
        binding.bind_cpu_input("src_mask", mask)
        for name in self.cross_names:
            binding.bind_output(name, self.device, 0)
        self.encoder.run_with_iobinding(binding)
        encoded = {f"encoded_{i}": value for i, value in enumerate(binding.get_outputs())}
        self._run_in_place(self.kv_write, self.cross_kv, encoded | {"items": item_of_slot, "slots": slots})

    def _decode(
        self, feeds: Feeds, rows: np.ndarray, pos: np.ndarray, past_len: int, src_len: int, wanted: tuple[str, ...]
    ) -> list[np.ndarray]:
        if (key := self._cross_key(rows, src_len)) != self._cross_gather_key:
            self._cross_values = self._gather(self.cross_kv, rows, src_len)
            self._cross_gather_key = key
        binding = self.decoder.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        binding.bind_cpu_input("src_mask", np.ascontiguousarray(self.src_mask[rows, :src_len]))
        past = self._gather(self.self_kv, rows, past_len)
        for name, value in zip(self.cross_names + self.past_names, self._cross_values + past, strict=True):
            binding.bind_ortvalue_input(name, value)
        for name in wanted:
            binding.bind_output(name, "cpu")  # only the (B, k) candidates cross to the host when serving
        for name in self.new_names:
            binding.bind_output(name, self.device, 0)
        self.decoder.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        appended = {f"new_{i}": value for i, value in enumerate(outputs[len(wanted) :])}
        self._run_in_place(self.kv_append, self.self_kv, appended | {"rows": rows, "positions": pos})
        return [np.asarray(out.numpy()) for out in outputs[: len(wanted)]]

    def _move(self, kind: str, src: np.ndarray, dst: np.ndarray, length: int) -> None:
        caches = self.self_kv if kind == "self" else self.cross_kv
        self._run_in_place(self.kv_move, caches, {"src": src, "dst": dst, "length": np.asarray(length, dtype=np.int64)})

    def _zero(self, kind: str, slots: np.ndarray, length: int) -> None:
        """kv_write of one zero block into every slot: the graph that writes encoder output, reused."""
        caches, shape = (self.self_kv, self.self_shape) if kind == "self" else (self.cross_kv, self.cross_shape)
        zeros = self._zero_block(length, shape[2])
        blocks: dict[str, object] = {f"encoded_{i}": zeros for i in range(len(caches))}
        self._run_in_place(self.kv_write, caches, blocks | {"items": np.zeros(len(slots), np.int64), "slots": slots})

    def _zero_block(self, length: int, cache_len: int) -> ort.OrtValue:
        """A device-resident zero block at least `length` long: zeroing past the stale part is harmless."""
        bucket = min(1 << (length - 1).bit_length(), cache_len)
        if bucket not in self._zero_blocks:
            self._zero_blocks[bucket] = self._zeros((1, self.metadata.n_heads, bucket, self.metadata.head_dim))
        return self._zero_blocks[bucket]
