"""onnxruntime implementations of `server.core.runner.Runner` over a pool of preallocated cache slots.

Cache shape, chosen for continuous batching: per layer one self-attention cache
(max_slots, H, max_target_len, Dh) and one cross cache (max_slots, H, max_source_len, Dh). A step
gathers the rows' slots up to the longest position in the batch and a per-row `past_keep` mask, so
rows at different steps share one graph call; the graph returns only the new key/value row, which
is written back at each row's own position.

A step reads every row up to the batch's longest span and masks what lies past the row's own, but masking
zeroes attention weights, and a weight of 0 times a stale NaN or inf is NaN: without cleaning, one request
whose activations overflowed would poison every later occupant of its slots. Stale finite values are
harmless (0 x finite = 0), so the host runner checks what it writes into its caches and zeroes a slot,
when a new sentence takes it, only if a NaN or inf went in; the device runner cannot look without copying
its caches back, so it zeroes every slot past what its new sentence writes.

Three places for the caches, same results:
- `OnnxRunner` keeps them in host memory (numpy), as slot caches (`--kv-cache host`). Its
  cross-attention feed is kept from step to step (`server.backend.cross_lanes`): only rows whose
  source is new to the step are copied, not every row at every change of the batch.
- `server.backend.working_batch.WorkingBatchRunner` builds on it and keeps the self-attention keys/values
  as the decoder's working batch, fed back with no gather per step: the CPU default.
- `DeviceCacheRunner` keeps them as OrtValues on the session's device and moves rows with the
  export's weightless kv_* graphs through IO binding. On CUDA a step then transfers only token ids
  and positions in and each row's few best candidates out, never the caches.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from model.directory import (
    DECODER_FILE,
    ENCODER_FILE,
    KV_APPEND_FILE,
    KV_GATHER_FILE,
    KV_MOVE_FILE,
    KV_WRITE_FILE,
    ExportMetadata,
    MetadataError,
    read_metadata,
)
from server.backend import KV_CACHES
from server.backend.cross_lanes import CrossLanes
from server.core.runner import Candidates, EncodeItem, ModelSpec

log = logging.getLogger(__name__)

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
CUDA_OPTIONS = {"use_tf32": "0"}
CANDIDATE_OUTPUTS = ("top_scores", "top_ids")  # what a serving step fetches from the decoder
LOG_PROBS_OUTPUT = "log_probs"  # the whole distribution, fetched only by parity checks
ROW_FEEDS = ("tokens", "positions", "past_keep", "row_scores")  # decoder inputs with one row per stepped row

Feeds = dict[str, npt.NDArray[np.generic]]


def make_session(path: Path, provider: str, intra_op_threads: int, spin_threads: bool = True) -> ort.InferenceSession:
    """A session for `provider`; `spin_threads=False` makes idle intra-op threads sleep, not busy-wait.

    Spinning (onnxruntime's default) shaves a little off each op when the process owns its cores.
    A server shares them with gRPC and Python threads, which spinning starves: on small nodes turning
    it off serves faster (docs/benchmarks.md gives the measurement and its command).
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads  # 0 = onnxruntime's default (all cores)
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin_threads else "0")
    wanted = PROVIDERS[provider]
    providers: list[str | tuple[str, dict[str, str]]] = [wanted]
    if wanted == "CUDAExecutionProvider":
        # float32 graphs compute in float32: TF32 tensor cores (onnxruntime's CUDA default) round matmul
        # inputs to 10 mantissa bits and move log-probs by ~4e-3, beyond parity with PyTorch; fp16 is the
        # fast variant there.
        providers = [(wanted, CUDA_OPTIONS), "CPUExecutionProvider"]
    return ort.InferenceSession(str(path), sess_options=options, providers=providers)


def kv_names(prefix_k: str, prefix_v: str, n_layers: int) -> list[str]:
    """Graph argument names in cache order: index 2*i is layer i's key, 2*i+1 its value."""
    return [name for i in range(n_layers) for name in (f"{prefix_k}_{i}", f"{prefix_v}_{i}")]


def moved_pairs(sources: list[int], destinations: list[int]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The (source, destination) slot pairs of a copy that move something, as two arrays."""
    src = np.asarray(sources, dtype=np.int64)
    dst = np.asarray(destinations, dtype=np.int64)
    moved = src != dst
    return src[moved], dst[moved]


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


class OnnxRunner:
    """Encoder + decoder-step sessions and numpy caches for `max_slots` decoding rows."""

    kv_cache = "host"

    def __init__(
        self, variant_dir: Path, max_slots: int, provider: str = "cpu", intra_op_threads: int = 0, *,
        spin_threads: bool = True,
    ) -> None:  # fmt: skip
        if provider not in PROVIDERS:
            raise ValueError(f"unknown provider {provider!r}; choose from {sorted(PROVIDERS)}")
        self._session = partial(
            make_session, provider=provider, intra_op_threads=intra_op_threads, spin_threads=spin_threads
        )
        self.metadata: ExportMetadata = read_metadata(variant_dir)
        self.spec: ModelSpec = self.metadata.spec()
        self.max_slots = max_slots
        self.encoder = self._session(variant_dir / ENCODER_FILE)
        self.decoder = self._session(variant_dir / DECODER_FILE)
        if "row_scores" not in {arg.name for arg in self.decoder.get_inputs()}:
            raise MetadataError(
                f"{variant_dir / DECODER_FILE} predates candidate ranking in the graph: "
                "export again with python -m export"
            )
        self.provider = self.decoder.get_providers()[0]
        self.dtype = np.float16 if self.metadata.dtype == "float16" else np.float32
        self.n_layers = self.metadata.n_decoder_layers
        # Graph argument names, built once: the decode loop binds them every step.
        self.cross_names = kv_names("cross_k", "cross_v", self.n_layers)
        self.past_names = kv_names("past_k", "past_v", self.n_layers)
        self.new_names = kv_names("new_k", "new_v", self.n_layers)
        meta = self.metadata
        self.self_shape = (max_slots, meta.n_heads, meta.max_target_len, meta.head_dim)
        self.cross_shape = (max_slots, meta.n_heads, meta.max_source_len, meta.head_dim)
        self.src_mask = np.zeros((max_slots, meta.max_source_len), dtype=bool)
        self.src_len = np.zeros(max_slots, dtype=np.int64)
        # What is valid in each slot, so copies move only that: target positions written so far, and
        # which encoded source the cross cache holds (beam rows of one sentence share it, so a beam
        # reorder copies no cross keys/values at all).
        self.tgt_len = np.zeros(max_slots, dtype=np.int64)
        self.source_key = np.full(max_slots, -1, dtype=np.int64)
        # How far into each slot anything may have been written since it was last cleaned: what the
        # next sentence to take the slot must zero (see the module docstring).
        self.self_written = np.zeros(max_slots, dtype=np.int64)
        self.cross_written = np.zeros(max_slots, dtype=np.int64)
        # Slots a NaN or inf was written into since they were last cleaned (the host runner's checks).
        self.non_finite = np.zeros(max_slots, dtype=bool)
        self._next_source_key = 0
        self._cross_version = 0  # bumped whenever a slot's cross cache or source mask changes
        self._cross_gather_key: tuple[bytes, int, int] | None = None
        self._open_caches(variant_dir)
        log.info("onnx runner %s on %s, %s caches, %d slots", meta.variant, self.provider, self.kv_cache, max_slots)

    # -- the Runner protocol: bookkeeping shared by both cache places ---------------------------

    def encode(self, items: list[EncodeItem]) -> None:
        """Encode all sources in one padded batch; copy each source's cross K/V into its slots."""
        if not items:
            return
        longest = max(len(item.source_ids) for item in items)
        if longest > self.spec.max_source_len:
            raise ValueError(f"source of {longest} tokens exceeds max_source_len {self.spec.max_source_len}")
        ids = np.full((len(items), longest), self.spec.pad_id, dtype=np.int64)
        for row, item in enumerate(items):
            ids[row, : len(item.source_ids)] = item.source_ids
        mask = ids != self.spec.pad_id
        item_of_slot = np.asarray([row for row, item in enumerate(items) for _ in item.slots], dtype=np.int64)
        slots = np.asarray([slot for item in items for slot in item.slots], dtype=np.int64)
        self._clean(slots, longest)
        self._encode_into(ids, mask, item_of_slot, slots)
        self.src_mask[slots] = False
        self.src_mask[slots, :longest] = mask[item_of_slot]
        self.src_len[slots] = longest
        self.tgt_len[slots] = 0
        self.source_key[slots] = self._next_source_key + item_of_slot
        self._next_source_key += len(items)
        self._cross_version += 1

    def step(
        self, slots: list[int], tokens: list[int], positions: list[int], row_scores: list[float], k: int
    ) -> Candidates:
        """One decoder step for rows at any mix of positions, ranked in the graph (its TopK)."""
        k = max(1, min(k, self.spec.vocab_size))
        ranking: Feeds = {"row_scores": np.asarray(row_scores, dtype=np.float32), "top_k": np.asarray([k], np.int64)}
        scores, ids = self._step(slots, tokens, positions, ranking, CANDIDATE_OUTPUTS)
        return Candidates(scores, ids)

    def step_log_probs(self, slots: list[int], tokens: list[int], positions: list[int]) -> npt.NDArray[np.float32]:
        """`step`, returning the whole (B, V) log-probabilities instead: for parity checks, not serving."""
        ranking: Feeds = {"row_scores": np.zeros(len(slots), dtype=np.float32), "top_k": np.asarray([1], np.int64)}
        (log_probs,) = self._step(slots, tokens, positions, ranking, (LOG_PROBS_OUTPUT,))
        return log_probs

    def _step(
        self, slots: list[int], tokens: list[int], positions: list[int], ranking: Feeds, wanted: tuple[str, ...]
    ) -> list[np.ndarray]:
        """Feed one token per row; new K/V stored at each row's position; return the `wanted` outputs."""
        rows = np.asarray(slots, dtype=np.int64)
        pos = self._positions(positions)
        past_len = int(pos.max())  # rows attend to cache entries 0 .. position - 1 plus the new one
        src_len = int(self.src_len[rows].max())
        feeds: Feeds = {
            "tokens": np.asarray(tokens, dtype=np.int64),
            "positions": pos,
            "past_keep": np.arange(past_len)[None, :] < pos[:, None],
        }
        outputs = self._decode(feeds | ranking, rows, pos, past_len, src_len, wanted)
        self.tgt_len[rows] = pos + 1
        self.self_written[rows] = np.maximum(self.self_written[rows], pos + 1)
        return outputs

    def _positions(self, positions: list[int]) -> npt.NDArray[np.int64]:
        pos = np.asarray(positions, dtype=np.int64)
        if pos.max(initial=0) >= self.spec.max_target_len:
            raise ValueError(f"position {int(pos.max())} exceeds max_target_len {self.spec.max_target_len}")
        return pos

    def copy_slots(self, sources: list[int], destinations: list[int]) -> None:
        """Gather on the slot axis: every destination becomes its source as it was before the call."""
        src, dst = moved_pairs(sources, destinations)
        if not src.size:
            return
        self.non_finite[dst] |= self.non_finite[src]
        self._copy_self(src, dst)
        other_source = self.source_key[src] != self.source_key[dst]
        if other_source.any():
            s, d = src[other_source], dst[other_source]
            length = int(self.src_len[s].max())
            self._move("cross", s, d, length)
            self.cross_written[d] = np.maximum(self.cross_written[d], length)
            self.src_mask[d] = self.src_mask[s]
            self.src_len[d] = self.src_len[s]
            self._cross_version += 1
        self.tgt_len[dst] = self.tgt_len[src]
        self.source_key[dst] = self.source_key[src]

    def _copy_self(self, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]) -> None:
        """`copy_slots`' self-attention part: the slot caches up to the longest source slot's length (entries
        past a slot's length are never read unmasked). Runs before the slots' lengths are copied."""
        filled = int(self.tgt_len[src].max())
        if filled:
            self._move("self", src, dst, filled)
            self.self_written[dst] = np.maximum(self.self_written[dst], filled)

    def _clean(self, slots: npt.NDArray[np.int64], source_len: int) -> None:
        """Zero what earlier sentences left in `slots` that could poison a new one (encoded to `source_len`)."""
        dirty = self._slots_to_zero(slots)
        if dirty.size:
            stale = int(self.self_written[dirty].max())
            if stale:
                self._zero("self", dirty, stale)
            stale = int(self.cross_written[dirty].max())
            if stale > source_len:  # the first source_len entries are about to be overwritten anyway
                self._zero("cross", dirty, stale)
        self.self_written[slots] = 0
        self.cross_written[slots] = source_len
        self.non_finite[slots] = False

    def _slots_to_zero(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Host caches: only slots a NaN or inf went into (their writes are checked)."""
        return slots[self.non_finite[slots]]

    def _mark_non_finite(
        self, slots: np.ndarray, blocks: list[np.ndarray], row_of_slot: np.ndarray | None = None
    ) -> None:
        """Flag each slot whose written rows hold a NaN or inf: slots[i] got row i of every block (one per
        cache), or row row_of_slot[i]."""
        for block in blocks:
            if np.isfinite(block).all():
                continue
            bad_rows = ~np.isfinite(block).reshape(len(block), -1).all(axis=1)  # rare: find the rows only now
            self.non_finite[slots[bad_rows if row_of_slot is None else bad_rows[row_of_slot]]] = True

    def _cross_key(self, rows: npt.NDArray[np.int64], src_len: int) -> tuple[bytes, int, int]:
        """What the gathered cross keys/values depend on; the last gather is reused while it is the same.

        Keyed on the sources, not the slots: a beam reorder permutes a sentence's slots every step
        but not its source, and gathering the cross keys/values is the largest copy of a step.
        The runners record a key only once its gather has succeeded: a gather that raised must not
        leave a key that vouches for the feeds of other rows.
        """
        return (self.source_key[rows].tobytes(), src_len, self._cross_version)

    # -- where the caches live: numpy arrays in host memory ------------------------------------

    def _open_caches(self, variant_dir: Path) -> None:
        self.self_kv = [np.zeros(self.self_shape, self.dtype) for _ in range(2 * self.n_layers)]
        self.cross_kv = [np.zeros(self.cross_shape, self.dtype) for _ in range(2 * self.n_layers)]
        meta = self.metadata
        self.lanes = CrossLanes(2 * self.n_layers, self.max_slots, meta.n_heads, meta.head_dim, meta.max_source_len,
                                self.dtype)  # fmt: skip

    def _encode_into(self, ids: np.ndarray, mask: np.ndarray, item_of_slot: np.ndarray, slots: np.ndarray) -> None:
        """Run the encoder on (N, S) ids; slot `slots[j]` gets the cross keys/values of row `item_of_slot[j]`."""
        outputs = self.encoder.run(None, {"src_ids": ids, "src_mask": mask})  # 2L x (N, H, S, Dh)
        for cache, out in zip(self.cross_kv, outputs, strict=True):
            cache[slots, :, : ids.shape[1]] = out[item_of_slot]
        self._mark_non_finite(slots, outputs, item_of_slot)

    def _decode(
        self, feeds: Feeds, rows: np.ndarray, pos: np.ndarray, past_len: int, src_len: int, wanted: tuple[str, ...]
    ) -> list[np.ndarray]:
        """Step the rows in lane order (`CrossLanes`): the cross feed is kept from the last step, the rest is
        permuted to match, and the outputs are put back in the caller's row order."""
        lane_of_row = self.lanes.place(self.source_key[rows], rows, src_len, self._fetch_cross, self._fetch_mask)
        order = np.argsort(lane_of_row)  # lane j steps the caller's row order[j]
        rows, pos = rows[order], pos[order]
        in_lanes = {name: feeds[name][order] for name in ROW_FEEDS}
        cross_arrays, src_mask = self.lanes.feeds(rows.size)
        cross = dict(zip(self.cross_names, cross_arrays, strict=True))
        past = {name: cache[rows, :, :past_len] for name, cache in zip(self.past_names, self.self_kv, strict=True)}
        extra = {"top_k": feeds["top_k"], "src_mask": src_mask}
        outputs = self.decoder.run([*wanted, *self.new_names], in_lanes | extra | past | cross)
        for cache, new in zip(self.self_kv, outputs[len(wanted) :], strict=True):
            cache[rows, :, pos] = new[:, :, 0]
        self._mark_non_finite(rows, outputs[len(wanted) :])  # (B, H, 1, Dh) each
        return [out[lane_of_row] for out in outputs[: len(wanted)]]

    def _fetch_cross(self, slots: np.ndarray, lanes: np.ndarray, length: int) -> None:
        for lane_array, cache in zip(self.lanes.arrays, self.cross_kv, strict=True):
            lane_array[lanes] = cache[slots, :, :length]

    def _fetch_mask(self, slots: np.ndarray, length: int) -> np.ndarray:
        return self.src_mask[slots, :length]

    def _move(self, kind: str, src: np.ndarray, dst: np.ndarray, length: int) -> None:
        for cache in self.self_kv if kind == "self" else self.cross_kv:
            cache[dst, :, :length] = cache[src, :, :length]

    def _zero(self, kind: str, slots: np.ndarray, length: int) -> None:
        for cache in self.self_kv if kind == "self" else self.cross_kv:
            cache[slots, :, :length] = 0


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


def open_runner(
    variant_dir: Path, max_slots: int, provider: str = "cpu", intra_op_threads: int = 0, kv_cache: str = "auto",
    *, spin_threads: bool = True,
) -> OnnxRunner:  # fmt: skip
    """The runner for a cache placement; an explicit "device" fails loudly where "auto" falls back."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"unknown kv_cache {kv_cache!r}; choose from {', '.join(KV_CACHES)}")
    from server.backend.working_batch import WorkingBatchRunner  # it builds on this module's OnnxRunner

    place = kv_cache if kv_cache != "auto" else auto_cache_place(variant_dir, provider)
    runner_class = {"device": DeviceCacheRunner, "working": WorkingBatchRunner}.get(place, OnnxRunner)
    return runner_class(variant_dir, max_slots, provider, intra_op_threads, spin_threads=spin_threads)


def auto_cache_place(variant_dir: Path, provider: str) -> str:
    """Device caches only where they pay: on CUDA. On CPU host memory is the device: numpy caches measure
    faster there (`python -m bench.cache_shape`), kept as the working batch (docs/benchmarks.md)."""
    if provider != "cuda":
        return "working"
    if PROVIDERS["cuda"] not in ort.get_available_providers():
        log.warning("kv_cache auto: the caches stay in host memory because this onnxruntime has no CUDA provider")
        return "working"
    return "device"
