"""What both runners share: the onnxruntime sessions, the slot bookkeeping and the `Runner` protocol's calls.

Cache shape, chosen for continuous batching: per layer one self-attention cache of up to
(max_slots, H, max_target_len, Dh) and one cross cache (max_slots, H, max_source_len, Dh). Rows at
different steps share one graph call: each row has its own position and attends only to its own entries.

A step reads every row up to the batch's longest span and masks what lies past the row's own, but masking
zeroes attention weights, and a weight of 0 times a stale NaN or inf is NaN: without cleaning, one request
whose activations overflowed would poison every later occupant of its slots. Stale finite values are
harmless (0 x finite = 0), so a runner that can look at what it writes zeroes a slot, when a new sentence
takes it, only if a NaN or inf went in; one whose caches live on the device cannot look without copying
them back, so it zeroes every slot past what its new sentence writes.

One runner per device, chosen by `server.backend.runners.open_runner`:
- `server.backend.working_batch.WorkingBatchRunner` keeps the caches in host memory (numpy), the
  self-attention keys/values as the decoder's working batch: the CPU path, and the fallback wherever the
  captured step cannot run.
- `server.backend.captured.CapturedRunner` keeps them in static device buffers and steps the export's fused
  capturable decoder graph over them in place, one CUDA graph per row bucket: the CUDA path.
Each subclasses `OnnxRunner` directly and fills in where its caches live (`_open_caches`, `_encode_into`,
`_step`, `_copy_self`, `_move`, `_zero`, `_slots_to_zero`); `server.backend.sessions` opens the sessions.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from model.directory import (
    DECODER_FILE,
    ENCODER_FILE,
    ExportMetadata,
    MetadataError,
    buffer_head_dim,
    log_probs_from_ranking,
    read_metadata,
)
from server.backend.arena_release import ArenaRelease
from server.backend.sessions import PROVIDERS, Feeds, kv_names, make_session, moved_pairs
from server.core.runner import Candidates, EncodeItem, ModelSpec, RowBias

__all__ = ["CANDIDATE_OUTPUTS", "PROVIDERS", "Feeds", "OnnxRunner", "kv_names", "make_session"]

log = logging.getLogger(__name__)

CANDIDATE_OUTPUTS = ("top_scores", "top_ids")  # what a serving step fetches from the decoder
BIAS_OUTPUT = "bias_scores"  # fetched too when the step takes a bias
LOG_PROBS_OUTPUT = "log_probs"  # the whole distribution, fetched only by parity checks


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


class OnnxRunner(ABC):
    """Encoder + decoder-step sessions and the bookkeeping of `max_slots` decoding rows; the caches are the
    subclass's."""

    kv_cache: str  # the `--kv-cache` placement this runner is
    # The subclass's slot caches, layer i's keys at 2i and values at 2i + 1: numpy arrays or device OrtValues
    self_kv: list[Any]
    cross_kv: list[Any]
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
        meta = self.metadata
        self.self_shape = (max_slots, meta.n_heads, meta.max_target_len, meta.head_dim)
        self.cross_shape = (max_slots, meta.n_heads, meta.max_source_len, buffer_head_dim(meta.head_dim))
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
        # Slots a NaN or inf was written into since they were last cleaned (the host caches' checks).
        self.non_finite = np.zeros(max_slots, dtype=bool)
        self._next_source_key = 0
        self._cross_version = 0  # bumped whenever a slot's cross cache or source mask changes
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
        """The decoder-step session (the captured runner opens its step for CUDA graphs)."""
        return self._session(variant_dir / self.step_file)

    # -- the Runner protocol: bookkeeping shared by both runners -------------------------------

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
        """`step`, returning the whole (B, V) log-probabilities instead: for parity checks, not serving. A step
        graph without a log_probs output ranks all V ids (`model.directory.log_probs_from_ranking`)."""
        rows, vocab = len(slots), self.spec.vocab_size
        if LOG_PROBS_OUTPUT in {output.name for output in self.decoder.get_outputs()}:
            ranking = ranking_feeds([0.0] * rows, 1, None)
            (log_probs,) = self._step(slots, tokens, positions, ranking, (LOG_PROBS_OUTPUT,))
            return log_probs
        scores, ids = self._step(slots, tokens, positions, ranking_feeds([0.0] * rows, vocab, None), CANDIDATE_OUTPUTS)
        return log_probs_from_ranking(scores, ids, vocab)

    @abstractmethod
    def _step(
        self, slots: list[int], tokens: list[int], positions: list[int], ranking: Feeds, wanted: tuple[str, ...]
    ) -> list[np.ndarray]:
        """Feed one token per row; new K/V stored at each row's position; return the `wanted` outputs."""

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

    @abstractmethod
    def _copy_self(self, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]) -> None:
        """`copy_slots`' self-attention part; runs before the slots' lengths are copied."""

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

    # -- where the caches live: the subclass's ----------------------------------------------------

    @abstractmethod
    def _open_caches(self, variant_dir: Path) -> None:
        """Allocate the caches (and whatever else the step binds) once the sessions are open."""

    @abstractmethod
    def _encode_into(self, ids: np.ndarray, mask: np.ndarray, item_of_slot: np.ndarray, slots: np.ndarray) -> None:
        """Run the encoder on (N, S) ids; slot `slots[j]` gets the cross keys/values of row `item_of_slot[j]`."""

    @abstractmethod
    def _slots_to_zero(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Which of the slots a new sentence takes must be zeroed first (see the module docstring)."""

    @abstractmethod
    def _move(self, kind: str, src: np.ndarray, dst: np.ndarray, length: int) -> None:
        """Copy the first `length` entries of the `kind` ("self" or "cross") caches from slots `src` to `dst`."""

    @abstractmethod
    def _zero(self, kind: str, slots: np.ndarray, length: int) -> None:
        """Zero the first `length` entries of the `kind` caches of `slots`."""
