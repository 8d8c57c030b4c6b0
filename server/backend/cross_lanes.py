"""The decoder's cross-attention feed kept from step to step, so that only rows that changed are copied.

Under continuous batching the rows of a step change at almost every step (sentences finish, others
join), and gathering every row's cross keys/values from the slot caches again was the largest copy of
a served step. `CrossLanes` keeps that feed in preallocated arrays whose first n lanes are the step's
n rows: a lane keeps its source's keys/values while some row of that source is stepped, a lane past n
that is still needed moves into a free lane below n (compaction), and only rows of sources no lane
holds are copied from the slots. The decoder then reads `arrays[i][:n]`, a contiguous view.

Lanes hold sources, not slots: the rows of one beam share one source, and a beam reorder moves no cross
keys/values at all. Source keys are unique per encoded source (the runner never reuses one), so a lane's
contents are never stale. Along the source axis the arrays hold the longest source stepped, rounded
up to LENGTH_STEP; each row attends past its own source only to masked zeros.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

LENGTH_STEP = 16  # the source axis grows and shrinks in steps of this many entries
FREE = -1  # a lane that holds no source; slots that hold none have this key too, and never share lanes
SHRINK_SLACK = 2 * LENGTH_STEP  # shrink once this many entries past the longest source go unused

# fetch(slots, lanes, length): copy the slot caches' first `length` entries of `slots` into `lanes`
Fetch = Callable[[npt.NDArray[np.int64], npt.NDArray[np.int64], int], None]


def working_length(needed: int, limit: int) -> int:
    return min(limit, max(LENGTH_STEP, -(-needed // LENGTH_STEP) * LENGTH_STEP))


class CrossLanes:
    """`count` arrays of (lanes, H, S, Dh) and the (lanes, S) source mask, in step-row order."""

    def __init__(self, count: int, lanes: int, heads: int, head_dim: int, max_len: int, dtype: type) -> None:
        self.max_len = max_len
        self._shape = (lanes, heads, 0, head_dim)
        self._dtype = dtype
        self.arrays: list[np.ndarray] = [np.zeros(self._shape, dtype) for _ in range(count)]
        self.mask = np.zeros((lanes, 0), dtype=bool)
        self.sources = np.full(lanes, FREE, dtype=np.int64)  # the source key each lane holds
        self._resize(LENGTH_STEP)

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def place(self, keys: npt.NDArray[np.int64], slots: npt.NDArray[np.int64], src_len: int, fetch: Fetch,
              fetch_mask: Callable[[npt.NDArray[np.int64], int], np.ndarray]) -> npt.NDArray[np.int64]:  # fmt: skip
        """Fill lanes 0 .. n-1 for the n rows with source `keys[i]` in slot `slots[i]`; return each row's lane.

        Copies only the rows whose source no kept lane holds, and the kept lanes that move below n. If a
        copy raises, every lane is forgotten: a half-written lane must not vouch for its old source.
        """
        try:
            return self._place(keys, slots, src_len, fetch, fetch_mask)
        except BaseException:
            self.sources[:] = FREE
            raise

    def _place(self, keys: npt.NDArray[np.int64], slots: npt.NDArray[np.int64], src_len: int, fetch: Fetch,
               fetch_mask: Callable[[npt.NDArray[np.int64], int], np.ndarray]) -> npt.NDArray[np.int64]:  # fmt: skip
        n = keys.size
        wanted = working_length(src_len, self.max_len)
        if wanted > self.length or self.length - wanted >= SHRINK_SLACK:
            self._resize(wanted)
            self.sources[:] = FREE  # resized arrays are refilled below; cheaper than keeping lanes across
        needed: dict[int, list[int]] = defaultdict(list)  # source key -> its rows
        unknown: list[int] = []  # rows of slots that hold no encoded source: copied every time
        for row, key in enumerate(keys.tolist()):
            (needed[key] if key >= 0 else unknown).append(row)
        held: dict[int, list[int]] = defaultdict(list)  # source key -> lanes kept for it
        free_below: list[int] = []
        movers: list[int] = []  # kept lanes at n or past it
        for lane, key in enumerate(self.sources.tolist()):
            if key in needed and len(held[key]) < len(needed[key]):
                held[key].append(lane)
                if lane >= n:
                    movers.append(lane)
            elif lane < n:
                free_below.append(lane)
        free_below.reverse()  # pop() hands out the lowest
        self._compact(movers, free_below, held)
        lane_of_row = np.empty(n, dtype=np.int64)
        fresh_rows: list[int] = []
        fresh_lanes: list[int] = []
        for key, rows in needed.items():
            lanes = held[key]
            for i, row in enumerate(rows):
                if i < len(lanes):
                    lane_of_row[row] = lanes[i]
                else:
                    lane = free_below.pop()
                    lane_of_row[row] = lane
                    fresh_rows.append(row)
                    fresh_lanes.append(lane)
        for row in unknown:
            lane = free_below.pop()
            lane_of_row[row] = lane
            fresh_rows.append(row)
            fresh_lanes.append(lane)
        if fresh_rows:
            rows_array, lanes_array = np.asarray(fresh_rows), np.asarray(fresh_lanes)
            fetch(slots[rows_array], lanes_array, self.length)
            self.mask[lanes_array] = fetch_mask(slots[rows_array], self.length)
            self.sources[lanes_array] = np.maximum(keys[rows_array], FREE)
        self.sources[n:] = FREE
        return lane_of_row

    def feeds(self, n: int) -> tuple[list[np.ndarray], np.ndarray]:
        """The first n lanes: contiguous views of every array, and the source mask."""
        return [array[:n] for array in self.arrays], self.mask[:n]

    def _compact(self, movers: list[int], free_below: list[int], held: dict[int, list[int]]) -> None:
        """Move kept lanes at n or past it into free lanes below n, rewriting `held` to the new lanes."""
        if not movers:
            return
        destinations = [free_below.pop() for _ in movers]
        src, dst = np.asarray(movers), np.asarray(destinations)
        for array in self.arrays:
            array[dst] = array[src]
        self.mask[dst] = self.mask[src]
        self.sources[dst] = self.sources[src]
        moved = dict(zip(movers, destinations, strict=True))
        for key, lanes in held.items():
            held[key] = [moved.get(lane, lane) for lane in lanes]

    def _resize(self, length: int) -> None:
        lanes, heads, _, head_dim = self._shape
        self.arrays = [np.zeros((lanes, heads, length, head_dim), self._dtype) for _ in self.arrays]
        self.mask = np.zeros((lanes, length), dtype=bool)
