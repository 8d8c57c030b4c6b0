"""`CrossGroups`: the working batch's cross-attention feed, one copy of each source the step reads.

A cross group is a source and the rows that attend to it: the K beams of a sentence are one group, fed as K queries
against one copy of its cross keys and values (`export.builder.decoder`), where a feed in row order would read
every source K times. Where the step takes one query per group (`ExportMetadata.cross_groups` false) every row is
its own group: the runner keys groups by slot instead of by source, and the same code serves both.

The feed is kept from one step to the next like the rows (`server.backend.working_batch`): a group's entries are
copied from the slot caches only when a new source is stepped, groups no step reads are reused for new sources,
and the groups are compacted once more than a quarter sit idle. Along the source axis the feed holds the longest
source stepped plus G - 1 entries (the kernel writes G entries from a group's last one on), rounded up to
LENGTH_STEP; a group reads its own source entries only, so nothing past them needs cleaning.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FREE = -1  # a group that holds no source
LENGTH_STEP = 16  # the feed's source axis grows and shrinks in steps of this
SHRINK_SLACK = 2 * LENGTH_STEP  # the feed shrinks once this many entries past the longest source go unused
IDLE_SHARE = 4  # compact once more than 1 / IDLE_SHARE of the groups sit idle ...
MIN_IDLE = 4  # ... and at least this many
BUFFER_SLACK = 4  # buffers are given back once a layout would use under a quarter of them

Ids = npt.NDArray[np.int64]


class CrossGroups:
    """The cross feed: (N, H, S, Dh) arrays per cache (the first N rows of buffers kept between steps), the (N, S)
    source mask, and the key each group holds."""

    def __init__(self, caches: int, heads: int, head_dim: int, dtype: type, max_source_len: int, rows: int) -> None:
        self.caches, self.heads, self.head_dim, self.dtype = caches, heads, head_dim, dtype
        self.max_source_len = max_source_len
        self.buffers: list[np.ndarray] = []  # flat, one per cache: the feed's memory
        self.store: list[np.ndarray] = []  # (rows, H, S, Dh) views of them, the first N fed
        length = working_length(1, max_source_len)
        self._lay_out(length, rows)
        self.key = np.zeros(0, dtype=np.int64)  # (N,) the source key each group holds, or FREE
        self.mask = np.zeros((0, length), dtype=bool)  # (N, S)

    @property
    def width(self) -> int:
        return int(self.key.size)

    def fed(self) -> list[np.ndarray]:
        """The arrays the step binds, each group's first (as input, and as the output written back)."""
        return [array[: self.width] for array in self.store]

    def place(
        self, keys: Ids, slots: Ids, rows: Ids, width: int, src_mask: np.ndarray, src_len: Ids, caches: list[np.ndarray]
    ) -> tuple[Ids, Ids]:
        """Groups for the stepped rows: row i (slot slots[i], group key keys[i]) at `rows[i]` of a batch `width`
        rows wide. Returns cross_rows (N, G), each group's rows (a group with fewer than G repeats its first; a
        group no row steps names row 0), and row_cross (width,), each row's place n x G + g (0 for rows not
        stepped). The slot caches `caches` (slot, H, max_source_len, Dh) and `src_mask` give new groups' entries."""
        unique, first, inverse, counts = np.unique(keys, return_index=True, return_inverse=True, return_counts=True)
        size = int(counts.max())
        self._fit_length(int(src_len[slots].max()) + size - 1, size)
        # The kernel writes G entries from every fed group's last one on: an idle group too long for that is let go.
        overlong = self.mask.sum(axis=1) + size - 1 > self.mask.shape[1]
        self.key[overlong], self.mask[overlong] = FREE, False
        group = self._groups_for(unique, slots[first], src_mask, src_len, caches)
        order = np.argsort(inverse, kind="stable")  # stepped rows by group, in stepping order within one
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        rank = np.arange(order.size) - starts[inverse[order]]
        member = group[inverse[order]]
        leader = np.zeros(self.width, dtype=np.int64)
        leader[group] = rows[order[starts]]
        cross_rows = np.repeat(leader[:, None], size, axis=1)
        cross_rows[member, rank] = rows[order]
        row_cross = np.zeros(width, dtype=np.int64)
        row_cross[rows[order]] = member * size + rank
        return cross_rows, row_cross

    def _groups_for(self, unique: Ids, slots: Ids, src_mask: np.ndarray, src_len: Ids, caches: list[np.ndarray]) -> Ids:
        """The group of each key in `unique` (slot `slots[i]` holds key i's source): held ones where they are, new
        ones in groups no key of this step holds (compacted first when many sit idle), their entries fetched."""
        position = {key: index for index, key in enumerate(self.key.tolist()) if key != FREE}
        group = np.asarray([position.get(key, FREE) for key in unique.tolist()], dtype=np.int64)
        held = group >= 0
        idle = self.width - int(held.sum())
        if idle > max(MIN_IDLE, self.width // IDLE_SHARE):
            group[held] = self._compact(group[held])
        missing = np.flatnonzero(~held)
        if missing.size:
            taken = self._free_groups(missing.size, group[held])
            group[missing] = taken
            self._fetch(taken, unique[missing], slots[missing], src_mask, src_len, caches)
        return group

    def _free_groups(self, count: int, reserved: Ids) -> Ids:
        """`count` groups outside `reserved`, idle ones first, then new ones at the end."""
        candidates = np.ones(self.width, dtype=bool)
        candidates[reserved] = False
        free = np.flatnonzero(candidates)[:count]
        if free.size == count:
            return free
        start, extra = self.width, count - free.size
        if self.width + extra > self.store[0].shape[0]:
            self._lay_out(self.mask.shape[1], self.width + extra, carry=True)
        self.key = np.concatenate([self.key, np.full(extra, FREE, dtype=np.int64)])
        self.mask = np.concatenate([self.mask, np.zeros((extra, self.mask.shape[1]), dtype=bool)])
        return np.concatenate([free, np.arange(start, start + extra)])

    def _fetch(
        self, groups: Ids, keys: Ids, slots: Ids, src_mask: np.ndarray, src_len: Ids, caches: list[np.ndarray]
    ) -> None:
        """Groups `groups` take the sources of `slots` (keys `keys`) from the slot caches."""
        length = self.mask.shape[1]
        self.mask[groups] = False
        self.mask[groups, : min(length, src_mask.shape[1])] = src_mask[slots, :length]
        n = int(src_len[slots].max())  # the longest of their sources: all the step reads
        for array, cache in zip(self.store, caches, strict=True):
            array[groups, :, :n] = cache[slots, :, :n]
        self.key[groups] = keys

    def _compact(self, kept: Ids) -> Ids:
        """Keep only groups `kept` (those already among the first kept.size stay), moved within the arrays; returns
        each kept group's new place."""
        order = fill_holes(kept)
        moved = np.flatnonzero(order != np.arange(order.size))
        for array in self.store:
            array[moved] = array[order[moved]]  # the right side is read whole before any write
        self.key, self.mask = self.key[order], self.mask[order]
        place = np.empty(int(kept.max(initial=-1)) + 1, dtype=np.int64)
        place[order] = np.arange(order.size)
        return place[kept]

    def _fit_length(self, needed: int, size: int) -> None:
        """A source axis of at least `needed` entries: longer once a source needs it, shorter once the longest
        would leave SHRINK_SLACK unused. A new length refetches every group (they are marked free)."""
        wanted = working_length(needed, self.max_source_len + size - 1)
        length = self.mask.shape[1]
        if wanted > length or length - wanted >= SHRINK_SLACK:
            self._lay_out(wanted, self.store[0].shape[0])
            self.key = np.zeros(0, dtype=np.int64)
            self.mask = np.zeros((0, wanted), dtype=bool)

    def _lay_out(self, length: int, rows: int, carry: bool = False) -> None:
        """The feed's arrays as (rows, H, length, Dh) views of flat buffers that keep their memory from one layout
        to the next (fresh memory costs a page fault per page first written); new buffers only when the layout
        outgrows them or would use under 1 / BUFFER_SLACK of them. With `carry` the groups held keep their
        entries; otherwise every value is left as it was (each group is written before it is fed)."""
        size = rows * self.heads * length * self.head_dim
        held = self.buffers[0].size if self.buffers else 0
        old = self.store
        if size > held or BUFFER_SLACK * size < held:
            self.buffers = [np.empty(size, self.dtype) for _ in range(self.caches)]
        self.store = [buffer[:size].reshape(rows, self.heads, length, self.head_dim) for buffer in self.buffers]
        if carry:
            for new, array in zip(self.store, old, strict=True):
                new[: self.width] = array[: self.width]


def working_length(needed: int, limit: int) -> int:
    """The feed's source length for `needed` entries: a multiple of LENGTH_STEP, at most `limit`."""
    return min(limit, max(LENGTH_STEP, -(-needed // LENGTH_STEP) * LENGTH_STEP))


def fill_holes(used: Ids) -> Ids:
    """`used` in the order that moves the fewest entries into the first used.size places: one already there
    stays, the ones beyond them fill the places left free."""
    n = used.size
    order = np.arange(n)
    staying = np.zeros(n, dtype=bool)
    staying[used[used < n]] = True
    order[~staying] = used[used >= n]
    return order
