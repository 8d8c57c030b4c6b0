"""python -m export --model-dir DIR [--out DIR] [--variants fp32,int8,fp16] [--opset 18] [--int8-7bit]
[--capturable-fp32]"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from export.builder.build import SUPPORTED_OPSETS, export_float
from export.quantize import export_int8
from model.config import ModelConfig
from model.directory import VARIANTS
from model.files import CONFIG_FILE, WEIGHTS_FILE, load_config


class ExportError(Exception):
    """Bad input to the exporter; reported as one line and exit status 2."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None, help="default: <model-dir>/onnx")
    parser.add_argument("--variants", default="fp32,int8,fp16")
    parser.add_argument("--opset", type=int, default=18)
    parser.add_argument(
        "--int8-7bit", action="store_true",
        help="int8 with 7-bit weights and a scale per output channel, for x86 CPUs without VNNI (gate it again)",
    )  # fmt: skip
    parser.add_argument(
        "--capturable-fp32", action="store_true",
        help="also the capturable step and fused graphs in fp32 (CPU tests of their arithmetic; nothing serves them)",
    )  # fmt: skip
    return parser.parse_args(argv)


def validate(model_dir: Path, variants: list[str], opset: int) -> None:
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (model_dir / name).is_file():
            raise ExportError(f"missing {name} in model directory {model_dir}")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ExportError(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if opset not in SUPPORTED_OPSETS:
        raise ExportError(
            f"unsupported opset {opset}; supported: {SUPPORTED_OPSETS.start}..{SUPPORTED_OPSETS.stop - 1}"
        )
    try:
        cfg = load_config(model_dir)
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        raise ExportError(f"bad {CONFIG_FILE} in {model_dir}: {exc}") from exc
    validate_tokenizer(model_dir, cfg)


def validate_tokenizer(model_dir: Path, cfg: ModelConfig) -> None:
    """The tokenizer files are there, are those the weights recorded, and fit the source vocabulary."""
    from model.tokenizer import open_tokenizer, tokenizer_files

    for path in tokenizer_files(model_dir, cfg.tokenizer):
        if not path.is_file():
            raise ExportError(f"missing {path.name} in model directory {model_dir}")
    try:
        vocab = open_tokenizer(model_dir, cfg.tokenizer, cfg.tokenizer_sha256).vocab_size
    except ValueError as exc:
        raise ExportError(str(exc)) from exc
    # NLLB's and M2M100's embeddings have rows past their tokenizers' ids (M2M100's madeup words, NLLB's spare
    # rows), which no source holds; every other tokenizer fills its embedding exactly
    fits = vocab <= cfg.source_vocab_size if cfg.tokenizer == "m2m" else vocab == cfg.source_vocab_size
    if not fits:
        raise ExportError(f"config vocab_size {cfg.source_vocab_size} does not match the tokenizer's {vocab}")


def run(
    model_dir: Path, out: Path, variants: list[str], opset: int, int8_7bit: bool = False, capturable_fp32: bool = False
) -> None:
    validate(model_dir, variants, opset)
    if "fp32" in variants or capturable_fp32:
        export_float(model_dir, out / "fp32", "fp32", opset, capturable_fp32)
    if "int8" in variants:
        export_int8(model_dir, out / "int8", per_channel=int8_7bit, reduce_range=int8_7bit, opset=opset)
    if "fp16" in variants:
        export_float(model_dir, out / "fp16", "fp16", opset)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    try:
        out = args.out or args.model_dir / "onnx"
        run(args.model_dir, out, variants, args.opset, args.int8_7bit, args.capturable_fp32)
    except ExportError as exc:
        print(f"export: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
