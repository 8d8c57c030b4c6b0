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
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    # sha256 of the tokenizer.model the embeddings were trained against: another tokenizer with the same
    # vocabulary size would pass every shape check and translate garbage. "" in artifacts from before it.
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

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
