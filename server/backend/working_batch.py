"""`WorkingBatchRunner`: the caches in host memory, the self-attention keys/values kept as the decoder's working
batch (`--kv-cache working`: the CPU path, and the fallback wherever the captured step cannot run).

The decoder step (`export.builder.decoder`) writes each row's new key and value into buffers the runner binds as
both its past and its present, at the row's own position, and a row reads only its own entries: a step copies
no keys or values at all, and reads no padding. The buffers hold the batch's rows in the order the step feeds
them, the working batch: W rows of up to L entries (a row's first `row_len` are its slot's keys/values). Under
continuous batching rows come and go every step:
- A slot the step needs but no row holds (a new sentence, a beam copy's destination) takes a free row: one
  whose slot was encoded again, else one the step does not use (its keys/values are parked), else a new row
  at the end. A taken row needs no cleaning: the step never reads past a row's own entries, so nothing a
  former occupant left (a NaN or inf included) reaches the new sentence.
- Rows the step does not use are still computed (their results are dropped; each writes its key and value
  just past its own entries, where nothing reads them) until a compaction moves the stepped rows into the
  first places: it runs when more than a quarter of the rows sit idle, one move every several steps.
- A beam reorder (`copy_slots`) copies the moved rows' entries within the buffers.
- Keys/values of a slot whose row was reclaimed are parked per slot and put back into a row if the slot is
  stepped or copied again, so every slot keeps its cache as the `Runner` protocol promises.
L grows in steps of LENGTH_STEP as rows get longer (new buffers, each row's entries carried over) and the
buffers are laid out again, smaller, once the longest row would use under 1 / BUFFER_SLACK of them.
The cross-attention feed is kept apart from the rows, one copy of each source stepped however many beams attend
to it (`server.backend.cross_groups`); the slot caches ((max_slots, H, max_source_len, Dh) per cache, resident
only where written) are read only when a new source is stepped. Both live in buffers kept from one step to the
next: a batch that grows copies nothing, a compaction moves only the rows whose place changes. Every block the
encoder writes into the slot caches is checked, so a slot is zeroed for its next sentence only if a NaN or inf
went in.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from model.directory import (
    DECODER_FILE,
    QUERY_SEQLENS_SINCE,
    MetadataError,
    buffer_head_dim,
    takes_cross_groups,
)
from server.backend.cross_groups import (
    BUFFER_SLACK,
    FREE,
    IDLE_SHARE,
    LENGTH_STEP,
    MIN_IDLE,
    CrossGroups,
    fill_holes,
    working_length,
)
from server.backend.runtime import Feeds, OnnxRunner, kv_names
from server.core.runner import EncodeItem

Ids = npt.NDArray[np.int64]


class WorkingBatchRunner(OnnxRunner):
    """Host caches, the self-attention keys/values kept in the decoder's own row order (see above)."""

    kv_cache = "working"

    def __init__(
        self, variant_dir: Path, max_slots: int, provider: str = "cpu", intra_op_threads: int = 0, *,
        spin_threads: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(variant_dir, max_slots, provider, intra_op_threads, spin_threads=spin_threads)
        self.present_names = kv_names("present_k", "present_v", self.n_layers)
        self.cross_present_names = kv_names("cross_present_k", "cross_present_v", self.n_layers)
        written = {*self.present_names, *self.cross_present_names}
        if not written <= {arg.name for arg in self.decoder.get_outputs()}:
            raise MetadataError(
                f"{variant_dir / DECODER_FILE} predates the decoder step that writes its keys and values into the "
                "buffers the runner binds: export again with python -m export"
            )
        self.row_len = np.zeros(0, dtype=np.int64)  # (W,) how many entries each row holds
        self.row_slot = np.zeros(0, dtype=np.int64)  # (W,) the slot each row holds, or FREE
        self.row_of_slot = np.full(max_slots, FREE, dtype=np.int64)
        self.parked: dict[int, list[np.ndarray]] = {}  # slot -> its (H, n, Dh) entries per cache
        self.kv_store: list[np.ndarray] = []  # (rows, H, L, Dh) per cache, rows >= W: the batch's keys/values
        self._lay_out_kv(max_slots, LENGTH_STEP)
        meta = self.metadata
        self.cross = CrossGroups(
            2 * self.n_layers, meta.n_heads, buffer_head_dim(meta.head_dim), self.dtype, meta.max_source_len, max_slots
        )  # fmt: skip
        self.stepped_last = np.zeros(0, dtype=bool)  # (W,) the rows the last step used

    def _check_export(self, variant_dir: Path, provider: str) -> None:
        """Also refuse, before any session opens, a step this onnxruntime cannot run (several queries per group)."""
        super()._check_export(variant_dir, provider)
        if self.metadata.cross_groups and not takes_cross_groups(ort.__version__):
            raise MetadataError(
                f"{variant_dir / DECODER_FILE} takes several queries per cross group, which onnxruntime "
                f"{ort.__version__} cannot run (GroupQueryAttention's query_seqlens came in "
                f"{'.'.join(map(str, QUERY_SEQLENS_SINCE))}): install a newer onnxruntime, or export again with "
                "python -m export under this one"
            )

    def _open_caches(self, variant_dir: Path) -> None:
        self.self_kv = []  # the working batch holds the self-attention keys/values
        self.cross_kv = [untouched_zeros(self.cross_shape, self.dtype) for _ in range(2 * self.n_layers)]

    @property
    def width(self) -> int:
        return int(self.row_slot.size)

    # -- the slot caches: the cross keys/values in host memory ---------------------------------

    def _encode_into(self, ids: np.ndarray, mask: np.ndarray, item_of_slot: np.ndarray, slots: np.ndarray) -> None:
        feeds = {"src_ids": ids, "src_mask": mask}
        outputs = self.memory.run(self.encoder, None, feeds, ids.size)  # 2L x (N, H, S, Dh)
        for cache, out in zip(self.cross_kv, outputs, strict=True):
            cache[slots, :, : ids.shape[1]] = out[item_of_slot]
        self._mark_non_finite(slots, outputs, item_of_slot)

    def _mark_non_finite(self, slots: np.ndarray, blocks: list[np.ndarray], row_of_slot: np.ndarray) -> None:
        """Flag each slot whose written rows hold a NaN or inf: slots[i] got row row_of_slot[i] of every block."""
        for block in blocks:
            if np.isfinite(block).all():
                continue
            bad_rows = ~np.isfinite(block).reshape(len(block), -1).all(axis=1)  # rare: find the rows only now
            self.non_finite[slots[bad_rows[row_of_slot]]] = True

    def _slots_to_zero(self, slots: Ids) -> Ids:
        """Only slots a NaN or inf went into (every write is checked)."""
        return slots[self.non_finite[slots]]

    def _move(self, kind: str, src: np.ndarray, dst: np.ndarray, length: int) -> None:
        for cache in self.self_kv if kind == "self" else self.cross_kv:
            cache[dst, :, :length] = cache[src, :, :length]

    def _zero(self, kind: str, slots: np.ndarray, length: int) -> None:
        for cache in self.self_kv if kind == "self" else self.cross_kv:
            cache[slots, :, :length] = 0

    # -- the Runner protocol --------------------------------------------------------------------

    def encode(self, items: list[EncodeItem]) -> None:
        super().encode(items)
        for item in items:
            for slot in item.slots:
                self._forget(slot)

    def _copy_self(self, src: Ids, dst: Ids) -> None:
        """`copy_slots`' self-attention part: each destination's row becomes its source's, within the batch."""
        # Rows stepped last time may still be needed this iteration: new rows come from the others.
        stepped = np.flatnonzero(self.stepped_last)
        parked = np.asarray([slot for slot in src.tolist() if slot in self.parked], dtype=np.int64)
        if parked.size:  # put parked sources back first, beside every source that has a row
            self._rows_for(parked, reserved=np.concatenate([self.row_of_slot[src], stepped]))
        src_rows = self.row_of_slot[src]
        for slot in dst.tolist():
            self.parked.pop(slot, None)  # the copy replaces what a destination held
        has_content = src_rows != FREE
        for slot in dst[~has_content].tolist():
            self._forget(slot)  # a source never stepped gives its destination nothing
        src, dst, src_rows = src[has_content], dst[has_content], src_rows[has_content]
        if not src.size:
            return
        dst_rows = self._rows_for(dst, reserved=np.concatenate([src_rows, stepped]))
        self._move_rows(src_rows, dst_rows)
        self.row_len[dst_rows] = self.row_len[src_rows]

    def _step(
        self, slots: list[int], tokens: list[int], positions: list[int], ranking: Feeds, wanted: tuple[str, ...]
    ) -> list[np.ndarray]:
        """Feed one token per row against the working batch; the step writes its keys/values into the buffers."""
        slot_ids = np.asarray(slots, dtype=np.int64)
        pos = self._positions(positions)
        rows = self._place(slot_ids, pos)
        width = self.width
        cross_rows, row_cross = self.cross.place(
            self._group_keys(slot_ids), slot_ids, rows, width, self.src_mask, self.src_len, self.cross_kv
        )  # fmt: skip
        # A row the step does not use writes just past its own entries (the last one, at the longest length:
        # a row that long is never stepped again, so that entry is never read).
        at = np.minimum(self.row_len, self.spec.max_target_len - 1)
        at[rows] = pos
        self._fit_length(int(at.max(initial=0)) + 1)
        feeds: Feeds = {
            "tokens": _scatter(width, rows, tokens, self.spec.pad_id, np.int64), "positions": at,
            "row_scores": _scatter(width, rows, ranking["row_scores"], 0, np.float32),
            "bias_ids": _scatter(width, rows, ranking["bias_ids"], 0, np.int64),
            "bias_values": _scatter(width, rows, ranking["bias_values"], 0, np.float32),
            "top_k": ranking["top_k"], "src_mask": self.cross.mask, "cross_rows": cross_rows, "row_cross": row_cross,
        }  # fmt: skip
        binding = self.decoder.io_binding()
        for name in wanted:
            binding.bind_output(name, "cpu")
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        fed = self.cross.fed()
        buffers = (*zip(self.past_names, self.present_names, [array[:width] for array in self.kv_store], strict=True),
                   *zip(self.cross_names, self.cross_present_names, fed, strict=True))  # fmt: skip
        for name, updated, buffer in buffers:  # the first rows of C-ordered arrays: contiguous, input and output
            binding.bind_cpu_input(name, buffer)
            binding.bind_output(updated, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
        size = self.kv_store[0][:width].size + fed[0].size  # what the step's memory grows with
        self.memory.run_bound(self.decoder, binding, size)
        outputs = [value.numpy() for value in binding.get_outputs()[: len(wanted)]]  # bound first; not the buffers
        self.stepped_last = np.zeros(width, dtype=bool)
        self.stepped_last[rows] = True
        self.row_len[rows] = pos + 1
        self.tgt_len[slot_ids] = pos + 1
        return [out[rows] for out in outputs]

    # -- rows -----------------------------------------------------------------------------------

    def _place(self, slot_ids: Ids, pos: Ids) -> Ids:
        """The row of every stepped slot, each holding exactly its first `pos` keys/values."""
        held = self.row_of_slot[slot_ids]
        used = held[held >= 0]
        idle = self.width - slot_ids.size  # rows left over once every stepped slot has one
        if idle > max(MIN_IDLE, self.width // IDLE_SHARE):
            self._compact(used, spare=slot_ids.size - used.size)  # free rows for the slots that join
        missing = self.row_of_slot[slot_ids] < 0
        if missing.any():
            self._rows_for(slot_ids[missing], reserved=self.row_of_slot[slot_ids[~missing]])
        rows = self.row_of_slot[slot_ids]
        self._rewind(rows, pos)
        return rows

    def _rows_for(self, slots: Ids, reserved: Ids) -> Ids:
        """A row for each slot (its own if it has one); new rows are zeroed, parked keys/values put back."""
        rows = self.row_of_slot[slots].copy()
        need = np.flatnonzero(rows < 0)
        if need.size:
            taken = self._free_rows(need.size, np.concatenate([reserved, rows[rows >= 0]]))
            for i, row in zip(need.tolist(), taken.tolist(), strict=True):
                self._take(row, int(slots[i]))
                rows[i] = row
        return rows

    def _free_rows(self, count: int, reserved: Ids) -> Ids:
        """`count` rows outside `reserved`: free ones first, then ones holding other slots (parked)."""
        candidates = np.ones(self.width, dtype=bool)
        candidates[reserved] = False
        free = np.flatnonzero(candidates & (self.row_slot == FREE))
        busy = np.flatnonzero(candidates & (self.row_slot != FREE))
        rows = np.concatenate([free, busy])[:count]
        for row in rows.tolist():
            if self.row_slot[row] != FREE:
                self._park(row)
        if rows.size < count:
            rows = np.concatenate([rows, self._grow(count - rows.size)])
        return rows

    def _take(self, row: int, slot: int) -> None:
        """Give `row` to `slot`, with the slot's parked keys/values if it has any."""
        self.row_len[row] = 0
        self.row_slot[row] = slot
        self.row_of_slot[slot] = row
        entries = self.parked.pop(slot, None)
        if entries is None:
            return
        n = entries[0].shape[1]
        if n >= self.kv_store[0].shape[2]:
            self._lay_out_kv(self.kv_store[0].shape[0], working_length(n + 1, self.spec.max_target_len))
        for array, kept in zip(self.kv_store, entries, strict=True):
            array[row, :, :n] = kept
        self.row_len[row] = n

    def _rewind(self, rows: Ids, pos: Ids) -> None:
        """A row stepped at `pos` attends to its first `pos` tokens: later ones are dropped (a re-stepped slot)."""
        short = np.flatnonzero(self.row_len[rows] < pos)
        if short.size:
            row, want = int(rows[short[0]]), int(pos[short[0]])
            raise RuntimeError(
                f"slot {int(self.row_slot[row])} stepped at position {want} holds {int(self.row_len[row])} tokens"
            )
        self.row_len[rows] = pos

    def _forget(self, slot: int) -> None:
        row = self.row_of_slot[slot]
        if row >= 0:
            self._free(int(row))
        self.parked.pop(slot, None)

    def _park(self, row: int) -> None:
        slot, n = int(self.row_slot[row]), int(self.row_len[row])
        self.parked[slot] = [array[row, :, :n].copy() for array in self.kv_store]
        self._free(row)

    def _free(self, row: int) -> None:
        """`row` holds no slot and no entries: an idle step writes at its entry 0, and it keeps no length the
        buffers must hold."""
        self.row_of_slot[self.row_slot[row]] = FREE
        self.row_slot[row] = FREE
        self.row_len[row] = 0

    # -- reshaping the batch --------------------------------------------------------------------

    def _compact(self, used: Ids, spare: int) -> None:
        """Keep only rows `used` (those already among the first len(used) stay where they are), then `spare` free
        rows; park other slots' rows."""
        for row in np.setdiff1d(np.flatnonzero(self.row_slot != FREE), used).tolist():
            self._park(row)
        self._select_rows(fill_holes(used), spare)
        self.row_of_slot[:] = FREE
        self.row_of_slot[self.row_slot[: used.size]] = np.arange(used.size)

    def _grow(self, count: int) -> Ids:
        """`count` new free rows at the end."""
        start = self.width
        self._select_rows(np.arange(start), count)
        return np.arange(start, start + count)

    def _select_rows(self, order: Ids, spare: int) -> None:
        """Keep rows `order` (new row i is old row order[i]), then `spare` free rows, moved within the buffers."""
        total = order.size + spare
        if total > self.kv_store[0].shape[0]:  # more rows than the buffers hold: new ones, the rows carried over
            self._lay_out_kv(total, self.kv_store[0].shape[2])
        moved = np.flatnonzero(order != np.arange(order.size))
        self._move_rows(order[moved], moved)
        self.row_len = _rows_then_spare(self.row_len, order, spare)
        self.row_slot = _rows_then_spare(self.row_slot, order, spare, FREE)
        self.stepped_last = _rows_then_spare(self.stepped_last, order, spare)

    def _move_rows(self, src: Ids, dst: Ids) -> None:
        """Row dst[i] of every buffer gets row src[i]'s entries (all sources read before any write)."""
        if not src.size:
            return
        n = int(self.row_len[src].max())
        for array in self.kv_store:
            array[dst, :, :n] = array[src, :, :n]

    def _fit_length(self, needed: int) -> None:
        """Buffers of at least `needed` entries per row: longer ones once a row needs them, shorter ones once the
        longest would use under 1 / BUFFER_SLACK of them."""
        length = self.kv_store[0].shape[2]
        if needed > length or BUFFER_SLACK * working_length(needed, self.spec.max_target_len) <= length:
            self._lay_out_kv(self.kv_store[0].shape[0], working_length(needed, self.spec.max_target_len))

    def _lay_out_kv(self, rows: int, length: int) -> None:
        """New (rows, H, length, Dh) buffers, each row of the batch carried over with its entries (at most
        `length` of them). Their memory becomes resident where written."""
        meta, old = self.metadata, self.kv_store
        shape = (rows, meta.n_heads, length, buffer_head_dim(meta.head_dim))
        self.kv_store = [untouched_zeros(shape, self.dtype) for _ in range(2 * self.n_layers)]
        n, width = min(length, int(self.row_len.max(initial=0))), self.width
        for new, array in zip(self.kv_store, old, strict=False):
            new[:width, :, :n] = array[:width, :, :n]

    def _group_keys(self, slot_ids: Ids) -> Ids:
        """Each slot's cross group: its source, which a sentence's beams share, where the step takes several
        queries per group; else the slot itself (its source key and slot number together)."""
        keys = self.source_key[slot_ids]
        return keys if self.metadata.cross_groups else keys * self.max_slots + slot_ids


def untouched_zeros(shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """Zeros in anonymous memory that becomes resident a 4 KB page at a time as it is written. numpy asks the
    kernel for 2 MB pages for large arrays, and a slot cache is mostly unwritten: its sources fill the first
    positions of each (max_source_len, Dh) block, which a 2 MB page would make resident whole."""
    count = int(np.prod(shape))
    memory = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize), flags=mmap.MAP_PRIVATE)
    return np.frombuffer(memory, dtype, count).reshape(shape)


def _rows_then_spare(array: np.ndarray, order: Ids, spare: int, fill: object = 0) -> np.ndarray:
    """Rows `order` of `array` followed by `spare` rows of `fill`, copied once into one new array."""
    out = np.empty((order.size + spare, *array.shape[1:]), dtype=array.dtype)
    np.take(array, order, axis=0, out=out[: order.size], mode="clip")  # "raise" would copy twice
    out[order.size :] = fill
    return out


def _scatter(width: int, rows: Ids, values: npt.ArrayLike, fill: object, dtype: type) -> np.ndarray:
    """A (width, ...) feed: row i of `values` at row rows[i], `fill` in rows the step does not use."""
    out: np.ndarray = np.full((width, *np.shape(values)[1:]), fill, dtype=dtype)
    out[rows] = values
    return out
