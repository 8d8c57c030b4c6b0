"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017), written out.

Pre-norm residual blocks (LayerNorm before each sublayer, one final LayerNorm per stack): they train
stably with the short warmup a CPU budget affords. Shared source/target embedding, tied to the output
projection. Dimensions are named the same everywhere, in comments and in the ONNX graphs:

    B batch rows   S source length   T target length   P cached target positions
    D d_model      H heads           Dh head dim       V vocabulary      L decoder layers

Two decoder paths share the weights: `forward` recomputes every target position (training, parity
reference); `decode_step` advances one token per row against a key/value cache (inference, ONNX export).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from model.config import ModelConfig

# Finite so that fp16 graphs neither overflow nor turn a fully masked row into NaN.
MASK_VALUE = -1e4


def attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, dropout: nn.Module | None = None) -> Tensor:
    """Scaled dot-product attention; `keep` is True where a query may look at a key."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T, S)
    scores = scores.masked_fill(~keep, MASK_VALUE)
    weights = scores.softmax(dim=-1)
    if dropout is not None:
        weights = dropout(weights)
    return weights @ v  # (B, H, T, Dh)


def subsequent_mask(size: int, device: torch.device | None = None) -> Tensor:
    """(1, 1, T, T) bool mask that hides future positions from each target position."""
    return torch.ones(size, size, dtype=torch.bool, device=device).tril().view(1, 1, size, size)


def sinusoidal_positions(max_len: int, d_model: int) -> Tensor:
    """(max_len, D) table of sines and cosines at geometrically spaced frequencies."""
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)
    return table


class MultiHeadAttention(nn.Module):
    """Project to H heads, attend, concatenate, project back."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def split_heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)

    def merge_heads(self, x: Tensor) -> Tensor:
        b, _, t, _ = x.shape
        return x.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (B, T, D)

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of `x` (B, S, D), each (B, H, S, Dh)."""
        return self.split_heads(self.k_proj(x)), self.split_heads(self.v_proj(x))

    def forward(self, x: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
        """Attend from queries of `x` (B, T, D) to precomputed heads `k`, `v` (B, H, S, Dh)."""
        q = self.split_heads(self.q_proj(x))
        return self.out_proj(self.merge_heads(attention(q, k, v, keep, self.dropout)))


class FeedForward(nn.Module):
    """Position-wise two-layer network with a ReLU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.dropout(F.relu(self.w1(x))))


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each as x + sublayer(LayerNorm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg)
        self.ff = FeedForward(cfg)
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, src_keep: Tensor) -> Tensor:
        h = self.norm1(x)
        k, v = self.self_attn.project_kv(h)
        x = x + self.dropout(self.self_attn(h, k, v, src_keep))
        return x + self.dropout(self.ff(self.norm2(x)))


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, feed-forward; pre-norm residuals."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg)
        self.cross_attn = MultiHeadAttention(cfg)
        self.ff = FeedForward(cfg)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: Tensor,
        self_k: Tensor,
        self_v: Tensor,
        self_keep: Tensor,
        cross_k: Tensor,
        cross_v: Tensor,
        src_keep: Tensor,
    ) -> Tensor:
        """`self_k`/`self_v` (B, H, P, Dh) already include this call's own positions."""
        x = x + self.dropout(self.self_attn(self.norm1(x), self_k, self_v, self_keep))
        x = x + self.dropout(self.cross_attn(self.norm2(x), cross_k, cross_v, src_keep))
        return x + self.dropout(self.ff(self.norm3(x)))


class Transformer(nn.Module):
    """Encoder-decoder Transformer with tied embeddings and a cached incremental decoder."""

    positions: Tensor  # (max_len, D) sinusoids; a non-persistent buffer, rebuilt from the config

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.register_buffer("positions", sinusoidal_positions(cfg.max_len, cfg.d_model), persistent=False)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        self.encoder_norm, self.decoder_norm = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=self.cfg.d_model**-0.5)
            with torch.no_grad():
                module.weight[self.cfg.pad_id].zero_()

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`self.decoder` typed: nn.ModuleList yields plain Modules to the type checker."""
        return cast("Sequence[DecoderLayer]", self.decoder)

    def embed_tokens(self, ids: Tensor, pos: Tensor) -> Tensor:
        """Scaled token embedding plus sinusoid at `pos`; ids and pos (B, T) -> (B, T, D)."""
        return self.embed_dropout(self.embed(ids) * math.sqrt(self.cfg.d_model) + self.positions[pos])

    def logits(self, h: Tensor) -> Tensor:
        """Output projection tied to the embedding: (B, T, D) -> (B, T, V)."""
        return self.decoder_norm(h) @ self.embed.weight.t()

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        """src (B, S) ids, src_mask (B, S) True at real tokens -> memory (B, S, D)."""
        pos = torch.arange(src.size(1), device=src.device).unsqueeze(0).expand_as(src)
        x = self.embed_tokens(src, pos)
        keep = src_mask[:, None, None, :]  # (B, 1, 1, S)
        for layer in self.encoder:
            x = layer(x, keep)
        return self.encoder_norm(x)

    def cross_kv(self, memory: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Encoder-decoder keys and values for every decoder layer, each (B, H, S, Dh); computed once."""
        return [layer.cross_attn.project_kv(memory) for layer in self.decoder_layers]

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """Teacher-forced decoder over all positions: tgt_in (B, T) -> logits (B, T, V)."""
        t = tgt_in.size(1)
        pos = torch.arange(t, device=tgt_in.device).unsqueeze(0).expand_as(tgt_in)
        x = self.embed_tokens(tgt_in, pos)
        self_keep = subsequent_mask(t, tgt_in.device)  # (1, 1, T, T)
        src_keep = src_mask[:, None, None, :]
        for layer, (ck, cv) in zip(self.decoder_layers, self.cross_kv(memory), strict=True):
            k, v = layer.self_attn.project_kv(layer.norm1(x))
            x = layer(x, k, v, self_keep, ck, cv, src_keep)
        return self.logits(x)

    def forward(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """Training path: (B, S) source and (B, T) shifted target -> logits (B, T, V)."""
        return self.decode(tgt_in, self.encode(src, src_mask), src_mask)

    def decode_step(
        self,
        tokens: Tensor,
        step: Tensor,
        past_k: list[Tensor],
        past_v: list[Tensor],
        past_keep: Tensor,
        cross: list[tuple[Tensor, Tensor]],
        src_mask: Tensor,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Advance every row by one token against a key/value cache.

        tokens (B,) last token of each row; step (B,) its position, rows may differ;
        past_k/past_v per layer (B, H, P, Dh), P may be 0; past_keep (B, P) True at the cache
        positions this row may attend to (its own earlier tokens, not padding or other rows' slots);
        cross per layer (k, v) each (B, H, S, Dh); src_mask (B, S).
        Returns logits (B, V) and this step's new keys and values per layer, each (B, H, 1, Dh);
        the caller owns the cache and decides whether to append them or write them into a slot.
        """
        x = self.embed_tokens(tokens.unsqueeze(1), step.unsqueeze(1))  # (B, 1, D)
        ones = past_keep.new_ones(past_keep.size(0), 1)
        self_keep = torch.cat([past_keep, ones], dim=1)[:, None, None, :]  # (B, 1, 1, P+1)
        src_keep = src_mask[:, None, None, :]
        new_k: list[Tensor] = []
        new_v: list[Tensor] = []
        for i, layer in enumerate(self.decoder_layers):
            k, v = layer.self_attn.project_kv(layer.norm1(x))  # (B, H, 1, Dh)
            new_k.append(k)
            new_v.append(v)
            k_all = torch.cat([past_k[i], k], dim=2)  # (B, H, P+1, Dh)
            v_all = torch.cat([past_v[i], v], dim=2)
            x = layer(x, k_all, v_all, self_keep, cross[i][0], cross[i][1], src_keep)
        return self.logits(x)[:, 0], new_k, new_v


def make_model(cfg: ModelConfig) -> Transformer:
    """Build a freshly initialised model from its config."""
    return Transformer(cfg)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
