"""The benchmark at OPUS-MT's size: a random MarianMTModel of opus-mt-de-en's exact shape (d_model 512,
6+6 layers, 8 heads, FFN 2048, vocabulary 58,101), imported and exported as a user imports a real one,
then measured by bench.run against CTranslate2 converted from the same transformers directory by
CTranslate2's own converter. Random weights: the figures compare engines on identical work, not quality.

    python -m bench.opus_size --out bench/results/opus-mt-de-en [--work DIR] [bench.run options ...]

Random weights never rank EOS first, so every sentence decodes exactly --max-len tokens in every engine;
the default, 16, is about what a real translation of a test sentence takes (13.2 pieces of English on
average). Sources are the test set's German side (de -> en, 667 sentences, 14.6 pieces on average).
Single-sentence latency runs over the first 100 sentences (bench.run's default budget: 200).

Everything built goes under --work (default: a temporary directory), nothing into the tree.
`--shape tiny` runs the same pipeline on a tiny random model in about a minute (the test's smoke run).

`--shape nllb-200-distilled-600M` does the same at the size NLLB users run (d_model 1024, 12+12 layers, 16 heads,
FFN 4096, 256,206 ids): a random M2M100ForConditionalGeneration with NLLB-200's tokenizer files, converted by
CTranslate2's own M2M100 loader; `nllb-tiny` is its smoke run. Needs about 8 GB of memory and 6 GB under --work;
`--shape nllb-200-1.3B` (24+24 layers, FFN 8192) about 12 GB of memory and 14 GB under --work.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import tempfile
from pathlib import Path

from bench import run
from bench.marian_random import SHAPES, build_random_dir

log = logging.getLogger("bench")
SHAPE = "opus-mt-de-en"


def prepare(work: Path, variants: str = "fp32,int8", shape: str = SHAPE) -> tuple[Path, Path]:
    """(transformers directory, our exported model directory), built once under `work`."""
    from export.__main__ import main as export_main
    from export.hf import main as import_main

    hf_dir, model_dir = work / "hf", work / "model"
    if not (hf_dir / "model.safetensors").is_file():
        log.info("building a random %s checkpoint in %s", shape, hf_dir)
        build_random_dir(hf_dir, shape)
    imported = (model_dir / "config.json").is_file()
    if not imported and import_main(["--model", str(hf_dir), "--out", str(model_dir)]) != 0:
        raise RuntimeError(f"importing {hf_dir} failed")
    if not all((model_dir / "onnx" / v / "decoder_step.onnx").is_file() for v in variants.split(",")):
        export_main(["--model-dir", str(model_dir), "--variants", variants])
    return hf_dir, model_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/opus-mt-de-en"))
    parser.add_argument("--work", type=Path, help="where the models are built (kept, and reused when present)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=SHAPE, help="tiny, nllb-tiny: smoke tests")
    parser.add_argument("--variants", default="fp32,int8", help="the variants to export")
    parser.add_argument("--prepare-only", action="store_true", help="build, import and export under --work; no bench")
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-opus-"))
    hf_dir, model_dir = prepare(work, args.variants, shape=args.shape)
    if args.prepare_only:
        return
    defaults = [] if "--max-len" in rest else ["--max-len", "16"]
    defaults += [] if "--latency-requests" in rest else ["--latency-requests", "100"]
    command = shlex.join(["python", "-m", "bench.opus_size", *(argv if argv is not None else sys.argv[1:])])
    paths = ["--model-dir", str(model_dir), "--hf-dir", str(hf_dir), "--out", str(args.out)]
    run.main([*paths, *defaults, *rest], command)


if __name__ == "__main__":
    main()
