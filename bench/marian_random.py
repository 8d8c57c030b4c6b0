"""Random transformers checkpoints, built offline the way `save_pretrained` lays out an OPUS-MT model (MarianMTModel)
or NLLB-200 (M2M100ForConditionalGeneration), with small SentencePiece models trained on the spot: the importer's
test input and the CPU rehearsal of the GPU check (the tiny shapes) and the benchmark's stand-ins for
opus-mt-de-en, nllb-200-distilled-600M and nllb-200-1.3B (their exact shapes, random weights).

    python -m bench.marian_random --out DIR [--shape opus-mt-de-en|nllb-200-distilled-600M|tiny|...] [--separate-vocabs]
"""

from __future__ import annotations

import argparse
import io
import json
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
import torch

from model.data import read_tsv


@dataclass(frozen=True)
class MarianShape:
    d_model: int
    layers: int  # encoder and decoder each
    heads: int
    ffn: int
    vocab_size: int  # 0: just the pieces of the small SentencePiece models; else padded with filler pieces to it
    max_positions: int
    small: bool = False  # a test's size: tokenizers learnt from SAMPLE_PAIRS alone, outputs of at most 24 tokens
    family: str = "marian"  # "marian": MarianMTModel; "nllb": M2M100ForConditionalGeneration with NLLB-200's files


SHAPES = {
    # head_dim 4: the importer's test input, and a model with no capturable step (GroupQueryAttention's sizes)
    "tiny": MarianShape(d_model=16, layers=2, heads=4, ffn=32, vocab_size=0, max_positions=64, small=True),
    # head_dim 8: the same size with the capturable step, so that a CPU rehearsal builds and runs it
    "tiny-capturable": MarianShape(d_model=16, layers=2, heads=2, ffn=32, vocab_size=0, max_positions=64, small=True),
    # Helsinki-NLP/opus-mt-de-en's config.json: 74.4M parameters
    "opus-mt-de-en": MarianShape(d_model=512, layers=6, heads=8, ffn=2048, vocab_size=58101, max_positions=512),
    "nllb-tiny": MarianShape(
        d_model=16, layers=2, heads=4, ffn=32, vocab_size=0, max_positions=64, small=True, family="nllb"
    ),
    # facebook/nllb-200-distilled-600M's config.json: 615M parameters, 256,206 embedding rows
    "nllb-200-distilled-600M": MarianShape(
        d_model=1024, layers=12, heads=16, ffn=4096, vocab_size=256206, max_positions=1024, family="nllb"
    ),
    # facebook/nllb-200-1.3B's (and nllb-200-distilled-1.3B's) config.json: 1.37B parameters
    "nllb-200-1.3B": MarianShape(
        d_model=1024, layers=24, heads=16, ffn=8192, vocab_size=256206, max_positions=1024, family="nllb"
    ),
}


DATA_DIR = Path(__file__).resolve().parent.parent / "data"
# A few real dictionary-style German-English pairs: enough text for a small SentencePiece vocabulary
SAMPLE_PAIRS = [(p.de, p.en) for p in read_tsv(DATA_DIR / "sample_pairs.tsv")]
EOS, UNK, PAD = "</s>", "<unk>", "<pad>"
EOS_BIAS = 1.5  # raises EOS's logit so that random outputs end within a few tokens, as translations do


def train_spm(texts: list[str], path: Path, vocab_size: int) -> list[str]:
    """A unigram model at `path` of at most `vocab_size` pieces (fewer where the text has fewer);
    returns its pieces in id order, SentencePiece's own specials left out."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts * 4), model_writer=model, vocab_size=vocab_size, model_type="unigram",
        character_coverage=1.0, minloglevel=2, num_threads=1, hard_vocab_limit=False,
    )  # fmt: skip
    path.write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(path))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_control(i) and not sp.is_unknown(i)]


def training_pairs(shape: str) -> list[tuple[str, str]]:
    """The text the tokenizers learn from. At OPUS-MT's size also the repository's validation and test
    sentences, so that a test sentence splits into about as many pieces as a real OPUS-MT tokenizer makes of
    it (13.7 for 7.7 words of German) rather than into characters: the benchmark's sources then have
    realistic lengths."""
    if SHAPES[shape].small:
        return SAMPLE_PAIRS
    files = [DATA_DIR / "valid.tsv", DATA_DIR / "test.tsv"]
    return SAMPLE_PAIRS + [(p.de, p.en) for f in files if f.is_file() for p in read_tsv(f)]


LAYOUTS = ("classic", "tc-big")  # the vocabulary and config layouts OPUS-MT releases come in


def marian_vocab(
    pieces: list[str], pad_id: int | None = None, tags: tuple[str, ...] = (), layout: str = "classic"
) -> dict[str, int]:
    """Classic OPUS-MT: </s> 0, <unk> 1, tags, pieces, <pad> last (or at `pad_id`, shifting what follows).
    tc-big (the Tatoeba Challenge's releases): tags, pieces with </s> and <unk> among them, <pad> last."""
    unique = list(dict.fromkeys(pieces))
    if layout == "tc-big":
        third = len(unique) // 3
        ordered = [*tags, *unique[:third], EOS, *unique[third : 2 * third], UNK, *unique[2 * third :]]
    else:
        ordered = [EOS, UNK, *tags, *unique]
    if pad_id is None:
        return {piece: i for i, piece in enumerate([*ordered, PAD])}
    ordered.insert(pad_id, PAD)
    return {piece: i for i, piece in enumerate(ordered)}


@dataclass(frozen=True)
class Languages:
    """What a random model translates: its language codes and the texts its tokenizers learn from."""

    source: str = "de"
    target: str = "en"
    texts: tuple[tuple[str, str], ...] = ()  # (source, target) sentences; () = SAMPLE_PAIRS (German, English)


def build_marian_dir(
    out: Path,
    separate_vocabs: bool = False,
    tags: tuple[str, ...] = (),
    seed: int = 0,
    shape: str = "tiny",
    layout: str = "classic",
    languages: Languages = Languages(),
    forced_eos: bool | None = None,
) -> Path:
    """config.json, generation_config.json, model.safetensors, source.spm, target.spm, vocab.json
    (and target_vocab.json) of a random MarianMTModel with every Marian peculiarity switched on.

    `layout` "tc-big" is the Tatoeba Challenge's: ReLU, </s> and <unk> among the pieces, and a generation
    config that forces EOS at the output limit and renormalises after the pad ban; `forced_eos` overrides
    the first (classic releases set it too). `languages` names the pair and the texts to learn pieces from."""
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    out.mkdir(parents=True, exist_ok=True)
    size = SHAPES[shape]
    pairs = list(languages.texts) or training_pairs(shape)
    source_pieces = train_spm([de for de, _ in pairs], out / "source.spm", 90 if size.small else 4000)
    target_pieces = train_spm([en for _, en in pairs], out / "target.spm", 70 if size.small else 4000)
    if size.vocab_size:  # filler pieces stand for the real vocabulary's rest: the shapes are what is measured
        shared = list(dict.fromkeys(source_pieces + target_pieces))  # the vocabulary OPUS-MT shares, as one list
        source_pieces = target_pieces = shared + [
            f"\u2581filler{i}" for i in range(size.vocab_size - len(shared) - 3 - len(tags))
        ]
    if separate_vocabs:
        target_vocab = marian_vocab(target_pieces, layout=layout)
        pad = target_vocab[PAD]
        source_vocab = marian_vocab(source_pieces, pad_id=pad, tags=tags, layout=layout)  # one pad id on both sides
        (out / "target_vocab.json").write_text(json.dumps(target_vocab, ensure_ascii=False))
    else:
        source_vocab = target_vocab = marian_vocab(source_pieces + target_pieces, tags=tags, layout=layout)
        pad = source_vocab[PAD]
    eos = target_vocab[EOS]
    if separate_vocabs and source_vocab[EOS] != eos:  # Marian has one </s> id: move the source's onto it
        displaced = next(piece for piece, i in source_vocab.items() if i == eos)
        source_vocab[displaced], source_vocab[EOS] = source_vocab[EOS], eos
    (out / "vocab.json").write_text(json.dumps(source_vocab, ensure_ascii=False))
    tokenizer_config = {"source_lang": languages.source, "target_lang": languages.target}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tc_big = layout == "tc-big"
    forced = tc_big if forced_eos is None else forced_eos
    config = MarianConfig(
        vocab_size=len(source_vocab), decoder_vocab_size=len(target_vocab), d_model=size.d_model,
        encoder_layers=size.layers, decoder_layers=size.layers, encoder_attention_heads=size.heads,
        decoder_attention_heads=size.heads, encoder_ffn_dim=size.ffn, decoder_ffn_dim=size.ffn,
        max_position_embeddings=size.max_positions, pad_token_id=pad, eos_token_id=eos,
        decoder_start_token_id=pad, activation_function="relu" if tc_big else "swish", scale_embedding=True,
        share_encoder_decoder_embeddings=not separate_vocabs, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    # Every parameter random, so that each left-out difference shows in the logits; matrices at a trained
    # model's scale (std about 1/sqrt(d_model)), so that attention is not saturated at the large shape.
    scale = size.d_model**-0.5 * 1.2
    with torch.no_grad():
        for name, param in model.named_parameters():
            offset = 1.0 if "norm.weight" in name else 0.0
            param.copy_(torch.randn_like(param) * (0.5 if "embed" in name else scale) + offset)
        model.final_logits_bias.copy_(torch.randn_like(model.final_logits_bias))
        model.final_logits_bias[0, config.eos_token_id] += EOS_BIAS
        for table in (model.model.encoder.embed_tokens, model.model.decoder.embed_tokens):
            table.weight[pad].zero_()  # as in OPUS-MT checkpoints: the decoder starts from a zero embedding
    max_length = 24 if size.small else size.max_positions  # short, so that tests reach the limit
    model.generation_config = GenerationConfig(
        num_beams=4, max_length=max_length, bad_words_ids=[[pad]], decoder_start_token_id=pad, eos_token_id=eos,
        pad_token_id=pad, forced_eos_token_id=eos if forced else None, renormalize_logits=tc_big,
    )  # fmt: skip
    model.save_pretrained(out)
    return out


NLLB_EXTRA_ROWS = 2  # NLLB's embedding has rows past <mask>, the last id its tokenizer knows


def build_nllb_dir(out: Path, shape: str = "nllb-tiny", seed: int = 0) -> Path:
    """config.json, generation_config.json, model.safetensors, sentencepiece.bpe.model and tokenizer.json of a
    random NLLB-200 of `shape`: the pieces at their SentencePiece id + 1 (fairseq's four specials first), filler
    pieces up to the shape's vocabulary (a SentencePiece model learnt from our text cannot hold 256,000 pieces,
    a tokenizer.json vocabulary can), then the 202 language codes and <mask>, as the hub lays them out. Random
    outputs never end: they run to the output limit, the same work in every engine."""
    from transformers import GenerationConfig, M2M100Config, M2M100ForConditionalGeneration, NllbTokenizer
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    out.mkdir(parents=True, exist_ok=True)
    size = SHAPES[shape]
    texts = [text for pair in training_pairs(shape) for text in pair]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts * 4), model_writer=model, vocab_size=300 if size.small else 8000,
        model_type="bpe", character_coverage=1.0, minloglevel=2, num_threads=1, hard_vocab_limit=False,
    )  # fmt: skip
    (out / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    NllbTokenizer.from_pretrained(str(out), extra_special_tokens=list(FAIRSEQ_LANGUAGE_CODES)).save_pretrained(out)
    data = json.loads((out / "tokenizer.json").read_text())
    pieces = data["model"]["vocab"]  # {piece: id}, ids 0 .. SentencePiece's size
    codes_at = size.vocab_size - len(FAIRSEQ_LANGUAGE_CODES) - 1 - NLLB_EXTRA_ROWS if size.vocab_size else len(pieces)
    pieces |= {f"\u2581filler{i}": i for i in range(len(pieces), codes_at)}
    ids = {code: codes_at + i for i, code in enumerate([*FAIRSEQ_LANGUAGE_CODES, "<mask>"])}
    for token in data["added_tokens"]:
        token["id"] = ids.get(token["content"], token["id"])
    data["added_tokens"].sort(key=lambda token: token["id"])
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    config = M2M100Config(
        vocab_size=codes_at + len(ids) + NLLB_EXTRA_ROWS, d_model=size.d_model, encoder_layers=size.layers,
        decoder_layers=size.layers, encoder_attention_heads=size.heads, decoder_attention_heads=size.heads,
        encoder_ffn_dim=size.ffn, decoder_ffn_dim=size.ffn, max_position_embeddings=size.max_positions,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, scale_embedding=True,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = M2M100ForConditionalGeneration(config).eval()
    with torch.no_grad():  # EOS's row of the one table zero: the decoder starts from nothing and EOS scores 0, last
        model.model.shared.weight[config.eos_token_id].zero_()
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=0, decoder_start_token_id=2, eos_token_id=2, pad_token_id=1,
                     max_length=200).save_pretrained(out)  # fmt: skip
    return out


def build_random_dir(out: Path, shape: str) -> Path:
    """A random checkpoint of `shape`, of its family."""
    return (build_nllb_dir if SHAPES[shape].family == "nllb" else build_marian_dir)(out, shape=shape)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.marian_random", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="opus-mt-de-en")
    parser.add_argument("--separate-vocabs", action="store_true")
    args = parser.parse_args(argv)
    if SHAPES[args.shape].family == "nllb":
        build_nllb_dir(args.out, shape=args.shape)
    else:
        build_marian_dir(args.out, separate_vocabs=args.separate_vocabs, shape=args.shape)
    print(f"wrote a random {args.shape} checkpoint to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
