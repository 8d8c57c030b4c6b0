"""CrossLanes: the kept cross-attention feed equals a fresh gather at every step, and copies only what changed."""

from __future__ import annotations

import numpy as np
import pytest

from server.backend.cross_lanes import LENGTH_STEP, SHRINK_SLACK, CrossLanes

SLOTS, HEADS, DIM, MAX_LEN = 12, 2, 3, 80


class SlotCaches:
    """Cross caches per slot, each slot holding the keys/values of the source key written into it."""

    def __init__(self) -> None:
        self.values = np.zeros((SLOTS, HEADS, MAX_LEN, DIM), np.float32)
        self.mask = np.zeros((SLOTS, MAX_LEN), dtype=bool)
        self.key = np.full(SLOTS, -1, dtype=np.int64)
        self.fetched_rows = 0

    def write(self, slot: int, key: int, length: int) -> None:
        self.values[slot] = 0
        self.values[slot, :, :length] = key + 1 + np.arange(length)[None, :, None] / 100
        self.mask[slot] = False
        self.mask[slot, :length] = True
        self.key[slot] = key

    def fetch(self, slots: np.ndarray, lanes: np.ndarray, length: int, lanes_obj: CrossLanes) -> None:
        self.fetched_rows += slots.size
        for array in lanes_obj.arrays:
            array[lanes] = self.values[slots, :, :length]


def place(lanes: CrossLanes, caches: SlotCaches, slots: list[int], src_len: int) -> np.ndarray:
    rows = np.asarray(slots, dtype=np.int64)
    return lanes.place(
        caches.key[rows], rows, src_len,
        lambda s, lane, length: caches.fetch(s, lane, length, lanes),
        lambda s, length: caches.mask[s, :length],
    )  # fmt: skip


def assert_feed_equals_gather(lanes: CrossLanes, caches: SlotCaches, slots: list[int], lane_of_row: np.ndarray) -> None:
    n = len(slots)
    assert sorted(lane_of_row.tolist()) == list(range(n))  # a permutation of the first n lanes
    arrays, mask = lanes.feeds(n)
    length = mask.shape[1]
    for array in arrays:
        assert array.flags.c_contiguous
        np.testing.assert_array_equal(array[lane_of_row], caches.values[slots, :, :length])
    np.testing.assert_array_equal(mask[lane_of_row], caches.mask[slots, :length])


def test_a_random_schedule_of_joins_leaves_and_beams_feeds_what_a_gather_would() -> None:
    rng = np.random.default_rng(0)
    caches, lanes = SlotCaches(), CrossLanes(2, SLOTS, HEADS, DIM, MAX_LEN, np.float32)
    next_key, lengths = 0, {}
    for step in range(300):
        for slot in rng.choice(SLOTS, size=int(rng.integers(0, 3)), replace=False):  # new sentences take slots
            lengths[next_key] = int(rng.integers(1, MAX_LEN if step % 50 < 5 else 20))
            caches.write(int(slot), next_key, lengths[next_key])
            next_key += 1
        if rng.random() < 0.3:  # a beam reorder: one slot becomes a copy of another
            src, dst = rng.choice(SLOTS, size=2, replace=False)
            for array in (caches.values, caches.mask, caches.key):
                array[dst] = array[src]
        stepped = [int(s) for s in rng.permutation(SLOTS)[: int(rng.integers(1, SLOTS + 1))] if caches.key[s] >= 0]
        if not stepped:
            continue
        src_len = max(lengths[int(caches.key[s])] for s in stepped)
        assert_feed_equals_gather(lanes, caches, stepped, place(lanes, caches, stepped, src_len))
        assert lanes.length >= src_len and lanes.length - src_len < SHRINK_SLACK + LENGTH_STEP


def test_only_rows_of_new_sources_are_copied() -> None:
    caches, lanes = SlotCaches(), CrossLanes(2, SLOTS, HEADS, DIM, MAX_LEN, np.float32)
    for slot, key in enumerate([7, 7, 7, 7, 8, 9]):  # a beam of 4 and two greedy sentences
        caches.write(slot, key, 10)
    place(lanes, caches, [0, 1, 2, 3, 4, 5], 10)
    assert caches.fetched_rows == 6
    place(lanes, caches, [3, 1, 0, 2, 5, 4], 10)  # a reorder within the beam: nothing moves
    assert caches.fetched_rows == 6
    caches.write(6, 10, 9)  # sentence 8 finishes, sentence 10 joins: one row copied
    lane_of_row = place(lanes, caches, [0, 1, 2, 3, 5, 6], 10)
    assert caches.fetched_rows == 7
    assert_feed_equals_gather(lanes, caches, [0, 1, 2, 3, 5, 6], lane_of_row)
    lane_of_row = place(lanes, caches, [0, 5, 6], 10)  # the beam shrinks to one row; the rest compact
    assert caches.fetched_rows == 7
    assert_feed_equals_gather(lanes, caches, [0, 5, 6], lane_of_row)


def test_a_copy_that_raises_forgets_every_lane() -> None:
    caches, lanes = SlotCaches(), CrossLanes(2, SLOTS, HEADS, DIM, MAX_LEN, np.float32)
    caches.write(0, 1, 5)
    caches.write(1, 2, 5)
    place(lanes, caches, [0], 5)

    def broken(slots: np.ndarray, lane: np.ndarray, length: int) -> None:
        lanes.arrays[0][lane] = np.nan  # half written, then fails
        raise MemoryError

    with pytest.raises(MemoryError):
        lanes.place(np.asarray([1, 2]), np.asarray([0, 1]), 5, broken, lambda s, length: caches.mask[s, :length])
    assert (lanes.sources == -1).all()
    assert_feed_equals_gather(lanes, caches, [0, 1], place(lanes, caches, [0, 1], 5))
