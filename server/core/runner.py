"""The seam between the engine loop and a model runtime: slots with a key/value cache each.

A runner owns a fixed pool of `max_slots` decoding slots. Each slot holds one decoding row: the
cross-attention keys/values of its source and the self-attention keys/values of the tokens it has
fed so far (up to `max_target_len`). The scheduler decides which slot holds what; the runner only
computes. Rows at different steps share one `step` call: each row has its own position, and
attends only to its own first `position` cache entries. A step returns each row's best few next
tokens, ranked where the log-probabilities are computed (on the device, for CUDA), not the whole
vocabulary. A step may take a per-row bias (`RowBias`): the seam decoding constraints act through, as host-side
policies over the one step graph.

Beam search uses `copy_slots` to reorder rows after a step; greedy never copies.
Implementations: one per device, `server.backend.working_batch.WorkingBatchRunner` (host memory, the decoder's
working batch: CPU) and `server.backend.captured.CapturedRunner` (static device buffers, the fused step captured
as a CUDA graph per row bucket: CUDA), both over `server.backend.runtime.OnnxRunner`'s sessions; and the fakes in
tests.
This module imports numpy only, so the scheduler and its tests stay free of onnxruntime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from model.directory import MAX_BIAS_PER_ROW, ModelSpec

__all__ = ["MAX_BIAS_PER_ROW", "Candidates", "EncodeItem", "ModelSpec", "RowBias", "Runner"]


@dataclass(frozen=True)
class Candidates:
    """A step's ranked next tokens: row i's j-th best is token ids[i, j] with score scores[i, j]."""

    scores: npt.NDArray[np.float32]  # (B, k) row score + log-probability, descending along each row
    ids: npt.NDArray[np.int64]  # (B, k) token ids
    # (B, J) row score + log-probability + bias of each RowBias entry; None when the step took no bias
    bias_scores: npt.NDArray[np.float32] | None = None


@dataclass(frozen=True)
class RowBias:
    """What a step adds to row i's scores before ranking: values[i, j] at token ids[i, j].

    A value is 0, "report this token's score" (bias_scores[i, j] is its row score + log p), or -inf, "never
    rank this token" (it is no candidate, and its bias score is -inf). So every candidate carries its true
    score, and entries of one id may repeat: adding 0 or -inf gives the same sum in any order. Rows with
    fewer entries than J are padded with id 0, value 0. A row has at most MAX_BIAS_PER_ROW entries.
    """

    ids: npt.NDArray[np.int64]  # (B, J) token ids in 0 .. V - 1, 1 <= J <= MAX_BIAS_PER_ROW
    values: npt.NDArray[np.float32]  # (B, J) 0 or -inf

    def __post_init__(self) -> None:
        if self.ids.dtype != np.int64 or self.values.dtype != np.float32:
            raise ValueError(
                f"RowBias takes int64 ids and float32 values, got {self.ids.dtype} and {self.values.dtype}"
            )
        if self.ids.ndim != 2 or self.ids.shape != self.values.shape:
            raise ValueError(f"RowBias ids and values are (B, J) each, got {self.ids.shape} and {self.values.shape}")
        if not 1 <= self.ids.shape[1] <= MAX_BIAS_PER_ROW:
            raise ValueError(f"a RowBias holds 1 to {MAX_BIAS_PER_ROW} entries per row, not {self.ids.shape[1]}")


@dataclass(frozen=True)
class EncodeItem:
    """One source to encode into one or more slots (beam search fills K slots from one source)."""

    source_ids: list[int]  # tag + pieces + EOS
    slots: list[int]  # slots that decode this source; their self-attention caches are reset


class Runner(Protocol):
    """Computes for the scheduler; never decides anything."""

    spec: ModelSpec
    max_slots: int  # slots are numbered 0 .. max_slots - 1

    def encode(self, items: list[EncodeItem]) -> None:
        """Run the encoder once per item (batched) and store its cross keys/values in its slots."""
        ...

    def step(
        self, slots: list[int], tokens: list[int], positions: list[int], row_scores: list[float], k: int,
        bias: RowBias | None = None,
    ) -> Candidates:  # fmt: skip
        """Feed `tokens[i]` at `positions[i]` to `slots[i]`; return each row's k best next tokens.

        Row i's candidates are scored `row_scores[i] + log p(token)` in float32, best first, ties to
        the lower token id (`server.core.beam.row_candidates` is the reference); k is capped at V.
        A `bias` (one row per stepped row) is added before ranking, and its entries' scores come back as
        `Candidates.bias_scores`.
        The new keys/values are stored at `positions[i]` of each slot, so the next call for that
        slot passes `positions[i] + 1`. Row i attends to cache entries 0 .. positions[i].
        """
        ...

    def copy_slots(self, sources: list[int], destinations: list[int]) -> None:
        """Make each destination slot a copy of its source slot as it was before the call (cache and
        source alike). Sources and destinations may overlap: this is a gather, like
        `cache[destinations] = cache[sources]`."""
        ...
