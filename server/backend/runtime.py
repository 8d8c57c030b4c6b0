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

The places for the caches, same results:
- `OnnxRunner` keeps them in host memory (numpy), as slot caches (`--kv-cache host`). Its
  cross-attention feed is kept from step to step (`server.backend.cross_lanes`): only rows whose
  source is new to the step are copied, not every row at every change of the batch.
- `server.backend.working_batch.WorkingBatchRunner` builds on it and keeps the self-attention keys/values
  as the decoder's working batch, fed back with no gather per step: the CPU default.
- `server.backend.device_cache.DeviceCacheRunner` keeps them as OrtValues on the session's device and
  moves rows with the export's weightless kv_* graphs through IO binding.
- `server.backend.static_cache.StaticCacheRunner` keeps them there too, at full length for every slot, and
  steps the export's capturable decoder graph over them in place (CUDA graphs on CUDA).
`server.backend.runners.open_runner` chooses among them; `server.backend.sessions` opens the sessions. The host
and working-batch runners make their calls through `server.backend.arena_release`, which gives the memory of
the largest shapes back once the shapes fall.
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
    ExportMetadata,
    MetadataError,
    read_metadata,
)
from server.backend.arena_release import ArenaRelease
from server.backend.cross_lanes import CrossLanes
from server.backend.sessions import PROVIDERS, Feeds, kv_names, make_session, moved_pairs
from server.core.runner import Candidates, EncodeItem, ModelSpec, RowBias

__all__ = ["CANDIDATE_OUTPUTS", "PROVIDERS", "Feeds", "OnnxRunner", "kv_names", "make_session"]

log = logging.getLogger(__name__)

CANDIDATE_OUTPUTS = ("top_scores", "top_ids")  # what a serving step fetches from the decoder
BIAS_OUTPUT = "bias_scores"  # fetched too when the step takes a bias
LOG_PROBS_OUTPUT = "log_probs"  # the whole distribution, fetched only by parity checks
# Decoder inputs with one row per stepped row: the host runner puts them in its cross lanes' order.
ROW_FEEDS = ("tokens", "positions", "past_keep", "row_scores", "bias_ids", "bias_values")


def ranking_feeds(row_scores: list[float], k: int, bias: RowBias | None) -> Feeds:
    """The step graph's ranking inputs: row_scores (B,), top_k (1,), and the bias, (B, 1) of id 0 and value 0
    (which changes no score) when there is none."""
    rows = len(row_scores)
    if bias is None:
        bias = RowBias(np.zeros((rows, 1), np.int64), np.zeros((rows, 1), np.float32))
    if bias.ids.shape[0] != rows:
        raise ValueError(f"a bias of {bias.ids.shape[0]} rows for a step of {rows}")
    return {
        "row_scores": np.asarray(row_scores, dtype=np.float32), "top_k": np.asarray([k], np.int64),
        "bias_ids": bias.ids, "bias_values": bias.values,
    }  # fmt: skip


class OnnxRunner:
    """Encoder + decoder-step sessions and numpy caches for `max_slots` decoding rows."""

    kv_cache = "host"
    encoder_file = ENCODER_FILE  # the graph the encoder session opens
    step_file = DECODER_FILE  # the decoder-step graph this runner steps

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
        self._check_export(variant_dir, provider)
        self.encoder = self._session(variant_dir / self.encoder_file)
        self.decoder = self._open_step(variant_dir)
        self.memory = ArenaRelease()  # runs the sessions, giving memory back when their calls shrink
        if not {"row_scores", "bias_ids"} <= {arg.name for arg in self.decoder.get_inputs()}:
            raise MetadataError(
                f"the decoder step in {variant_dir} predates candidate ranking with a bias in the graph: "
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

    def _check_export(self, variant_dir: Path, provider: str) -> None:
        """Refuse, before any session opens, an export without the graphs this runner opens."""
        for name in (self.encoder_file, self.step_file):
            if not (variant_dir / name).is_file():
                raise MetadataError(f"no {name} in {variant_dir}: export again with {self._export_command}")

    @property
    def _export_command(self) -> str:
        """What builds this runner's graphs."""
        return "python -m export"

    def _open_step(self, variant_dir: Path) -> ort.InferenceSession:
        """The decoder-step session (the static runner opens its capturable step for CUDA graphs)."""
        return self._session(variant_dir / self.step_file)

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
        self, slots: list[int], tokens: list[int], positions: list[int], row_scores: list[float], k: int,
        bias: RowBias | None = None,
    ) -> Candidates:  # fmt: skip
        """One decoder step for rows at any mix of positions, ranked in the graph (its TopK after the bias)."""
        k = max(1, min(k, self.spec.vocab_size))
        ranking = ranking_feeds(row_scores, k, bias)
        if bias is None:
            scores, ids = self._step(slots, tokens, positions, ranking, CANDIDATE_OUTPUTS)
            return Candidates(scores, ids)
        scores, ids, bias_scores = self._step(slots, tokens, positions, ranking, (*CANDIDATE_OUTPUTS, BIAS_OUTPUT))
        return Candidates(scores, ids, bias_scores)

    def step_log_probs(self, slots: list[int], tokens: list[int], positions: list[int]) -> npt.NDArray[np.float32]:
        """`step`, returning the whole (B, V) log-probabilities instead: for parity checks, not serving."""
        ranking = ranking_feeds([0.0] * len(slots), 1, None)
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
        feeds = {"src_ids": ids, "src_mask": mask}
        outputs = self.memory.run(self.encoder, None, feeds, ids.size)  # 2L x (N, H, S, Dh)
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
        size = rows.size * (past_len + src_len)  # what the step's memory grows with
        outputs = self.memory.run(self.decoder, [*wanted, *self.new_names], in_lanes | extra | past | cross, size)
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
