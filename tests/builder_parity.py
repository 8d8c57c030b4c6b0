"""How far the built graphs lie from the PyTorch reference: teacher-forced log-probabilities through the
server's own runner (encoder, cross caches, cached decoder steps) against full recomputation in torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from model.training.transformer import Transformer
from server.backend.runtime import OnnxRunner
from server.backend.working_batch import WorkingBatchRunner
from server.core.runner import EncodeItem


def teacher_forced_gap(
    model: Transformer, variant_dir: Path, sources: list[list[int]], target: list[int],
    runner_class: type[OnnxRunner] = WorkingBatchRunner,
) -> float:  # fmt: skip
    """Largest |log-prob difference| over every step of `target` (bos first) fed to every source's row, through
    a runner of `runner_class` (the working batch, or the captured runner over the fused graphs)."""
    runner = runner_class(variant_dir, max_slots=len(sources), intra_op_threads=1)
    runner.encode([EncodeItem(source, [row]) for row, source in enumerate(sources)])
    rows = list(range(len(sources)))
    steps = [runner.step_log_probs(rows, [token] * len(rows), [i] * len(rows)) for i, token in enumerate(target)]
    onnx_log_probs = np.stack(steps, axis=1)  # (B, T, V)
    pad = model.cfg.pad_id
    src = torch.full((len(sources), max(map(len, sources))), pad, dtype=torch.long)
    for row, source in enumerate(sources):
        src[row, : len(source)] = torch.tensor(source)
    with torch.no_grad():
        logits = model(src, src != pad, torch.tensor([target] * len(sources)))
        reference = model.log_probs(logits).numpy()  # (B, T, V)
    return float(np.abs(onnx_log_probs - reference).max())
