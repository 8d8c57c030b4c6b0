"""Shapes, masking and the cached decoding path of the Transformer."""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig
from model.training.decode import CachedDecoder, beam_search, greedy
from model.training.transformer import count_parameters, make_model

CFG = ModelConfig(
    vocab_size=64, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0, max_len=32
)


@pytest.fixture()
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return make_model(CFG).eval()


def test_forward_shapes(model) -> None:
    src = torch.randint(4, 64, (3, 7))
    tgt = torch.randint(4, 64, (3, 5))
    assert model(src, src != 0, tgt).shape == (3, 5, 64)
    assert count_parameters(model) > 0


def test_future_tokens_do_not_change_earlier_outputs(model) -> None:
    src = torch.randint(4, 64, (2, 6))
    tgt = torch.randint(4, 64, (2, 6))
    changed = tgt.clone()
    changed[:, 4:] = torch.randint(4, 64, (2, 2))
    a, b = model(src, src != 0, tgt), model(src, src != 0, changed)
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_source_padding_is_ignored(model) -> None:
    src = torch.randint(4, 64, (1, 5))
    padded = torch.cat([src, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    tgt = torch.randint(4, 64, (1, 4))
    torch.testing.assert_close(model(src, src != 0, tgt), model(padded, padded != 0, tgt), atol=1e-5, rtol=1e-5)


def test_cached_decoding_equals_full_recomputation(model) -> None:
    src = torch.randint(4, 64, (1, 6))
    tgt = torch.tensor([[2, 9, 17, 33, 41, 5]])
    full = model(src, src != 0, tgt).log_softmax(-1)
    decoder = CachedDecoder(model, src)
    steps = torch.stack([decoder.step(tgt[:, i], i) for i in range(tgt.size(1))], dim=1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)


def test_rows_at_different_steps_share_a_step(model) -> None:
    """Row 1 has one cached position masked out (padding); it must decode as if alone."""
    src = torch.randint(4, 64, (1, 6))
    cross = model.cross_kv(model.encode(src, src != 0))
    mask = src != 0
    alone = CachedDecoder(model, src)
    alone.step(torch.tensor([2]), 0)
    expected = alone.step(torch.tensor([11]), 1)
    # a batch of two rows: row 0 at step 2 (two cached), row 1 at step 1 (one cached + one padding)
    two = CachedDecoder(model, src)
    two.step(torch.tensor([2]), 0)
    two.step(torch.tensor([7]), 1)
    k = [
        torch.cat([ck, torch.cat([alone_k, torch.zeros_like(alone_k)], 2)])
        for ck, alone_k in zip(two.k, [a[:, :, :1] for a in alone.k], strict=True)
    ]
    v = [
        torch.cat([cv, torch.cat([alone_v, torch.zeros_like(alone_v)], 2)])
        for cv, alone_v in zip(two.v, [a[:, :, :1] for a in alone.v], strict=True)
    ]
    keep = torch.tensor([[True, True], [True, False]])
    logits, _, _ = model.decode_step(
        torch.tensor([5, 11]),
        torch.tensor([2, 1]),
        k,
        v,
        keep,
        [(ck.expand(2, -1, -1, -1), cv.expand(2, -1, -1, -1)) for ck, cv in cross],
        mask.expand(2, -1),
    )
    torch.testing.assert_close(logits[1].log_softmax(-1), expected[0], atol=1e-5, rtol=1e-5)


def test_beam_returns_sorted_hypotheses_and_greedy_is_beam_one(model) -> None:
    src = [4, 10, 11, 12, 3]
    hyps = beam_search(model, src, beam_size=4, max_len=10)
    assert len(hyps) >= 4
    assert [h.normalized for h in hyps] == sorted((h.normalized for h in hyps), reverse=True)
    assert greedy(model, src, max_len=10) == beam_search(model, src, beam_size=1, max_len=10)[0]
    assert all(len(h.tokens) <= 10 for h in hyps)


def test_bad_beam_arguments_raise(model) -> None:
    with pytest.raises(ValueError):
        beam_search(model, [4, 3], beam_size=0)
