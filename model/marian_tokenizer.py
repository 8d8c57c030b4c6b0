"""The tokenizer scheme of OPUS-MT (Marian) models, as transformers' MarianTokenizer applies it.

Sources are cut into pieces by `source.spm`, outputs are made of `target.spm`'s pieces, and `vocab.json`
(with `target_vocab.json` for models whose two sides have their own vocabularies) maps pieces to model
ids, which differ from SentencePiece's own. A piece missing from the vocabulary is the unknown id.
A source is `[>>xx<<] pieces... </s>`: multilingual models take the target language as a `>>xx<<`
piece in front; single-pair models take nothing. Moses punctuation normalisation, which MarianTokenizer
applies only when `sacremoses` is installed, is not applied: texts reach SentencePiece as they came.
"""

from __future__ import annotations

import re
from pathlib import Path

import sentencepiece as spm

from model.directions import LANGUAGES_FILE, read_directions
from model.files import read_json_map

SOURCE_SPM = "source.spm"
TARGET_SPM = "target.spm"
VOCAB_FILE = "vocab.json"
TARGET_VOCAB_FILE = "target_vocab.json"  # present only where the target side has its own vocabulary
MARIAN_FILES = (SOURCE_SPM, TARGET_SPM, VOCAB_FILE, LANGUAGES_FILE)
TAG = re.compile(r"^>>(.+)<<$")
EOS, UNK, PAD = "</s>", "<unk>", "<pad>"


def read_vocab(path: Path) -> dict[str, int]:
    return read_json_map(path, int, "pieces to integer ids")


class MarianTokenizer:
    """Encode text to model ids and back for an imported Marian model."""

    def __init__(self, model_dir: Path) -> None:
        self.source_sp = spm.SentencePieceProcessor(model_file=str(model_dir / SOURCE_SPM))
        self.target_sp = spm.SentencePieceProcessor(model_file=str(model_dir / TARGET_SPM))
        self.source_vocab = read_vocab(model_dir / VOCAB_FILE)
        separate = model_dir / TARGET_VOCAB_FILE
        target_vocab = read_vocab(separate) if separate.is_file() else self.source_vocab
        self.target_vocab = target_vocab
        self.target_pieces = {i: piece for piece, i in target_vocab.items()}
        self.eos_id, self.unk_id = self.source_vocab[EOS], self.source_vocab[UNK]
        self.directions = read_directions(model_dir)
        targets = set(self.directions.targets)
        # Target tags, where the vocabulary has them (multilingual models); single-pair models need none.
        tags = {m.group(1): i for piece, i in self.source_vocab.items() if (m := TAG.match(piece))}
        self.tag_ids = {lang: tags[lang] for lang in sorted(targets) if lang in tags}
        if self.tag_ids and len(self.tag_ids) != len(targets):
            raise ValueError(f"{model_dir / VOCAB_FILE} lacks target tags for {sorted(targets - set(self.tag_ids))}")
        # Never produced as text: the end, padding, unknown pieces, and tags, all as the target vocabulary holds them
        # (with separate vocabularies a tag's source id is an ordinary target piece).
        specials = {target_vocab[p] for p in (EOS, PAD, UNK) if p in target_vocab}
        self.silent_ids = specials | {i for piece, i in target_vocab.items() if TAG.match(piece)}

    @property
    def vocab_size(self) -> int:
        """Ids a source may hold."""
        return max(self.source_vocab.values()) + 1

    def encode_text(self, text: str) -> list[int]:
        """Source pieces only, each the vocabulary's id or the unknown id."""
        return [self.source_vocab.get(piece, self.unk_id) for piece in self.source_sp.encode(text, out_type=str)]

    def encode_source(self, text: str, target_lang: str, source_lang: str | None = None) -> list[int]:
        """`[>>xx<<] pieces... </s>`; a `>>xx<<` typed in the text stays text, never a tag. The source's language
        is not written."""
        tag = [self.tag_ids[target_lang]] if self.tag_ids else []
        return [*tag, *self.encode_text(text), self.eos_id]

    def encode_target(self, text: str) -> list[int]:
        """A reference output: target.spm's pieces as target ids, then EOS (as MarianTokenizer's text_target)."""
        unk = self.target_vocab[UNK]
        pieces = self.target_sp.encode(text, out_type=str)
        return [*(self.target_vocab.get(piece, unk) for piece in pieces), self.target_vocab[EOS]]

    def decode(self, ids: list[int]) -> str:
        """Output ids back to text through target.spm; special ids are dropped."""
        pieces = [self.target_pieces.get(i, UNK) for i in ids if i not in self.silent_ids]
        return str(self.target_sp.decode_pieces(pieces)).replace("\u2581", " ").strip()
