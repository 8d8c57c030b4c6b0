"""Giving memory back once the largest shapes have passed: a session's CPU arena, then glibc's free heap.

onnxruntime's CPU arena keeps every region it ever grew to for the life of the session, and glibc keeps
freed heap pages until asked, so without a release the resident set steps up at each new largest shape
the traffic brings (every slot, the longest source, the longest output) and stays there. `ArenaRelease`
watches the size of what each session of a runner runs on; once a session's call is at most
1 / RELEASE_RATIO of its largest since its last release, that call runs with the arena's shrinkage on
(regions left wholly free at the end of the run go back) and glibc's heap is trimmed after it.

A release costs its page faults again when the shapes grow back, and ordinary traffic swings between
one row and every slot all the time, so a session releases at most once per RELEASE_SPACING calls of
the runner's sessions: rare enough to cost nothing measurable, soon enough that a spike's memory comes
back within a few seconds of busy decoding after the shapes fall.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import onnxruntime as ort

RELEASE_RATIO = 2  # release once a call's size is at most 1 / RELEASE_RATIO of the largest since the last
RELEASE_SPACING = 256  # calls of the runner's sessions between two releases of one session
SHRINK_CPU_ARENA = ("memory.enable_memory_arena_shrinkage", "cpu:0")  # onnxruntime's run config entry


class ArenaRelease:
    """Runs a runner's sessions, each releasing its memory when its calls have shrunk (see above)."""

    def __init__(self, ratio: int = RELEASE_RATIO, spacing: int = RELEASE_SPACING) -> None:
        self.ratio, self.spacing = ratio, spacing
        self.calls = 0  # calls of every session so far
        self.releases = 0  # calls run with a release
        self.largest: dict[ort.InferenceSession, int] = {}  # the largest size since the session's last release
        self.released_at: dict[ort.InferenceSession, int] = {}  # `calls` at the session's last release
        options = ort.RunOptions()
        options.add_run_config_entry(*SHRINK_CPU_ARENA)
        self.release_options: ort.RunOptions | None = options  # None: a release only trims the heap

    def run(
        self, session: ort.InferenceSession, names: Sequence[str] | None, feeds: Mapping[str, Any], size: int
    ) -> list[Any]:
        """`session.run(names, feeds)`; `size` measures the call (elements of the inputs its memory grows with)."""
        if not self._releases(session, size):
            return session.run(names, feeds)
        outputs = session.run(names, feeds, self.release_options)
        trim_heap()
        return outputs

    def run_bound(self, session: ort.InferenceSession, binding: ort.IOBinding, size: int) -> None:
        """`session.run_with_iobinding(binding)`, measured and released as `run` is."""
        if not self._releases(session, size):
            session.run_with_iobinding(binding)
            return
        session.run_with_iobinding(binding, self.release_options)
        trim_heap()

    def _releases(self, session: ort.InferenceSession, size: int) -> bool:
        """Count the call; whether it runs with a release."""
        self.calls += 1
        largest = max(self.largest.get(session, 0), size)
        spaced = self.calls - self.released_at.get(session, 0) >= self.spacing
        if size * self.ratio > largest or not spaced:
            self.largest[session] = largest
            return False
        self.largest[session], self.released_at[session] = size, self.calls
        self.releases += 1
        return True


def trim_heap() -> None:
    """glibc's `malloc_trim(0)`: free heap pages go back to the system. Elsewhere (musl, macOS) nothing."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    return getattr(ctypes.CDLL(None), "malloc_trim", None)
