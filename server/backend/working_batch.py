"""`WorkingBatchRunner`: the caches in host memory, the self-attention keys/values kept as the decoder's working
batch (`--kv-cache working`: the CPU path, and the fallback wherever the captured step cannot run).

A slot cache would gather, at every step, the stepped rows' slots up to the longest position into a fresh
(B, H, P, Dh) feed, which the graph then copies again into its past + new `Concat`. This runner instead
feeds that Concat's output (the graph's `present_*`, (W, H, C + 1, Dh)) back as the next step's past,
untouched: a step whose rows stay where they are copies no keys or values at all.

The working batch has W rows and C columns. Row r holds one slot's keys/values, column c one step of
the batch; `keep[r, c]` says whether column c is one of row r's own tokens (a row that joined late, or
sat out a step, has columns that are not). Under continuous batching rows come and go every step:
- A slot the step needs but no row holds (a new sentence, a beam copy's destination) takes a free row:
  one whose slot was encoded again, else one the step does not use (its keys/values are parked), else
  a new row at the end. A taken row is zeroed, so a NaN or inf a former occupant left cannot reach it
  through a masked weight (0 x NaN is NaN).
- Rows the step does not use are still computed (their results are dropped) until a compaction
  gathers the stepped rows into a smaller batch, and with them only the columns some stepped row
  keeps. It runs when more than a quarter of the rows sit idle, or leading columns no stepped row
  keeps have piled up: one copy every several steps instead of one per step.
- A beam reorder (`copy_slots`) copies the moved rows within the batch.
- Keys/values of a slot whose row was reclaimed are parked per slot and put back into a row if the
  slot is stepped or copied again, so every slot keeps its cache as the `Runner` protocol promises.
The cross-attention feed is kept in row order the same way: a row's source keys/values are copied
from the slot caches ((max_slots, H, max_source_len, Dh) per cache, resident only where written) only when the
row's source changes;
along the source axis it holds the longest source stepped, rounded up to LENGTH_STEP. It lives in arrays of
max_slots rows (the feed is their first W), kept from one source length to the next: a batch that grows
copies no source keys/values, a compaction moves only the rows whose place changes, and no step writes
into freshly mapped memory. Every block written into
the caches is checked, so a slot is zeroed for its next sentence only if a NaN or inf went in.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import numpy.typing as npt

from model.directory import DECODER_FILE, MetadataError
from server.backend.runtime import Feeds, OnnxRunner, kv_names
from server.core.runner import EncodeItem

FREE = -1  # a row that holds no slot; a slot that no row holds
STALE = -2  # a row whose cross keys/values must be fetched again
IDLE_SHARE = 4  # compact once more than 1 / IDLE_SHARE of the rows sit idle ...
MIN_IDLE = 4  # ... and at least this many
TRIM_COLUMNS = 16  # compact once this many leading columns belong to no stepped row
LENGTH_STEP = 16  # the cross feed's source axis grows and shrinks in steps of this many entries
SHRINK_SLACK = 2 * LENGTH_STEP  # shrink once this many entries past the longest source go unused
CROSS_SLACK = 4  # the cross feed's buffers are given back once a layout would use under a quarter of them

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
        if not set(self.present_names) <= {arg.name for arg in self.decoder.get_outputs()}:
            raise MetadataError(
                f"{variant_dir / DECODER_FILE} predates the present_* outputs the working-batch cache feeds "
                "back: export again with python -m export"
            )
        meta = self.metadata
        empty = np.zeros((0, meta.n_heads, 0, meta.head_dim), self.dtype)
        self.present: list[np.ndarray] = [empty] * (2 * self.n_layers)  # (W, H, C, Dh) per cache
        self.keep = np.zeros((0, 0), dtype=bool)  # (W, C): column c is one of row r's tokens
        self.row_len = np.zeros(0, dtype=np.int64)  # (W,) how many columns each row keeps
        self.row_slot = np.zeros(0, dtype=np.int64)  # (W,) the slot each row holds, or FREE
        self.row_of_slot = np.full(max_slots, FREE, dtype=np.int64)
        self.parked: dict[int, list[np.ndarray]] = {}  # slot -> its kept (H, n, Dh) per cache
        self.cross_buffers: list[np.ndarray] = []  # flat, one per cache: the cross feed's memory
        self.cross_store: list[np.ndarray] = []  # (max_slots, H, S, Dh) views of them, the first W rows fed
        length = working_length(1, self.spec.max_source_len)
        self._lay_out_cross(length, max_slots)
        self.cross_mask = np.zeros((0, length), dtype=bool)  # (W, S)
        self.row_source = np.zeros(0, dtype=np.int64)  # (W,) the source key whose cross rows a row holds
        self.stepped_last = np.zeros(0, dtype=bool)  # (W,) the rows the last step used

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
        for array in self.present:
            array[dst_rows] = array[src_rows]  # the right side is read whole before any write
        self.keep[dst_rows] = self.keep[src_rows]
        self.row_len[dst_rows] = self.row_len[src_rows]

    def _step(
        self, slots: list[int], tokens: list[int], positions: list[int], ranking: Feeds, wanted: tuple[str, ...]
    ) -> list[np.ndarray]:
        """Feed one token per row against the working batch; its present keys/values become the next past."""
        slot_ids = np.asarray(slots, dtype=np.int64)
        pos = self._positions(positions)
        rows = self._place(slot_ids, pos)
        self._fit_cross(slot_ids, rows, int(self.src_len[slot_ids].max()))
        width = self.width
        feeds: Feeds = {
            "tokens": _scatter(width, rows, tokens, self.spec.pad_id, np.int64),
            "positions": _scatter(width, rows, pos, 0, np.int64),
            "row_scores": _scatter(width, rows, ranking["row_scores"], 0, np.float32),
            "bias_ids": _scatter(width, rows, ranking["bias_ids"], 0, np.int64),
            "bias_values": _scatter(width, rows, ranking["bias_values"], 0, np.float32),
            "top_k": ranking["top_k"], "past_keep": self.keep, "src_mask": self.cross_mask,
        }  # fmt: skip
        cross = [array[:width] for array in self.cross_store]
        feeds |= dict(zip(self.cross_names, cross, strict=True))
        feeds |= dict(zip(self.past_names, self.present, strict=True))
        size = self.present[0].size + cross[0].size  # what the step's memory grows with
        outputs = self.memory.run(self.decoder, [*wanted, *self.present_names], feeds, size)
        self.stepped_last = np.zeros(width, dtype=bool)
        self.stepped_last[rows] = True
        self.present = outputs[len(wanted) :]
        self.keep = np.concatenate([self.keep, self.stepped_last[:, None]], axis=1)
        self.row_len[rows] += 1
        self.tgt_len[slot_ids] = pos + 1
        return [out[rows] for out in outputs[: len(wanted)]]

    # -- rows -----------------------------------------------------------------------------------

    def _place(self, slot_ids: Ids, pos: Ids) -> Ids:
        """The row of every stepped slot, each holding exactly its first `pos` keys/values."""
        held = self.row_of_slot[slot_ids]
        used = held[held >= 0]
        idle = self.width - slot_ids.size  # rows left over once every stepped slot has one
        if idle > max(MIN_IDLE, self.width // IDLE_SHARE) or self._dead_columns(used) >= TRIM_COLUMNS:
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
        """Zero `row` and give it to `slot`, with the slot's parked keys/values if it has any."""
        for array in self.present:
            array[row] = 0
        self.keep[row] = False
        self.row_len[row] = 0
        self.row_slot[row] = slot
        self.row_source[row] = STALE
        self.row_of_slot[slot] = row
        entries = self.parked.pop(slot, None)
        if entries is None:
            return
        n = entries[0].shape[1]
        if n > self.keep.shape[1]:
            self._pad_columns(n - self.keep.shape[1])
        for array, kept in zip(self.present, entries, strict=True):
            array[row, :, -n:] = kept
        self.keep[row, -n:] = True
        self.row_len[row] = n

    def _rewind(self, rows: Ids, pos: Ids) -> None:
        """A row stepped at `pos` attends to its first `pos` tokens: drop later ones (a re-stepped slot)."""
        longer = np.flatnonzero(self.row_len[rows] != pos)
        for i in longer.tolist():
            row, want = int(rows[i]), int(pos[i])
            if self.row_len[row] < want:
                raise RuntimeError(
                    f"slot {int(self.row_slot[row])} stepped at position {want} holds {int(self.row_len[row])} tokens"
                )
            self.keep[row, np.flatnonzero(self.keep[row])[want:]] = False
            self.row_len[row] = want

    def _forget(self, slot: int) -> None:
        row = self.row_of_slot[slot]
        if row >= 0:
            self.row_slot[row] = FREE
            self.row_of_slot[slot] = FREE
        self.parked.pop(slot, None)

    def _park(self, row: int) -> None:
        slot = int(self.row_slot[row])
        columns = np.flatnonzero(self.keep[row])
        self.parked[slot] = [array[row][:, columns] for array in self.present]
        self.row_of_slot[slot] = FREE
        self.row_slot[row] = FREE

    # -- reshaping the batch --------------------------------------------------------------------

    def _dead_columns(self, used: Ids) -> int:
        """Leading columns that no row in `used` keeps."""
        if not used.size or not self.keep.shape[1]:
            return 0
        kept = np.flatnonzero(self.keep[used].any(axis=0))
        return int(kept[0]) if kept.size else self.keep.shape[1]

    def _compact(self, used: Ids, spare: int) -> None:
        """Keep only rows `used` (those already among the first len(used) stay where they are) and the columns
        they keep, then `spare` free rows; park other slots' rows."""
        for row in np.setdiff1d(np.flatnonzero(self.row_slot != FREE), used).tolist():
            self._park(row)
        self._select_rows(_fill_holes(used), self._dead_columns(used), spare)
        self.row_of_slot[:] = FREE
        self.row_of_slot[self.row_slot[: used.size]] = np.arange(used.size)

    def _grow(self, count: int) -> Ids:
        """`count` new zeroed rows at the end."""
        start = self.width
        self._select_rows(slice(None), 0, count)
        return np.arange(start, start + count)

    def _select_rows(self, rows: Ids | slice, first: int, spare: int) -> None:
        """Keep `rows` and the columns from `first` on, then `spare` free rows: new arrays, except the cross
        feed's, whose rows move within their arrays."""
        order = np.arange(self.width)[rows]  # new row i is old row order[i]
        self._select_cross(order, spare)
        self.present = [_rows_then_spare(array[:, :, first:], order, spare) for array in self.present]
        self.keep = _rows_then_spare(self.keep[:, first:], order, spare)
        self.row_len = _rows_then_spare(self.row_len, order, spare)
        self.row_slot = _rows_then_spare(self.row_slot, order, spare, FREE)
        self.row_source = _rows_then_spare(self.row_source, order, spare, STALE)
        self.stepped_last = _rows_then_spare(self.stepped_last, order, spare)

    def _select_cross(self, order: Ids, spare: int) -> None:
        """The cross feed's rows `order`, then `spare` zeroed rows (masked whole), moved within its arrays."""
        total = order.size + spare
        if total > self.cross_store[0].shape[0]:  # wider than max_slots rows: new buffers, the rows carried over
            old_store, self.cross_buffers = self.cross_store, []
            self._lay_out_cross(old_store[0].shape[2], total)
            for new, old in zip(self.cross_store, old_store, strict=True):
                np.take(old, order, axis=0, out=new[: order.size], mode="clip")
        else:
            moved = np.flatnonzero(order != np.arange(order.size))
            for array in self.cross_store:
                array[moved] = array[order[moved]]  # the right side is read whole before any write
        for array in self.cross_store:
            array[order.size : total] = 0  # rows past the batch hold anything; a zeroed row's attention is finite
        self.cross_mask = _rows_then_spare(self.cross_mask, order, spare)

    def _pad_columns(self, count: int) -> None:
        """`count` empty columns in front, for a parked slot longer than the batch."""
        self.present = [
            np.concatenate([np.zeros((a.shape[0], a.shape[1], count, a.shape[3]), a.dtype), a], axis=2)
            for a in self.present
        ]
        self.keep = np.concatenate([np.zeros((self.width, count), dtype=bool), self.keep], axis=1)

    def _fit_cross(self, slot_ids: Ids, rows: Ids, src_len: int) -> None:
        """Resize the source axis if need be; fetch cross rows whose source changed from the slot caches."""
        wanted = working_length(src_len, self.spec.max_source_len)
        length = self.cross_mask.shape[1]
        if wanted > length or length - wanted >= SHRINK_SLACK:
            self._resize_cross(wanted)
        stale = self.row_source[rows] != self.source_key[slot_ids]
        if stale.any():
            s, r, length = slot_ids[stale], rows[stale], self.cross_mask.shape[1]
            for array, cache in zip(self.cross_store, self.cross_kv, strict=True):
                array[r] = cache[s, :, :length]
            self.cross_mask[r] = self.src_mask[s, :length]
            self.row_source[r] = self.source_key[s]

    def _resize_cross(self, length: int) -> None:
        """A new source length: every row zeroed and marked to be fetched again (the stepped ones are, next)."""
        self._lay_out_cross(length, self.cross_store[0].shape[0])
        for array in self.cross_store:
            array[: self.width] = 0
        self.cross_mask = np.zeros((self.width, length), dtype=bool)
        self.row_source[:] = STALE

    def _lay_out_cross(self, length: int, rows: int) -> None:
        """The cross feed's arrays as (rows, H, length, Dh) views of flat buffers that keep their memory from
        one length to the next (fresh memory costs a page fault per page first written); new buffers only
        when the layout outgrows them or would use under 1 / CROSS_SLACK of them. The values are left as they
        were: every row the batch holds is written before it is fed."""
        meta = self.metadata
        size = rows * meta.n_heads * length * meta.head_dim
        held = self.cross_buffers[0].size if self.cross_buffers else 0
        if size > held or CROSS_SLACK * size < held:
            self.cross_buffers = [np.empty(size, self.dtype) for _ in range(2 * self.n_layers)]
        self.cross_store = [b[:size].reshape(rows, meta.n_heads, length, meta.head_dim) for b in self.cross_buffers]


def untouched_zeros(shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """Zeros in anonymous memory that becomes resident a 4 KB page at a time as it is written. numpy asks the
    kernel for 2 MB pages for large arrays, and a slot cache is mostly unwritten: its sources fill the first
    positions of each (max_source_len, Dh) block, which a 2 MB page would make resident whole."""
    count = int(np.prod(shape))
    memory = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize), flags=mmap.MAP_PRIVATE)
    return np.frombuffer(memory, dtype, count).reshape(shape)


def working_length(needed: int, limit: int) -> int:
    """The cross feed's source length for a longest source of `needed`: a multiple of LENGTH_STEP, at most `limit`."""
    return min(limit, max(LENGTH_STEP, -(-needed // LENGTH_STEP) * LENGTH_STEP))


def _fill_holes(used: Ids) -> Ids:
    """`used` in the order that moves the fewest rows into the first used.size places: a row already there
    stays, the rows beyond them fill the places left free."""
    n = used.size
    order = np.arange(n)
    staying = np.zeros(n, dtype=bool)
    staying[used[used < n]] = True
    order[~staying] = used[used >= n]
    return order


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
