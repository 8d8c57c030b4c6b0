"""The tokenizer scheme of many-to-many models (NLLB-200, M2M100), as transformers' NllbTokenizer and
M2M100Tokenizer apply it.

`sentencepiece.bpe.model` cuts text into pieces; `vocab.json` maps pieces to model ids (the importer writes it:
NLLB's pieces at their SentencePiece id + 1, fairseq's offset, M2M100's as its own vocab.json has them), with the
special tokens and each language's code; `language_codes.json` names the code piece of each language
(`deu_Latn`, `__de__`). Where the checkpoint ships a tokenizer.json (NLLB's), text is cut by it through the
`tokenizers` library, as transformers' NllbTokenizer cuts it (its whitespace rules differ from SentencePiece's
own at the ends of a text). A source is `[source code] pieces... </s>`; the target's code is the decoder's forced
first token (`ModelConfig.forced_bos`). A code typed in the text stays text, never a control id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sentencepiece as spm

from model.directions import LANGUAGES_FILE, read_directions
from model.files import read_json_map
from model.marian_tokenizer import read_vocab

SPM_FILE = "sentencepiece.bpe.model"
VOCAB_FILE = "vocab.json"
TOKENIZER_JSON = "tokenizer.json"  # present where the checkpoint ships one (NLLB)
CODES_FILE = "language_codes.json"  # {"deu_Latn": "deu_Latn", ...} or {"de": "__de__", ...}: language -> piece
M2M_FILES = (SPM_FILE, VOCAB_FILE, CODES_FILE, LANGUAGES_FILE)
BOS, PAD, EOS, UNK = "<s>", "<pad>", "</s>", "<unk>"


def read_codes(path: Path) -> dict[str, str]:
    return read_json_map(path, str, "languages to their code pieces")


class M2MTokenizer:
    """Encode text to model ids and back for an imported NLLB-200 or M2M100 model."""

    fast: Any  # tokenizers.Tokenizer over tokenizer.json, where the model directory has one

    def __init__(self, model_dir: Path) -> None:
        self.sp = spm.SentencePieceProcessor(model_file=str(model_dir / SPM_FILE))
        self.fast = None
        if (model_dir / TOKENIZER_JSON).is_file():
            from tokenizers import Tokenizer

            self.fast = Tokenizer.from_file(str(model_dir / TOKENIZER_JSON))
        self.vocab = read_vocab(model_dir / VOCAB_FILE)
        self.pieces = {i: piece for piece, i in self.vocab.items()}
        self.eos_id, self.unk_id = self.vocab[EOS], self.vocab[UNK]
        self.directions = read_directions(model_dir)
        codes = read_codes(model_dir / CODES_FILE)
        if missing := sorted(lang for lang, piece in codes.items() if piece not in self.vocab):
            raise ValueError(f"{model_dir / VOCAB_FILE} lacks the codes of {missing[:5]}")
        self.tag_ids = {lang: self.vocab[piece] for lang, piece in sorted(codes.items())}
        # Never produced as text: the special tokens, every language code, and pieces SentencePiece does not know
        # (M2M100's madeup words, NLLB's <mask>)
        specials = {self.vocab[piece] for piece in (BOS, PAD, EOS, UNK) if piece in self.vocab}
        unknown = {i for piece, i in self.vocab.items() if self.sp.piece_to_id(piece) == self.sp.unk_id()}
        self.silent_ids = specials | unknown | set(self.tag_ids.values())

    @property
    def vocab_size(self) -> int:
        """Ids a source may hold."""
        return max(self.vocab.values()) + 1

    def encode_text(self, text: str) -> list[int]:
        """Pieces only, each the vocabulary's id or the unknown id."""
        if self.fast is not None:
            return list(self.fast.encode(text, add_special_tokens=False).ids)
        return [self.vocab.get(piece, self.unk_id) for piece in self.sp.encode(text, out_type=str)]

    def encode_source(self, text: str, target_lang: str, source_lang: str | None = None) -> list[int]:
        """`[source code] pieces... </s>`: the source's code where the language is known (the target's travels
        as the decoder's forced first token); `target_lang` is checked, not encoded."""
        if target_lang not in self.tag_ids:
            raise KeyError(target_lang)
        code = [self.tag_ids[source_lang]] if source_lang is not None else []
        return [*code, *self.encode_text(text), self.eos_id]

    def encode_target(self, text: str) -> list[int]:
        """A reference output: pieces, then EOS."""
        return [*self.encode_text(text), self.eos_id]

    def decode(self, ids: list[int]) -> str:
        """Output ids back to text; special ids and language codes are dropped."""
        pieces = [self.pieces[i] for i in ids if i in self.pieces and i not in self.silent_ids]
        return str(self.sp.decode_pieces(pieces)).strip()
