"""Convert our shipped weights to a CTranslate2 model through its Python spec API.

Our Transformer maps onto `TransformerSpec.from_config(..., pre_norm=True)` one to one: pre-norm
blocks with a final LayerNorm per stack, ReLU feed-forward, sinusoidal positions added to embeddings
scaled by sqrt(d_model), one embedding shared by encoder, decoder and output projection. Two details
must be set explicitly for token-identical output:

- positions: CTranslate2 generates `[sin | cos]` halves when no table is given; ours interleaves
  them (sin at even, cos at odd channels), so we store our own table in `position_encodings`;
- vocabulary: written as our SentencePiece piece list by id, so CTranslate2 token ids are our ids;
  the decoder starts from `<s>` (BOS id 2) and the language tag stays the first source token.

Usage: python -m bench.ct2_convert --model-dir model/shipped --out /tmp/ct2 [--quantization int8]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ctranslate2
import numpy as np
from ctranslate2.specs import attention_spec, common_spec, transformer_spec
from safetensors.numpy import load_file

from model.config import ModelConfig
from model.files import TOKENIZER_FILE, WEIGHTS_FILE, load_config
from model.marian_tokenizer import TARGET_VOCAB_FILE, VOCAB_FILE, read_vocab
from model.tokenizer import Tokenizer

LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which our model uses
Weights = dict[str, np.ndarray]


def sinusoid_table(max_len: int, d_model: int) -> np.ndarray:
    """(max_len, D) interleaved sin/cos table, the same numbers as model.training.transformer.sinusoidal_positions."""
    position = np.arange(max_len, dtype=np.float32)[:, None]
    inv_freq = np.exp(np.arange(0, d_model, 2, dtype=np.float32) * (-np.log(10000.0) / d_model))
    table = np.zeros((max_len, d_model), dtype=np.float32)
    table[:, 0::2] = np.sin(position * inv_freq)
    table[:, 1::2] = np.cos(position * inv_freq)
    return table


def _linear(spec: common_spec.LinearSpec, w: Weights, prefixes: list[str]) -> None:
    """Set `spec` from one or more of our nn.Linear layers, fused along the output dimension."""
    spec.weight = np.concatenate([w[f"{p}.weight"] for p in prefixes], axis=0)
    spec.bias = np.concatenate([w[f"{p}.bias"] for p in prefixes], axis=0)


def _norm(spec: common_spec.LayerNormSpec, w: Weights, prefix: str) -> None:
    spec.gamma = w[f"{prefix}.weight"]
    spec.beta = w[f"{prefix}.bias"]


def _self_attention(spec: attention_spec.MultiHeadAttentionSpec, w: Weights, prefix: str, norm: str) -> None:
    _norm(spec.layer_norm, w, norm)
    _linear(spec.linear[0], w, [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"])
    _linear(spec.linear[1], w, [f"{prefix}.out_proj"])


def _cross_attention(spec: attention_spec.MultiHeadAttentionSpec, w: Weights, prefix: str, norm: str) -> None:
    _norm(spec.layer_norm, w, norm)
    _linear(spec.linear[0], w, [f"{prefix}.q_proj"])
    _linear(spec.linear[1], w, [f"{prefix}.k_proj", f"{prefix}.v_proj"])
    _linear(spec.linear[2], w, [f"{prefix}.out_proj"])


def _ffn(spec: transformer_spec.FeedForwardSpec, w: Weights, prefix: str, norm: str) -> None:
    _norm(spec.layer_norm, w, norm)
    _linear(spec.linear_0, w, [f"{prefix}.w1"])
    _linear(spec.linear_1, w, [f"{prefix}.w2"])


def build_spec(cfg: ModelConfig, w: Weights, vocabulary: list[str]) -> transformer_spec.TransformerSpec:
    """A validated TransformerSpec holding our weights (fp32) and vocabulary."""
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.n_encoder_layers, cfg.n_decoder_layers), cfg.n_heads, pre_norm=True
    )
    positions = sinusoid_table(cfg.max_len, cfg.d_model)
    spec.encoder.embeddings[0].weight = w["embed.weight"]  # one source embedding (no source features)
    spec.decoder.embeddings.weight = w["embed.weight"]
    for stack in (spec.encoder, spec.decoder):
        stack.position_encodings.encodings = positions
        stack.scale_embeddings = True
    spec.decoder.projection.weight = w["embed.weight"]  # tied output projection, no bias
    _norm(spec.encoder.layer_norm, w, "encoder_norm")
    _norm(spec.decoder.layer_norm, w, "decoder_norm")
    for i, layer in enumerate(spec.encoder.layer):
        _self_attention(layer.self_attention, w, f"encoder.{i}.self_attn", f"encoder.{i}.norm1")
        _ffn(layer.ffn, w, f"encoder.{i}.ff", f"encoder.{i}.norm2")
    for i, layer in enumerate(spec.decoder.layer):
        _self_attention(layer.self_attention, w, f"decoder.{i}.self_attn", f"decoder.{i}.norm1")
        _cross_attention(layer.attention, w, f"decoder.{i}.cross_attn", f"decoder.{i}.norm2")
        _ffn(layer.ffn, w, f"decoder.{i}.ff", f"decoder.{i}.norm3")
    spec.config.layer_norm_epsilon = LAYER_NORM_EPS
    spec.config.decoder_start_token = vocabulary[cfg.bos_id]
    spec.config.bos_token = vocabulary[cfg.bos_id]
    spec.config.eos_token = vocabulary[cfg.eos_id]
    spec.config.unk_token = vocabulary[1]
    spec.register_source_vocabulary(vocabulary)
    spec.register_target_vocabulary(vocabulary)
    spec.validate()
    return spec


def piece_list(model_dir: Path) -> list[str]:
    """The model's pieces in id order: CTranslate2 tokens are mapped to our ids through it.

    An imported model lists vocab.json's pieces by id; the benchmark needs one vocabulary for both sides
    (OPUS-MT's shared layout). Rows past the tokenizer's last id (NLLB's two) are named as CTranslate2's
    M2M100 converter names them."""
    cfg = load_config(model_dir)
    if cfg.tokenizer in ("marian", "m2m"):
        if (model_dir / TARGET_VOCAB_FILE).is_file():
            raise ValueError(f"{model_dir} has separate source and target vocabularies; the benchmark needs one")
        by_id = {i: piece for piece, i in read_vocab(model_dir / VOCAB_FILE).items()}
        return [by_id[i] for i in range(len(by_id))] + [f"madeupword{k}" for k in range(cfg.vocab_size - len(by_id))]
    sp = Tokenizer(model_dir / TOKENIZER_FILE).sp
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def convert(model_dir: Path, out_dir: Path, quantization: str = "float32") -> Path:
    """Write a CTranslate2 model for `model_dir` into `out_dir` (replaced if present)."""
    cfg = load_config(model_dir)
    weights = {k: v.astype(np.float32) for k, v in load_file(str(model_dir / WEIGHTS_FILE)).items()}
    vocabulary = piece_list(model_dir)
    if len(vocabulary) != cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(vocabulary)} pieces but the model {cfg.vocab_size}")
    spec = build_spec(cfg, weights, vocabulary)
    spec.optimize(quantization=quantization)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec.save(str(out_dir))
    return out_dir


def convert_transformers(hf_dir: Path, out_dir: Path, quantization: str = "float32") -> Path:
    """CTranslate2's own converter on a transformers directory (ct2-transformers-converter): MarianMTModel, M2M100."""
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(str(hf_dir)).convert(str(out_dir), quantization=quantization, force=True)
    return out_dir


def translate_ids(
    translator: ctranslate2.Translator,
    vocabulary: list[str],
    sources: list[list[int]],
    beam_size: int,
    max_len: int,
    max_batch_size: int = 32,
) -> list[list[int]]:
    """Best hypothesis ids for each source (ids include the tag and EOS, as our encoder sees them)."""
    index = {piece: i for i, piece in enumerate(vocabulary)}
    results = translator.translate_batch(
        [[vocabulary[i] for i in src] for src in sources],
        beam_size=beam_size,
        max_decoding_length=max_len,
        max_batch_size=max_batch_size,
        length_penalty=1.0,
        min_decoding_length=0,  # EOS may come first, as in our decoder and transformers (CTranslate2's default: 1)
        return_end_token=False,
    )
    return [[index[t] for t in r.hypotheses[0]] for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("model/shipped"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quantization", default="float32", help="float32, int8, int8_float32, float16 ...")
    args = parser.parse_args()
    print(f"wrote {convert(args.model_dir, args.out, args.quantization)}")


if __name__ == "__main__":
    main()
