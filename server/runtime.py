"""onnxruntime implementation of `server.runner.Runner` over a pool of preallocated cache slots.

Cache shape, chosen for continuous batching: per layer one self-attention cache
(max_slots, H, max_target_len, Dh) and one cross cache (max_slots, H, max_source_len, Dh). A step
gathers the rows' slots up to the longest position in the batch and a per-row `past_keep` mask, so
rows at different steps share one graph call; the graph returns only the new key/value row, which
is scattered back at each row's own position.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from server.metadata import DECODER_FILE, ENCODER_FILE, ExportMetadata, read_metadata
from server.runner import EncodeItem, ModelSpec

log = logging.getLogger(__name__)

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def make_session(path: Path, provider: str, intra_op_threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads  # 0 = onnxruntime's default (all cores)
    wanted = PROVIDERS[provider]
    providers = [wanted, "CPUExecutionProvider"] if wanted != "CPUExecutionProvider" else [wanted]
    return ort.InferenceSession(str(path), sess_options=options, providers=providers)


class OnnxRunner:
    """Encoder + decoder-step sessions and numpy caches for `max_slots` decoding rows."""

    def __init__(self, variant_dir: Path, max_slots: int, provider: str = "cpu", intra_op_threads: int = 0) -> None:
        if provider not in PROVIDERS:
            raise ValueError(f"unknown provider {provider!r}; choose from {sorted(PROVIDERS)}")
        self.metadata: ExportMetadata = read_metadata(variant_dir)
        self.spec: ModelSpec = self.metadata.spec()
        self.max_slots = max_slots
        self.encoder = make_session(variant_dir / ENCODER_FILE, provider, intra_op_threads)
        self.decoder = make_session(variant_dir / DECODER_FILE, provider, intra_op_threads)
        self.provider = self.decoder.get_providers()[0]
        log.info("onnx runner %s on %s with %d slots", self.metadata.variant, self.provider, max_slots)
        self.dtype = np.float16 if self.metadata.dtype == "float16" else np.float32
        self.n_layers = self.metadata.n_decoder_layers
        meta = self.metadata
        self_shape = (max_slots, meta.n_heads, meta.max_target_len, meta.head_dim)
        cross_shape = (max_slots, meta.n_heads, meta.max_source_len, meta.head_dim)
        # index 2*i is the key and 2*i+1 the value of decoder layer i, as in the graphs' argument order
        self.self_kv = [np.zeros(self_shape, self.dtype) for _ in range(2 * self.n_layers)]
        self.cross_kv = [np.zeros(cross_shape, self.dtype) for _ in range(2 * self.n_layers)]
        self.src_mask = np.zeros((max_slots, meta.max_source_len), dtype=bool)
        self.src_len = np.zeros(max_slots, dtype=np.int64)
        # What is valid in each slot, so copies move only that: target positions written so far, and
        # which encoded source the cross cache holds (beam rows of one sentence share it, so a beam
        # reorder copies no cross keys/values at all).
        self.tgt_len = np.zeros(max_slots, dtype=np.int64)
        self.source_key = np.full(max_slots, -1, dtype=np.int64)
        self._next_source_key = 0
        self._cross_version = 0  # bumped whenever a slot's cross cache or source mask changes
        self._source_feeds_key: tuple[bytes, int, int] | None = None
        self._source_feeds_cache: dict[str, npt.NDArray[np.generic]] = {}

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
        outputs = self.encoder.run(None, {"src_ids": ids, "src_mask": mask})  # 2L x (B, H, S, Dh)
        for row, item in enumerate(items):
            slots = np.asarray(item.slots, dtype=np.int64)
            for cache, out in zip(self.cross_kv, outputs, strict=True):
                cache[slots, :, :longest] = out[row]
            self.src_mask[slots] = False
            self.src_mask[slots, :longest] = mask[row]
            self.src_len[slots] = longest
            self.tgt_len[slots] = 0
            self.source_key[slots] = self._next_source_key
            self._next_source_key += 1
        self._cross_version += 1

    def step(self, slots: list[int], tokens: list[int], positions: list[int]) -> npt.NDArray[np.float32]:
        """One decoder step for rows at any mix of positions; new K/V stored at each row's position."""
        rows = np.asarray(slots, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        if pos.max(initial=0) >= self.spec.max_target_len:
            raise ValueError(f"position {int(pos.max())} exceeds max_target_len {self.spec.max_target_len}")
        past_len = int(pos.max())  # rows attend to cache entries 0 .. position - 1 plus the new one
        src_len = int(self.src_len[rows].max())
        feeds: dict[str, npt.NDArray[np.generic]] = {
            "tokens": np.asarray(tokens, dtype=np.int64),
            "positions": pos,
            "past_keep": np.arange(past_len)[None, :] < pos[:, None],
            **self._source_feeds(rows, src_len),
        }
        for i in range(self.n_layers):
            for j, kind in enumerate(("k", "v")):
                feeds[f"past_{kind}_{i}"] = self.self_kv[2 * i + j][rows, :, :past_len]
        log_probs, *new_kv = self.decoder.run(None, feeds)
        for cache, new in zip(self.self_kv, new_kv, strict=True):
            cache[rows, :, pos] = new[:, :, 0]
        self.tgt_len[rows] = pos + 1
        return np.asarray(log_probs, dtype=np.float32)

    def _source_feeds(self, rows: npt.NDArray[np.int64], src_len: int) -> dict[str, npt.NDArray[np.generic]]:
        """Cross keys/values and source mask of `rows`, gathered again only when the rows or their sources change.

        The same rows usually step many times in a row (a beam reorder keeps a sentence's slots and
        source), and this gather is the largest copy of a step.
        """
        key = (rows.tobytes(), src_len, self._cross_version)
        if key != self._source_feeds_key:
            feeds: dict[str, npt.NDArray[np.generic]] = {"src_mask": self.src_mask[rows, :src_len]}
            for i in range(self.n_layers):
                feeds[f"cross_k_{i}"] = self.cross_kv[2 * i][rows, :, :src_len]
                feeds[f"cross_v_{i}"] = self.cross_kv[2 * i + 1][rows, :, :src_len]
            self._source_feeds_cache, self._source_feeds_key = feeds, key
        return self._source_feeds_cache

    def copy_slots(self, sources: list[int], destinations: list[int]) -> None:
        """Gather on the slot axis: every destination becomes its source as it was before the call."""
        src = np.asarray(sources, dtype=np.int64)
        dst = np.asarray(destinations, dtype=np.int64)
        moved = src != dst
        src, dst = src[moved], dst[moved]
        if not src.size:
            return
        filled = int(self.tgt_len[src].max())  # entries past a slot's length are never read
        for cache in self.self_kv:
            cache[dst, :, :filled] = cache[src, :, :filled]
        other_source = self.source_key[src] != self.source_key[dst]
        if other_source.any():
            s, d = src[other_source], dst[other_source]
            length = int(self.src_len[s].max())
            for cache in self.cross_kv:
                cache[d, :, :length] = cache[s, :, :length]
            self.src_mask[d] = self.src_mask[s]
            self.src_len[d] = self.src_len[s]
            self._cross_version += 1
        self.tgt_len[dst] = self.tgt_len[src]
        self.source_key[dst] = self.source_key[src]
