"""Shared German/English SentencePiece tokenizer with target-language tags.

The source of every example is `<2xx> pieces... </s>`: the tag tells the one model which way to
translate. The target is `<s> pieces... </s>` (BOS fed to the decoder, EOS predicted at the end).
Training one is model.training.train_tokenizer's job.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import sentencepiece as spm

from model.config import EOS_ID, LANG_TAGS, UNK_ID
from model.directions import Directions

TOKENIZER_FILE = "tokenizer.model"


class TextTokenizer(Protocol):
    """What the server and the offline tools need of a model's tokenizer, whatever its scheme."""

    tag_ids: dict[str, int]  # target-language tag id by language code; {} where the model needs none
    directions: Directions  # the (source, target) language pairs it translates

    @property
    def vocab_size(self) -> int: ...  # ids a source may hold

    # `source_lang`: the source's own language, which a scheme that writes it (m2m) needs; None where unknown
    def encode_source(self, text: str, target_lang: str, source_lang: str | None = None) -> list[int]: ...

    def encode_target(self, text: str) -> list[int]: ...  # a reference output: pieces + EOS

    def decode(self, ids: list[int]) -> str: ...


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenizer_files(model_dir: Path, scheme: str) -> list[Path]:
    """The files a model directory's tokenizer is read from, by `ModelConfig.tokenizer` scheme."""
    if scheme == "m2m":
        from model.m2m_tokenizer import M2M_FILES, TOKENIZER_JSON

        fast = model_dir / TOKENIZER_JSON
        return [model_dir / name for name in M2M_FILES] + ([fast] if fast.is_file() else [])
    if scheme == "marian":
        from model.marian_tokenizer import MARIAN_FILES, TARGET_VOCAB_FILE

        separate = model_dir / TARGET_VOCAB_FILE
        return [model_dir / name for name in MARIAN_FILES] + ([separate] if separate.is_file() else [])
    return [model_dir / TOKENIZER_FILE]


def tokenizer_sha256(model_dir: Path, scheme: str) -> str:
    """sha256 of the tokenizer: of its one file, or of its files' digests in order for an imported model."""
    files = tokenizer_files(model_dir, scheme)
    if len(files) == 1:
        return file_sha256(files[0])
    return hashlib.sha256("".join(file_sha256(f) for f in files).encode()).hexdigest()


def open_tokenizer(model_dir: Path, scheme: str, expected_sha256: str = "") -> TextTokenizer:
    """The model directory's tokenizer, checked against the digest its weights recorded."""
    if scheme == "tagged-spm":
        check_tokenizer(model_dir / TOKENIZER_FILE, expected_sha256)
    elif expected_sha256 and (found := tokenizer_sha256(model_dir, scheme)) != expected_sha256:
        raise ValueError(
            f"the tokenizer files in {model_dir} (sha256 {found[:12]}...) are not the tokenizer the model was"
            f" imported with (sha256 {expected_sha256[:12]}...): put those back, or import the model again"
        )
    if scheme == "marian":
        from model.marian_tokenizer import MarianTokenizer

        return MarianTokenizer(model_dir)
    if scheme == "m2m":
        from model.m2m_tokenizer import M2MTokenizer

        return M2MTokenizer(model_dir)
    return Tokenizer(model_dir / TOKENIZER_FILE)


def check_tokenizer(tokenizer: Path, expected_sha256: str) -> None:
    """Raise ValueError if `tokenizer` is not the file a model recorded (`ModelConfig.tokenizer_sha256`;
    nothing to check when it recorded none)."""
    if expected_sha256 and (found := file_sha256(tokenizer)) != expected_sha256:
        raise ValueError(
            f"{tokenizer} (sha256 {found[:12]}...) is not the tokenizer the model was trained with"
            f" (sha256 {expected_sha256[:12]}...): put that one back, or train the model on this one"
        )


class Tokenizer:
    """Encode text to ids and back; knows the language tags and special ids."""

    def __init__(self, path: Path | str) -> None:
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.tag_ids = {lang: self.sp.piece_to_id(tag) for lang, tag in LANG_TAGS.items()}
        for lang, tag_id in self.tag_ids.items():
            if tag_id == UNK_ID:
                raise ValueError(f"tokenizer {path} lacks the language tag {LANG_TAGS[lang]}")
        # The tags are user-defined symbols, which SentencePiece matches inside any text: a "<2de>" typed
        # by a user would become the control id and steer the model. In text it is spelt out instead.
        self._spelt_tags = {
            tag_id: [self.sp.piece_to_id(char) for char in LANG_TAGS[lang]] for lang, tag_id in self.tag_ids.items()
        }
        # One model, every direction between its tagged languages.
        tags = sorted(self.tag_ids)
        self.directions = Directions.of_pairs([(s, t) for s in tags for t in tags if s != t])

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    def encode_source(self, text: str, target_lang: str, source_lang: str | None = None) -> list[int]:
        """`<2xx>` + pieces + EOS; the tag names the target, and the source's language is not written."""
        return [self.tag_ids[target_lang], *self.encode_text(text), EOS_ID]

    def encode_target(self, text: str) -> list[int]:
        """Pieces + EOS (the decoder input is BOS + these without the EOS)."""
        return [*self.encode_text(text), EOS_ID]

    def encode_text(self, text: str) -> list[int]:
        """Pieces only; a tag inside the text comes out as its characters, never as the control id."""
        return self._spell_tags(self.sp.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._spell_tags(ids) for ids in self.sp.encode(texts)]

    def segmentations(self, texts: list[str], n: int) -> list[list[tuple[list[int], float]]]:
        """The `n` most likely segmentations of each text with their unigram log-probabilities (the
        sum of their pieces' scores). Deterministic, unlike SentencePiece's own sampling, whose
        generator is not reproducible from one process to the next even with its seed set."""
        return [
            [(self._spell_tags(ids), sum(self.sp.get_score(i) for i in ids)) for ids in candidates]
            for candidates in self.sp.nbest_encode(texts, nbest_size=n)
        ]

    def _spell_tags(self, ids: list[int]) -> list[int]:
        if not self._spelt_tags.keys() & set(ids):
            return list(ids)
        return [spelt for i in ids for spelt in self._spelt_tags.get(i, [i])]

    def decode(self, ids: list[int]) -> str:
        """Ids back to text; special ids and tags are dropped, runs of spaces become one.

        An undertrained model sometimes emits the bare word-boundary piece before a word that starts
        with its own, which SentencePiece decodes as two spaces; training text never has them.
        """
        text = str(self.sp.decode([i for i in ids if i > EOS_ID and i not in self.tag_ids.values()]))
        return " ".join(text.split())
