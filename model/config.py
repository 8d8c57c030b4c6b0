"""The one frozen config of a model artifact, saved inside every checkpoint and ONNX export."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

PAD_ID = 0  # padding; never attended to, never predicted
UNK_ID = 1  # unknown piece
BOS_ID = 2  # starts every target sequence
EOS_ID = 3  # ends every source and target sequence
LANG_TAGS: dict[str, str] = {"en": "<2en>", "de": "<2de>"}  # target-language tag prepended to the source
# Default output limit, a * source tokens + b as in fairseq's max_len_a/b and Marian's max-length-factor:
# a translation is rarely longer than twice its source in subwords, so this only cuts runaway
# repetition, which would otherwise run to the model's max_len and hold a slot for as long.
OUTPUT_LEN_FACTOR = 3
OUTPUT_LEN_SLACK = 10


def default_output_limit(source_len: int, max_target_len: int) -> int:
    """Most generated tokens (EOS included) for a source of `source_len` tokens (tag and EOS included)."""
    return min(max_target_len, OUTPUT_LEN_FACTOR * source_len + OUTPUT_LEN_SLACK)


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of the encoder-decoder Transformer; enough to rebuild it from an artifact."""

    vocab_size: int = 8000  # shared SentencePiece vocabulary (source and target)
    d_model: int = 256  # width of every residual stream
    n_heads: int = 4  # attention heads; head dim = d_model // n_heads
    d_ff: int = 1024  # inner width of the position-wise feed-forward layer
    n_encoder_layers: int = 3  # encoder blocks
    n_decoder_layers: int = 3  # decoder blocks
    dropout: float = 0.1  # on attention weights, sublayer outputs and embeddings (training only)
    max_len: int = 256  # longest source or target sequence in tokens, tags and EOS included
    pad_id: int = PAD_ID
    bos_id: int = BOS_ID  # the decoder's first input (Marian: the pad id)
    eos_id: int = EOS_ID
    unk_id: int = UNK_ID
    # Architecture options. The defaults are this project's own model; the other values are what imported
    # imported models need (export/importers/ sets them per family, from transformers' modeling_marian.py and
    # modeling_m2m_100.py).
    # "pre": x + f(LayerNorm(x)) and a final LayerNorm per stack; "post": LayerNorm(x + f(x)) and none
    norm_placement: str = "pre"
    activation: str = "relu"  # feed-forward nonlinearity: one of model.training.transformer.ACTIVATIONS
    # Sinusoid columns: "interleaved" (sin, cos per pair) | "halves" (sin | cos) | "fairseq" (sin | cos, frequencies
    # spread over D/2 - 1 steps: transformers' M2M100SinusoidalPositionalEmbedding)
    position_layout: str = "interleaved"
    # Table rows before the first position: M2M100 and NLLB number positions from the padding index + 1
    position_offset: int = 0
    scale_embedding: bool = True  # token embeddings times sqrt(d_model) before the positions are added
    final_logits_bias: bool = False  # a learned (V,) bias added to the output logits
    src_vocab_size: int = 0  # > 0: a separate source embedding table of this size; 0: one table for both sides
    ban_pad: bool = False  # pad's log-probability is set to BANNED_LOG_PROB after normalising: never produced
    # The ban applies before normalising, so the other ids' probabilities sum to one (transformers'
    # `renormalize_logits`, which some OPUS-MT generation configs set)
    renormalize_logits: bool = False
    # A hypothesis that reaches the output limit ends with EOS in its last place, at no cost to its score
    # (transformers' `forced_eos_token_id`, which OPUS-MT generation configs set): else it ends cut off
    forced_eos_at_limit: bool = False
    # Beam search goes on past K finished hypotheses while the best live one, at its length, could still beat the
    # K-th (transformers' default `early_stopping=False`); else it stops at K finished (`early_stopping=True`)
    patient_beam: bool = False
    # The target language's code is the decoder's first generated token, forced at log-probability 0 after bos_id
    # (transformers' `forced_bos_token_id`: M2M100, NLLB), and the source starts with its own language's code;
    # else a target tag, where the model has one, starts the source
    forced_bos: bool = False
    # Token sequences no hypothesis completes: transformers' `bad_words_ids` besides the pad ban, and its
    # `suppress_tokens` as sequences of one. Applied by the decoder each step through the step graph's per-row bias
    # (a sequence's last token is banned where a hypothesis ends with the rest), never built into a graph.
    banned_words: tuple[tuple[int, ...], ...] = ()
    # "tagged-spm": tokenizer.model with <2xx> tags | "marian": source.spm, target.spm, vocab.json |
    # "m2m": sentencepiece.bpe.model, vocab.json and language codes (M2M100, NLLB; model.m2m_tokenizer)
    tokenizer: str = "tagged-spm"
    # sha256 of the tokenizer the embeddings were trained against (model.tokenizer.tokenizer_sha256): another
    # tokenizer with the same vocabulary size would pass every shape check and translate garbage.
    tokenizer_sha256: str = ""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config fields: {sorted(unknown)}")
        return cls(**data)

    @property
    def source_vocab_size(self) -> int:
        """Ids a source may hold: the separate source table's size, else the shared vocabulary's."""
        return self.src_vocab_size or self.vocab_size

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        choices = {
            "norm_placement": ("pre", "post"),
            "position_layout": ("interleaved", "halves", "fairseq"),
            "activation": ("relu", "swish", "gelu"),
            "tokenizer": ("tagged-spm", "marian", "m2m"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; expected one of {list(allowed)}")
        if self.position_offset < 0:
            raise ValueError(f"position_offset={self.position_offset}; expected >= 0")
        object.__setattr__(self, "banned_words", tuple(tuple(int(i) for i in word) for word in self.banned_words))
        if any(not word for word in self.banned_words):
            raise ValueError("banned_words holds an empty sequence")
