"""The engine's beams, reordering and slot copies against the PyTorch tiny model: the same tokens and scores as
model/training/decode.py's beam search, the specification."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from server.core.engine import Engine
from server.core.events import EngineLimits, RequestDone
from server.core.runner import Candidates, EncodeItem, RowBias
from server.core.work import DecodeOptions
from tests.fakes import Collector, ranked


class TorchSlotRunner:
    """The PyTorch tiny model behind the Runner protocol (a slot cache, as the ONNX runner keeps one),
    so the engine's beams and reordering are checked against model/training/decode.py, the specification."""

    def __init__(self, model_dir: Path, max_slots: int) -> None:
        import torch

        from model.directions import Directions
        from model.training.artifact import load_artifact
        from server.core.runner import ModelSpec

        self.torch = torch
        self.model = load_artifact(model_dir).eval()
        cfg = self.model.cfg
        self.max_slots = max_slots
        self.spec = ModelSpec(
            cfg.vocab_size,
            cfg.max_len,
            cfg.max_len,
            cfg.bos_id,
            cfg.eos_id,
            cfg.pad_id,
            {},
            Directions.of_pairs([]),
            cfg.vocab_size,
        )
        cache = (max_slots, cfg.n_heads, cfg.max_len, cfg.head_dim)  # (slots, H, L, Dh)
        layers = range(cfg.n_decoder_layers)
        self.k = [torch.zeros(cache) for _ in layers]
        self.v = [torch.zeros(cache) for _ in layers]
        self.cross_k = [torch.zeros(cache) for _ in layers]
        self.cross_v = [torch.zeros(cache) for _ in layers]
        self.src_mask = torch.zeros(max_slots, cfg.max_len, dtype=torch.bool)

    def encode(self, items: list[EncodeItem]) -> None:
        torch = self.torch
        longest = max(len(item.source_ids) for item in items)
        src = torch.tensor([ids + [self.spec.pad_id] * (longest - len(ids)) for ids in (i.source_ids for i in items)])
        mask = src != self.spec.pad_id
        with torch.no_grad():
            cross = self.model.cross_kv(self.model.encode(src, mask))
        for row, item in enumerate(items):
            for slot in item.slots:
                self.src_mask[slot] = False
                self.src_mask[slot, :longest] = mask[row]
                for layer, (k, v) in enumerate(cross):
                    self.cross_k[layer][slot, :, :longest] = k[row]
                    self.cross_v[layer][slot, :, :longest] = v[row]

    def step(
        self, slots: list[int], tokens: list[int], positions: list[int], row_scores: list[float], k: int,
        bias: RowBias | None = None,
    ) -> Candidates:  # fmt: skip
        return ranked(self.step_log_probs(slots, tokens, positions), row_scores, k, bias)

    def step_log_probs(self, slots: list[int], tokens: list[int], positions: list[int]) -> np.ndarray:
        torch = self.torch
        index, pos = torch.tensor(slots), torch.tensor(positions)
        past = max(positions)
        keep = torch.arange(past)[None, :] < pos[:, None]  # (B, P)
        span = int(self.src_mask[index].any(dim=0).nonzero().max()) + 1
        cross = [(k[index, :, :span], v[index, :, :span]) for k, v in zip(self.cross_k, self.cross_v, strict=True)]
        with torch.no_grad():
            logits, new_k, new_v = self.model.decode_step(
                torch.tensor(tokens),
                pos,
                [k[index, :, :past] for k in self.k],
                [v[index, :, :past] for v in self.v],
                keep,
                cross,
                self.src_mask[index, :span],
            )
        for layer in range(len(self.k)):
            self.k[layer][index, :, pos] = new_k[layer][:, :, 0]
            self.v[layer][index, :, pos] = new_v[layer][:, :, 0]
        return logits.float().log_softmax(dim=-1).numpy()

    def copy_slots(self, sources: list[int], destinations: list[int]) -> None:
        src, dst = self.torch.tensor(sources), self.torch.tensor(destinations)
        for tensor in (*self.k, *self.v, *self.cross_k, *self.cross_v, self.src_mask):
            tensor[dst] = tensor[src].clone()


def test_engine_equals_the_pytorch_reference_beam_search(tiny_model_dir: Path) -> None:
    from model.training.decode import beam_search

    runner = TorchSlotRunner(tiny_model_dir, max_slots=7)
    rng = np.random.default_rng(1)
    jobs = []
    for n in range(12):
        ids = [4 + n % 2, *rng.integers(6, runner.spec.vocab_size, int(rng.integers(1, 14))).tolist(), 3]
        jobs.append((ids, DecodeOptions(beam_size=1 + n % 4, length_penalty=1.0, max_output_len=12)))
    engine = Engine(runner, EngineLimits(max_slots=7))  # type: ignore[arg-type]
    engine.start()
    try:
        collectors = [Collector() for _ in jobs]
        for (ids, options), collector in zip(jobs, collectors, strict=True):
            engine.submit([ids], options, collector)
        results = [(c.wait(), c.hypotheses()) for c in collectors]
    finally:
        engine.stop()
    for (ids, options), (final, got) in zip(jobs, results, strict=True):
        assert final == RequestDone()
        want = beam_search(runner.model, ids, options.beam_size, options.max_output_len, options.length_penalty)[0]
        [(tokens, score)] = got[0]
        assert tokens == want.tokens
        assert score == pytest.approx(want.score, abs=1e-4)
