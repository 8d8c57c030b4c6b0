"""Import a transformers translation model (OPUS-MT, NLLB-200, M2M100) into this project's model artifact.

    python -m export.hf --model DIR_OR_HUB_ID --out models/opus-mt-de-en [--source-lang de --target-lang en]

Reads config.json and picks the importer of its model_type (export/importers/: marian, m2m_100); then
generation_config.json where present, model.safetensors (without torch; a checkpoint only as
pytorch_model.bin, a pickle, needs torch: `pip install 'translate-service[train]'`) and the family's tokenizer
files. Writes config.json (model.config.ModelConfig), model.safetensors (float32, our names), the tokenizer
files, languages.json, decoding.json (the model's generation defaults) and MODEL_CARD.md. A hub id is fetched
with huggingface_hub (`pip install 'translate-service[import]'`). What the model does that ours cannot represent
fails the import with a message naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from export.fetch import FetchError, HubSettings, download, parse_name, resolve_commit
from export.importers import importer_for
from export.importers.card import card
from export.importers.files import DamagedFiles, Source, UnsupportedModel, load_weights, read_json, write_weights
from export.importers.generation import generation_defaults
from model.config import ModelConfig
from model.directions import LANGUAGES_FILE
from model.directory import DECODING_FILE, direction_names
from model.files import CONFIG_FILE, WEIGHTS_FILE, weights_sha256
from model.tokenizer import tokenizer_sha256

__all__ = ["IMPORT_RULES", "DamagedFiles", "UnsupportedModel", "import_model", "main", "parse_args"]

CARD_FILE = "MODEL_CARD.md"

# Raised whenever importing the same files gives another model directory (what a generation setting becomes, say):
# part of a hub build's cache key, so that a cached build made by older rules is built again
IMPORT_RULES = 5


def resolve(model: str) -> Source:
    """A local directory (a hub snapshot's named `org/name`), or a hub id fetched as export/fetch.py fetches it."""
    try:
        name = parse_name(model)
        if name.local is not None:
            return Source(name.local, name.repository)
        try:
            from huggingface_hub import constants  # it reads HF_HUB_CACHE and HF_HUB_OFFLINE at import
        except ImportError as exc:
            raise UnsupportedModel(
                f"{model} is not a directory; to fetch it from the hub: pip install 'translate-service[import]'"
            ) from exc
        hub = HubSettings(Path(constants.HF_HUB_CACHE), bool(constants.HF_HUB_OFFLINE))
        return Source(download(name, resolve_commit(name, hub), hub), name.repository)
    except FetchError as exc:
        raise UnsupportedModel(str(exc)) from exc


def import_model(args: argparse.Namespace) -> Path:
    source = resolve(args.model)
    hf = read_json(source.directory / CONFIG_FILE)
    if not hf:
        raise UnsupportedModel(f"no {CONFIG_FILE} in {source.directory}")
    importer = importer_for(hf.get("model_type"))
    cfg = importer.model_config(hf, args.max_len)
    weights = importer.weights(load_weights(source.directory), cfg)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    importer.tokenizer(source.directory, out, cfg)
    cfg = importer.generation(cfg, read_json(source.directory / "generation_config.json") or hf)  # ids checked
    directions = importer.directions(args, source, out)
    (out / LANGUAGES_FILE).write_text(json.dumps(directions.to_json(), indent=2, ensure_ascii=False) + "\n")
    cfg = ModelConfig(**{**cfg.to_dict(), "tokenizer_sha256": tokenizer_sha256(out, cfg.tokenizer)})
    write_weights(out / WEIGHTS_FILE, weights, weights.shapes)
    (out / CONFIG_FILE).write_text(cfg.to_json() + "\n")
    defaults = generation_defaults(source.directory, hf, direction_names(directions), weights_sha256(out))
    (out / DECODING_FILE).write_text(json.dumps(defaults, indent=2, sort_keys=True) + "\n")
    parameters = sum(int(np.prod(shape)) for shape in weights.shapes.values())
    (out / CARD_FILE).write_text(card(source, importer.architecture, cfg, directions, parameters))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m export.hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a transformers model directory or a hub id")
    parser.add_argument("--out", type=Path, required=True, help="the model directory to write")
    parser.add_argument("--source-lang", default=None, help="default: tokenizer_config.json or the model's name")
    parser.add_argument("--target-lang", default=None, help="default: tokenizer_config.json or the model's name")
    parser.add_argument("--max-len", type=int, default=512, help="longest source or output in tokens")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = import_model(args)
    except UnsupportedModel as exc:
        print(f"export.hf: error: {exc}", file=sys.stderr)
        return 2
    except KeyError as exc:  # a config without a field every config of its family has
        print(f"export.hf: error: {CONFIG_FILE} lacks {exc}", file=sys.stderr)
        return 2
    print(f"imported {args.model} to {out}; next: python -m export --model-dir {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
