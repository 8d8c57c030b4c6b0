"""`CapturedRunner`: the fused capturable decoder step over static device buffers (`--kv-cache fused`, the CUDA
path).

Every cache is a device buffer of all `max_slots` rows at full length, self-attention (max_slots, H,
max_target_len, Dh) and cross (max_slots, H, max_source_len, Dh) (`server.backend.device_caches`), and so are
the step's row inputs and outputs. A step runs the export's decoder_step_fused graph over the first `bucket`
rows of each buffer, the smallest bucket that holds every stepped slot (the scheduler hands out low slots
first), bound at the buffers' own addresses: each bucket's binding never changes, so on CUDA each bucket is
one captured graph (`gpu_graph_id`). Every bucket is captured at the first step, which is the engine's
warm-up, on the thread that then steps it, and replayed at every later step. The graph writes each row's new
keys and values into the buffers in place; a step uploads only the row inputs and reads back the (B, K)
candidates. Rows of the bucket that the step does not use feed a pad token at their own length: what they
write lies past what they hold, and the step that next feeds them at that position writes it again. The bias
inputs are MAX_BIAS_PER_ROW wide, since a captured graph's shapes are fixed: a step's bias fills the first
columns of its rows, id 0 and value 0 (which change no score) the rest.

The encoder is the fused build too (encoder_fused); encoding, beam reorders and zeroing use the kv_* graphs in
place on the same buffers, so the bound addresses stay fixed. The runner cannot look at its caches without
copying them back, so it zeroes every slot past what a new sentence writes. On the CPU provider the same code
runs without capture: how the tests check its arithmetic (`python -m export --capturable-fp32`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from model.directory import (
    FUSED_DECODER_FILE,
    FUSED_ENCODER_FILE,
    HEAD_DIM_MULTIPLE,
    KV_MOVE_FILE,
    KV_WRITE_FILE,
    MetadataError,
    capturable_head_dim,
)
from server.backend.device_caches import DeviceCaches
from server.backend.runtime import BIAS_OUTPUT, LOG_PROBS_OUTPUT, Feeds, OnnxRunner
from server.backend.sessions import PROVIDERS, kv_names

log = logging.getLogger(__name__)

SMALLEST_BUCKET = 8
# The activation types CUDA captures the step in: onnxruntime's CUDA GroupQueryAttention takes no float32 (that
# node runs on the CPU, and nothing is captured unless every node is on the GPU).
CAPTURED_DTYPES = ("float16",)
CAPTURE_RUNS = 3  # onnxruntime's uncaptured runs of a graph id, its capturing run, and a replay
CAPTURED_FILES = (FUSED_ENCODER_FILE, FUSED_DECODER_FILE, KV_MOVE_FILE, KV_WRITE_FILE)  # what this runner opens


def buckets(max_slots: int) -> list[int]:
    """Row counts with a graph each: powers of two from SMALLEST_BUCKET, and max_slots itself."""
    sizes = [size for size in (SMALLEST_BUCKET << i for i in range(32)) if size < max_slots]
    return [*sizes, max_slots]


def capture_refusal(head_dim: int, dtype: str, provider: str, variant: str) -> str | None:
    """Why this runner cannot serve a variant of this head size and type on `provider`, or None: the head size
    first, which no export changes, then the type CUDA does not capture."""
    if not capturable_head_dim(head_dim):
        return (
            f"this model has no capturable decoder step, because its head_dim {head_dim} is not a multiple of "
            f"{HEAD_DIM_MULTIPLE}, which the step's attention kernel (onnxruntime's GroupQueryAttention) needs"
        )
    if provider == "cuda" and dtype not in CAPTURED_DTYPES:
        return (
            f"the captured step on CUDA takes a float16 variant: {variant} is {dtype}, whose attention onnxruntime "
            "runs on the CPU, so the step cannot be captured; serve --variant fp16"
        )
    return None


class CapturedRunner(OnnxRunner):
    """Static device buffers stepped by one fixed binding per bucket of the fused step (see above)."""

    kv_cache = "fused"
    step_file = FUSED_DECODER_FILE
    encoder_file = FUSED_ENCODER_FILE

    def _check_export(self, variant_dir: Path, provider: str) -> None:
        """Refuse what no export of this model gives before what a new export would: a head size the step's
        attention kernel does not take, then a type CUDA does not capture, then a graph missing."""
        meta = self.metadata
        refusal = capture_refusal(meta.head_dim, meta.dtype, provider, variant_dir.name)
        if refusal:
            raise MetadataError(f"--kv-cache {self.kv_cache}: {refusal}; or serve with --kv-cache working")
        super()._check_export(variant_dir, provider)
        for name in (KV_MOVE_FILE, KV_WRITE_FILE):
            if not (variant_dir / name).is_file():
                raise MetadataError(f"no {name} in {variant_dir}: export again with {self._export_command}")

    @property
    def _export_command(self) -> str:
        """float32 builds the capturable graphs only when asked."""
        return "python -m export --capturable-fp32" if self.metadata.dtype == "float32" else "python -m export"

    def _open_step(self, variant_dir: Path) -> ort.InferenceSession:
        """The fused step (`step_file`), the only step this runner takes (the dynamic step graph is never opened);
        CUDA captures it per `gpu_graph_id` (the option is CUDA's alone: the CPU provider runs it as is)."""
        return self._session(variant_dir / self.step_file, cuda_graph=True)

    def _open_caches(self, variant_dir: Path) -> None:
        self.device = "cuda" if self.provider == PROVIDERS["cuda"] else "cpu"
        self.caches = DeviceCaches(
            self._session, variant_dir, self.device, self.dtype, self.self_shape, self.cross_shape, 2 * self.n_layers
        )
        self.self_kv, self.cross_kv = self.caches.self_kv, self.caches.cross_kv
        top_ids = next(arg for arg in self.decoder.get_outputs() if arg.name == "top_ids")
        self.graph_k = int(top_ids.shape[1])  # candidates the graph ranks per row
        bias_ids = next(arg for arg in self.decoder.get_inputs() if arg.name == "bias_ids")
        self.bias_width = int(bias_ids.shape[1])  # bias entries the graph takes per row
        meta, rows, zeros = self.metadata, self.max_slots, self.caches.zeros
        self.rows_in = {
            "tokens": zeros((rows,), np.int64),
            "positions": zeros((rows,), np.int64),
            "row_scores": zeros((rows,), np.float32),
            "bias_ids": zeros((rows, self.bias_width), np.int64),
            "bias_values": zeros((rows, self.bias_width), np.float32),
            "src_mask": zeros((rows, meta.max_source_len), np.bool_),
        }
        self.rows_out = {
            "top_scores": zeros((rows, self.graph_k), np.float32),
            "top_ids": zeros((rows, self.graph_k), np.int64),
            BIAS_OUTPUT: zeros((rows, self.bias_width), np.float32),
            LOG_PROBS_OUTPUT: zeros((rows, meta.vocab_size), np.float32),
        }
        self._bias_zero = True  # whether the device's bias inputs hold zeros (nothing to upload without a bias)
        self.buckets = buckets(rows)
        self.bindings = [self._bind(size) for size in self.buckets]
        self.run_options = [self._graph_options(index) for index in range(len(self.buckets))]
        self._mask_version = -1  # the _cross_version whose source mask the device holds
        self._captured = self.device != "cuda"  # whether every bucket's graph has been captured

    # -- the caches: device buffers moved by the kv_* graphs -----------------------------------

    def _encode_into(self, ids: np.ndarray, mask: np.ndarray, item_of_slot: np.ndarray, slots: np.ndarray) -> None:
        binding = self.encoder.io_binding()
        binding.bind_cpu_input("src_ids", ids)
        binding.bind_cpu_input("src_mask", mask)
        for name in self.cross_names:
            binding.bind_output(name, self.device, 0)
        self.encoder.run_with_iobinding(binding)
        encoded = {f"encoded_{i}": value for i, value in enumerate(binding.get_outputs())}
        self.caches.write(encoded, item_of_slot, slots)

    def _slots_to_zero(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Device caches are not read back to be checked: every slot is zeroed past its new sentence."""
        return slots

    def _copy_self(self, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]) -> None:
        """The slot caches up to the longest source slot's length (entries past a slot's length are never read
        unmasked)."""
        filled = int(self.tgt_len[src].max())
        if filled:
            self._move("self", src, dst, filled)
            self.self_written[dst] = np.maximum(self.self_written[dst], filled)

    def _move(self, kind: str, src: np.ndarray, dst: np.ndarray, length: int) -> None:
        self.caches.move(kind, src, dst, length)

    def _zero(self, kind: str, slots: np.ndarray, length: int) -> None:
        self.caches.zero(kind, slots, length)

    # -- the captured step ----------------------------------------------------------------------

    def _bind(self, size: int) -> ort.IOBinding:
        """The first `size` rows of every buffer, bound at the buffers' addresses; present_* on past_*."""
        binding = self.decoder.io_binding()
        caches = [
            *zip(self.cross_names, self.cross_kv, strict=True),
            *zip(self.past_names, self.self_kv, strict=True),
        ]
        for name, value in [*self.rows_in.items(), *caches]:
            self._bind_rows(binding.bind_input, name, value, size)
        for name, value in self.rows_out.items():
            self._bind_rows(binding.bind_output, name, value, size)
        for name, value in zip(kv_names("present_k", "present_v", self.n_layers), self.self_kv, strict=True):
            self._bind_rows(binding.bind_output, name, value, size)
        return binding

    def _bind_rows(self, bind: Callable[..., None], name: str, value: ort.OrtValue, size: int) -> None:
        """Bind `name` to the first `size` rows of `value`: its own address, a shorter leading dimension."""
        shape = [size, *value.shape()[1:]]
        bind(name, self.device, 0, _NUMPY_TYPES[value.data_type()], shape, value.data_ptr())

    def _graph_options(self, index: int) -> ort.RunOptions | None:
        if self.device != "cuda":
            return None
        options = ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", str(index))
        return options

    def _capture(self) -> None:
        """Run every bucket until onnxruntime has captured its graph, on the step's uploaded inputs: each run
        writes the same keys and values at the same positions, so the step that follows is unchanged."""
        for binding, options in zip(self.bindings, self.run_options, strict=True):
            for _ in range(CAPTURE_RUNS):
                self.decoder.run_with_iobinding(binding, options)
        self._captured = True
        log.info("captured %d decoder graphs, buckets %s", len(self.buckets), self.buckets)

    def bucket_of(self, rows: np.ndarray) -> int:
        """Index of the smallest bucket that holds every row."""
        return int(np.searchsorted(self.buckets, int(rows.max()) + 1))

    def _step(
        self, slots: list[int], tokens: list[int], positions: list[int], ranking: Feeds, wanted: tuple[str, ...]
    ) -> list[np.ndarray]:
        rows = np.asarray(slots, dtype=np.int64)
        pos = self._positions(positions)
        k = int(ranking["top_k"][0])
        if k > self.graph_k:  # k is capped at the vocabulary, so graph_k is STATIC_TOP_K here, below it
            raise ValueError(
                f"the {self.kv_cache} step ranks {self.graph_k} candidates per row, not {k}: a beam of K ranks 2K, "
                f"so beams up to {self.graph_k // 2} decode with --kv-cache {self.kv_cache}; a wider beam needs "
                "--kv-cache working"
            )
        index = self.bucket_of(rows)
        # Rows the step does not use feed pad at their own length (the last entry, for a full row).
        row_pos = np.minimum(self.tgt_len, self.spec.max_target_len - 1)
        row_pos[rows] = pos
        tokens_in = np.full(self.max_slots, self.spec.pad_id, dtype=np.int64)
        tokens_in[rows] = tokens
        scores_in = np.zeros(self.max_slots, dtype=np.float32)
        scores_in[rows] = ranking["row_scores"]
        self.rows_in["tokens"].update_inplace(tokens_in)
        self.rows_in["positions"].update_inplace(row_pos)
        self.rows_in["row_scores"].update_inplace(scores_in)
        self._upload_bias(rows, ranking["bias_ids"], ranking["bias_values"])
        if self._mask_version != self._cross_version:
            self.rows_in["src_mask"].update_inplace(np.ascontiguousarray(self.src_mask))
            self._mask_version = self._cross_version
        np.maximum(self.self_written, row_pos + 1, out=self.self_written)  # what any bucket's run may write
        if not self._captured:
            self._capture()
        self.decoder.run_with_iobinding(self.bindings[index], self.run_options[index])
        self.tgt_len[rows] = pos + 1
        widths = {"top_scores": k, "top_ids": k, BIAS_OUTPUT: ranking["bias_ids"].shape[1]}
        return [self._read(name, rows, widths.get(name)) for name in wanted]

    def _upload_bias(self, rows: np.ndarray, ids: np.ndarray, values: np.ndarray) -> None:
        """The bias into the first columns of the stepped rows, zeros everywhere else. An all-zero bias (a step
        without one) is uploaded only where the device holds another."""
        if not ids.any() and not values.any() and self._bias_zero:
            return
        ids_in = np.zeros((self.max_slots, self.bias_width), dtype=np.int64)
        values_in = np.zeros((self.max_slots, self.bias_width), dtype=np.float32)
        ids_in[rows, : ids.shape[1]] = ids
        values_in[rows, : values.shape[1]] = values
        self.rows_in["bias_ids"].update_inplace(ids_in)
        self.rows_in["bias_values"].update_inplace(values_in)
        self._bias_zero = not ids.any() and not values.any()

    def _read(self, name: str, rows: np.ndarray, width: int | None) -> np.ndarray:
        """An output's stepped rows, each cut to its first `width` columns (the candidates' order is total)."""
        values = np.asarray(self.rows_out[name].numpy())[rows]
        return values if width is None else values[:, :width]


_NUMPY_TYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64, "tensor(bool)": np.bool_,
}  # fmt: skip
