"""Importers of transformers checkpoints into this project's model artifact, one module per model family,
registered by config.json's `model_type` (export/importers/registry.py)."""

from export.importers import m2m_100, marian  # noqa: F401  (each registers its family)
from export.importers.registry import IMPORTERS, Importer, families, importer_for

__all__ = ["IMPORTERS", "Importer", "families", "importer_for", "required_files"]


def required_files(model_type: object) -> tuple[str, ...]:
    """What a snapshot of `model_type`'s family must hold beside config.json and its weights; UnsupportedModel
    naming an unknown family and the families served."""
    return type(importer_for(model_type)).required_files
