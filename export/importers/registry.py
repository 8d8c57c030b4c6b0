"""The importer of each model family, registered by config.json's `model_type` (as CTranslate2 registers a
loader per transformers config): what a family's files hold and how they become this project's artifact."""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from export.importers.files import Source, UnsupportedModel
from export.importers.generation import ending
from export.importers.weights import ConvertedWeights, convert_weights
from model.config import ModelConfig
from model.directions import Directions

IMPORTERS: dict[str, type[Importer]] = {}


class Importer(ABC):
    """One model family: its config mapping, weight names, tokenizer files, generation settings and languages."""

    model_type: ClassVar[str]  # config.json's model_type
    architecture: ClassVar[str]  # transformers' class, for the model card
    served: ClassVar[str]  # the releases it carries, for the refusal of other families
    required_files: ClassVar[tuple[str, ...]]  # what a snapshot must hold beside config.json and the weights

    @abstractmethod
    def model_config(self, hf: dict[str, Any], max_len: int) -> ModelConfig:
        """Our config for the family's config.json; UnsupportedModel for what ours cannot represent."""

    def weights(self, hf: Mapping[str, np.ndarray], cfg: ModelConfig) -> ConvertedWeights:
        """transformers' state dict -> ours."""
        return convert_weights(hf, cfg)

    @abstractmethod
    def tokenizer(self, directory: Path, out: Path, cfg: ModelConfig) -> None:
        """The tokenizer files written into `out`, each read and checked against the config's ids first."""

    def generation(self, cfg: ModelConfig, gen: dict[str, Any]) -> ModelConfig:
        """`cfg` with what the generation config makes generate() do."""
        return ending(cfg, gen)

    @abstractmethod
    def directions(self, args: argparse.Namespace, source: Source, out: Path) -> Directions:
        """The (source, target) language pairs the model translates, in its own codes."""


def register(importer: type[Importer]) -> type[Importer]:
    """Class decorator: `importer` serves its model_type."""
    IMPORTERS[importer.model_type] = importer
    return importer


def families() -> str:
    """The families served, as a refusal names them: `m2m_100 (NLLB-200, M2M100), marian (OPUS-MT)`."""
    return ", ".join(f"{name} ({IMPORTERS[name].served})" for name in sorted(IMPORTERS))


def importer_for(model_type: object) -> Importer:
    """The registered importer of `model_type`; UnsupportedModel naming it and the families served."""
    importer = IMPORTERS.get(model_type) if isinstance(model_type, str) else None
    if importer is None:
        raise UnsupportedModel(f"model_type is {model_type!r}; the importer carries {families()}")
    return importer()
