"""MODEL_CARD.md of an imported model: where it came from, its licence, directions and shape."""

from __future__ import annotations

import re

from export.importers.files import Source
from model.config import ModelConfig
from model.directions import Directions

LISTED_DIRECTIONS = 12  # a many-to-many model's card names this many directions, then how many more


def card(source: Source, architecture: str, cfg: ModelConfig, directions: Directions, parameters: int) -> str:
    licence = "not stated in the source's README.md; see the source model's card"
    readme = source.directory / "README.md"
    if readme.is_file() and (match := re.search(r"^license:\s*(\S+)", readme.read_text(), re.MULTILINE)):
        licence = match.group(1)
    listed = directions_text(directions)
    return (
        f"# {source.name} (imported)\n\n"
        f"Imported from the transformers {architecture} `{source.name}` by `python -m export.hf`.\n\n"
        f"- Licence: {licence} (the source model's; it applies to these weights)\n"
        f"- Directions: {listed}\n"
        f"- Shape: d_model {cfg.d_model}, {cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, "
        f"{cfg.n_heads} heads, FFN {cfg.d_ff}, vocabulary {cfg.vocab_size}, {parameters:,} parameters\n"
        "- Scores: those of the source model's card; this import is checked equal to transformers "
        "(`python -m bench.hf_parity`), not re-scored.\n"
    )


def directions_text(directions: Directions) -> str:
    """The first LISTED_DIRECTIONS pairs and how many more, or an any-to-any model's languages counted."""
    if directions.any_to_any:
        return (
            f"any of {len(directions.sources)} source languages into any of {len(directions.targets)} target"
            f" languages but itself, {directions.count():,} directions (languages.json lists the languages)"
        )
    text = ", ".join(f"{s}->{t}" for s, t in directions.listed[:LISTED_DIRECTIONS])
    if directions.count() > LISTED_DIRECTIONS:
        text += f" and {directions.count() - LISTED_DIRECTIONS} more (languages.json)"
    return text
