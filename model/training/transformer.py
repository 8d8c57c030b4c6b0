"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017), written out.

Pre-norm residual blocks (LayerNorm before each sublayer, one final LayerNorm per stack): they train
stably with the short warmup a CPU budget affords. Shared source/target embedding, tied to the output
projection. The config's architecture options (post-norm, SiLU, [sin | cos] positions, a logits bias,
separate source embeddings, a banned pad) default to this model and carry imported OPUS-MT (Marian)
models. Dimensions are named the same everywhere, in comments and in the ONNX graphs:

    B batch rows   S source length   T target length   P cached target positions
    D d_model      H heads           Dh head dim       V vocabulary      L decoder layers

Two decoder paths share the weights: `forward` recomputes every target position (training, parity
reference); `decode_step` advances one token per row against a key/value cache (inference, ONNX export).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from model.config import ModelConfig

# Finite so that fp16 graphs neither overflow nor turn a fully masked row into NaN.
MASK_VALUE = -1e4
# A banned token's log-probability: finite, so that adding a row's score keeps the arithmetic exact elsewhere.
BANNED_LOG_PROB = -1e9
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "swish": F.silu, "gelu": F.gelu}


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


def sinusoidal_positions(max_len: int, d_model: int, layout: str = "interleaved", offset: int = 0) -> Tensor:
    """(max_len, D) table of sines and cosines at geometrically spaced frequencies; row p for position p + offset.

    "interleaved": sin and cos of each frequency side by side. "halves": all sines, then all cosines,
    computed in float64 as transformers' MarianSinusoidalPositionalEmbedding does. "fairseq": all sines, then
    all cosines, frequencies spread over D/2 - 1 steps, as M2M100SinusoidalPositionalEmbedding computes them.
    """
    if layout == "fairseq":
        return fairseq_positions(offset + max_len, d_model)[offset:]
    if offset:
        return sinusoidal_positions(offset + max_len, d_model, layout)[offset:]
    if layout == "halves":
        angle = torch.arange(max_len, dtype=torch.float64)[:, None] / torch.pow(
            10000.0, torch.arange(0, d_model, 2, dtype=torch.float64) / d_model
        )  # (max_len, D/2)
        return torch.cat([angle.sin(), angle.cos()], dim=1).float()
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)
    return table


def fairseq_positions(rows: int, d_model: int) -> Tensor:
    """(rows, D) [sin | cos] with frequencies exp(-i log(10000) / (D/2 - 1)), a zero column where D is odd."""
    half = d_model // 2
    inv_freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))  # (D/2,)
    angle = torch.arange(rows, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)  # (rows, D/2)
    table = torch.cat([angle.sin(), angle.cos()], dim=1)
    return torch.cat([table, torch.zeros(rows, 1)], dim=1) if d_model % 2 else table


def residual(x: Tensor, norm: nn.Module, sublayer: Callable[[Tensor], Tensor], dropout: nn.Module, pre: bool) -> Tensor:
    """x + sublayer(norm(x)) before normalising (pre-norm), or norm(x + sublayer(x)) after (post-norm)."""
    if pre:
        return x + dropout(sublayer(norm(x)))
    return norm(x + dropout(sublayer(x)))


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
    """Position-wise two-layer network with the config's activation (ReLU by default)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.activation = ACTIVATIONS[cfg.activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.dropout(self.activation(self.w1(x))))


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each in a pre- or post-norm residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg)
        self.ff = FeedForward(cfg)
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.pre_norm = cfg.norm_placement == "pre"

    def attend(self, h: Tensor, src_keep: Tensor) -> Tensor:
        return self.self_attn(h, *self.self_attn.project_kv(h), src_keep)

    def forward(self, x: Tensor, src_keep: Tensor) -> Tensor:
        x = residual(x, self.norm1, lambda h: self.attend(h, src_keep), self.dropout, self.pre_norm)
        return residual(x, self.norm2, self.ff, self.dropout, self.pre_norm)


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, feed-forward; pre- or post-norm residuals."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg)
        self.cross_attn = MultiHeadAttention(cfg)
        self.ff = FeedForward(cfg)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))
        self.dropout = nn.Dropout(cfg.dropout)
        self.pre_norm = cfg.norm_placement == "pre"

    def self_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """This block's self-attention keys and values of its input x (B, T, D): from LayerNorm(x) under
        pre-norm, from x itself under post-norm; each (B, H, T, Dh)."""
        return self.self_attn.project_kv(self.norm1(x) if self.pre_norm else x)

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
        pre = self.pre_norm
        x = residual(x, self.norm1, lambda h: self.self_attn(h, self_k, self_v, self_keep), self.dropout, pre)
        x = residual(x, self.norm2, lambda h: self.cross_attn(h, cross_k, cross_v, src_keep), self.dropout, pre)
        return residual(x, self.norm3, self.ff, self.dropout, pre)


class Transformer(nn.Module):
    """Encoder-decoder Transformer with tied embeddings and a cached incremental decoder."""

    positions: Tensor  # (max_len, D) sinusoids; a non-persistent buffer, rebuilt from the config
    banned: Tensor  # (V,) True at ids never produced; a non-persistent buffer, rebuilt from the config

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)  # target side, tied output
        # A separate source table when the vocabularies differ; None: `embed` serves both sides.
        self.src_embed = nn.Embedding(cfg.src_vocab_size, cfg.d_model) if cfg.src_vocab_size else None
        positions = sinusoidal_positions(cfg.max_len, cfg.d_model, cfg.position_layout, cfg.position_offset)
        self.register_buffer("positions", positions, persistent=False)
        banned = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        banned[cfg.pad_id] = cfg.ban_pad
        self.register_buffer("banned", banned, persistent=False)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        # Post-norm blocks end normalised: no final LayerNorm per stack.
        final_norm = nn.LayerNorm if cfg.norm_placement == "pre" else (lambda _: nn.Identity())
        self.encoder_norm, self.decoder_norm = final_norm(cfg.d_model), final_norm(cfg.d_model)
        self.logits_bias = nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.final_logits_bias else None
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=self.cfg.d_model**-0.5)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`self.decoder` typed: nn.ModuleList yields plain Modules to the type checker."""
        return cast("Sequence[DecoderLayer]", self.decoder)

    def embed_tokens(self, ids: Tensor, pos: Tensor, table: nn.Embedding | None = None) -> Tensor:
        """(Scaled) token embedding plus sinusoid at `pos`; ids and pos (B, T) -> (B, T, D).
        `table` defaults to the target embedding."""
        tokens = (table or self.embed)(ids)
        return self.embed_dropout(tokens * self.embed_scale + self.positions[pos])

    def logits(self, h: Tensor) -> Tensor:
        """Output projection tied to the target embedding, plus the logits bias if any: (B, T, D) -> (B, T, V)."""
        logits = self.decoder_norm(h) @ self.embed.weight.t()
        return logits if self.logits_bias is None else logits + self.logits_bias

    def log_probs(self, logits: Tensor) -> Tensor:
        """(..., V) logits -> float32 log-probabilities, banned ids (pad, when `ban_pad`) set to BANNED_LOG_PROB
        after normalising, as transformers' `bad_words_ids` does: the other ids keep their probabilities; with
        `renormalize_logits` banned before normalising, so that the other ids' probabilities sum to one."""
        logits = logits.float()
        if self.cfg.ban_pad and self.cfg.renormalize_logits:
            logits = logits.masked_fill(self.banned, float("-inf"))
        log_probs = logits.log_softmax(dim=-1)
        return log_probs.masked_fill(self.banned, BANNED_LOG_PROB) if self.cfg.ban_pad else log_probs

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        """src (B, S) ids, src_mask (B, S) True at real tokens -> memory (B, S, D)."""
        pos = torch.arange(src.size(1), device=src.device).unsqueeze(0).expand_as(src)
        x = self.embed_tokens(src, pos, self.src_embed)
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
            k, v = layer.self_kv(x)
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
            k, v = layer.self_kv(x)  # (B, H, 1, Dh)
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
