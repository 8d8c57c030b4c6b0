"""Reading a transformers checkpoint's files, and the import's refusals: one line each, exit status 2."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError

from export.builder.weights import StoredWeights

PICKLED_WEIGHTS = "pytorch_model.bin"  # a torch pickle: older repositories ship only this (opus-mt-en-fr)


class UnsupportedModel(Exception):
    """The source is not a model this project can represent; reported as one line, exit status 2."""


class DamagedFiles(UnsupportedModel):
    """A file the model needs is missing or cannot be read: a download cut short, not an architecture."""


@dataclass(frozen=True)
class Source:
    directory: Path
    name: str  # the hub id or directory name, for the model card and the languages its name gives


def damaged(path: Path, why: str) -> DamagedFiles:
    """`path` cannot be read: DamagedFiles naming it and what to delete, with the huggingface_hub blob it links to
    (a snapshot's link deleted alone is linked again to the same damaged blob)."""
    blob = path.resolve()
    also = f" and {blob}, the blob it links to," if blob != path.parent.resolve() / path.name else ""
    return DamagedFiles(f"{path} {why}: a damaged or partial download; delete it{also} and fetch it again")


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path` ({} where there is no such file); UnsupportedModel naming a file that is not one
    (a download cut short leaves a truncated file)."""
    if not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise damaged(path, f"is not valid JSON ({exc})") from exc
    if not isinstance(found, dict):
        raise UnsupportedModel(f"{path.name} holds no JSON object")
    return found


def load_weights(directory: Path) -> Mapping[str, np.ndarray]:
    """model.safetensors (each tensor read when used), else pytorch_model.bin (older repositories ship only
    that; read whole)."""
    if (path := directory / "model.safetensors").is_file():
        try:
            return StoredWeights(path)
        except (SafetensorError, OSError, ValueError) as exc:  # cut short, or not safetensors at all
            raise damaged(path, f"cannot be read ({exc})") from exc
    if (directory / "pytorch_model.bin").is_file():
        return load_pickled_weights(directory / "pytorch_model.bin")
    raise UnsupportedModel(f"no model.safetensors or pytorch_model.bin in {directory}")


def load_pickled_weights(path: Path) -> dict[str, np.ndarray]:
    """A pytorch_model.bin: the one checkpoint format that needs torch to read, imported only here; loaded with
    weights_only, so that the pickle runs no code of its own."""
    try:
        import torch
    except ImportError:
        raise UnsupportedModel(torch_needed(str(path.parent))) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    # Cut short, no pickle, or one weights_only refuses (its UnpicklingError: the pickle module is never imported
    # here, so that nothing in the import path can unpickle by accident)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise damaged(path, f"cannot be read ({first})") from exc
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UnsupportedModel(f"{path} holds no state dict of tensors")
    return {name: tensor.float().numpy() for name, tensor in state.items()}


def torch_needed(what: str, repository: str | None = None) -> str:
    """The refusal of weights kept only in pytorch_model.bin where torch is not installed; `repository` where a
    hub revision with safetensors is the other way out."""
    other = (
        f"a revision with safetensors, such as a conversion pull request: {repository}@refs/pr/N"
        if repository
        else "the weights saved as model.safetensors (save_pretrained)"
    )
    install = "pip install 'translate-service[train]'"
    return f"{what} ships only {PICKLED_WEIGHTS}; reading it needs torch ({install}) or {other}"


def write_weights(path: Path, weights: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """A safetensors file of float32 `weights` written one tensor at a time, so that an import holds one tensor,
    not the model: the header (tensor names, shapes and offsets, padded to 8 bytes), then each tensor's bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    end = 0
    for name, shape in shapes.items():
        start, end = end, end + 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [start, end]}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, shape in shapes.items():
            array = np.ascontiguousarray(weights[name], dtype=np.float32)
            if array.shape != shape:
                raise UnsupportedModel(f"{name} holds {array.shape} values where its header said {shape}")
            out.write(array.data)
