"""Whether an imported model's float16 graphs may serve where `--variant auto` runs on CUDA: the gate a model
served by hub id gets in place of the BLEU gate, which needs a test set that the hub does not carry.

What float16 risks in weights trained in float32 is range and rounding: an activation past 65,504 turns into
inf and then NaN (the failure some Marian models show in float16), or rounding flips the decoder's choices.
This gate measures both on the provider that will serve the graphs. Probe sources are made of the source
vocabulary's most probable whole words (word salad in the source language, so no corpus is needed); the fp32
graphs decode them greedily; the fp16 graphs are then fed the same tokens (teacher forcing), and at every
position up to fp32's end of sentence the fp16 graphs' best token must be fp32's at AGREEMENT of the positions,
with every log-probability finite. The record goes into variants.json under the provider, marked
`"gate": AGREEMENT_GATE`, with the weights and the recipe it measured (model.directory.passed_gate trusts it for
fp16 alone: int8 changes the arithmetic on purpose, which only a BLEU gate prices).

    python -m export.fp16_gate --model-dir DIR --provider cuda [--record]   # measure (and record) it by hand
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from model.directory import AGREEMENT_GATE, DECODER_FILE, ENCODER_FILE, VARIANTS_FILE, ExportMetadata, read_metadata
from model.marian_tokenizer import MarianTokenizer

log = logging.getLogger(__name__)

AGREEMENT = 0.9  # least share of positions where fp16's best token is fp32's
PROBES = 24  # probe sentences
PROBE_WORDS = (6, 14)  # words per probe, at least and below at most
STEPS = 24  # decoder positions each probe runs, at most
FREQUENT_WORDS = 400  # the probes draw from the source vocabulary's this many most probable whole words
SEED = 0
PROVIDER_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
PROVIDER_OPTIONS = {"cuda": {"use_tf32": "0"}}  # float32 in float32, as the server runs it (server/backend/sessions.py)


@dataclass(frozen=True)
class Agreement:
    """fp16 against fp32 on the probes: positions compared, the share where the best tokens agree, and
    whether every fp16 log-probability was finite."""

    positions: int
    agreement: float
    finite: bool

    @property
    def passed(self) -> bool:
        return self.finite and self.agreement >= AGREEMENT


def probe_sources(model_dir: Path, count: int = PROBES, seed: int = SEED) -> list[list[int]]:
    """`count` word-salad sources in the model's source language, as model ids (with the first target's tag
    where the model has tags)."""
    tokenizer = MarianTokenizer(model_dir)
    sp = tokenizer.source_sp
    special = {i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)}
    words = [
        (sp.get_score(i), sp.id_to_piece(i)[1:])
        for i in range(sp.get_piece_size())
        if i not in special and sp.id_to_piece(i).startswith("\u2581") and sp.id_to_piece(i)[1:].isalpha()
    ]
    vocabulary = [word for _, word in sorted(words, key=lambda scored: -scored[0])[:FREQUENT_WORDS]]
    if not vocabulary:  # a vocabulary without whole words: any pieces
        vocabulary = [
            sp.id_to_piece(i).replace("\u2581", "") or "a" for i in range(sp.get_piece_size()) if i not in special
        ]
    rng = np.random.default_rng(seed)
    target = tokenizer.pairs[0][1]
    texts = [" ".join(rng.choice(vocabulary, size=int(rng.integers(*PROBE_WORDS)))) for _ in range(count)]
    return [tokenizer.encode_source(text, target) for text in texts]


class _Graphs:
    """One variant's encoder and decoder step, stepped with the caches in host memory."""

    def __init__(self, variant_dir: Path, provider: str) -> None:
        self.meta: ExportMetadata = read_metadata(variant_dir)
        if _name(provider) not in ort.get_available_providers():
            raise RuntimeError(f"onnxruntime offers no {_name(provider)} here")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # as the server opens them
        options.log_severity_level = 3  # onnxruntime's notes on node placement are not the gate's business
        providers = [(_name(provider), PROVIDER_OPTIONS.get(provider, {}))]
        self.encoder = ort.InferenceSession(str(variant_dir / ENCODER_FILE), options, providers=providers)
        self.decoder = ort.InferenceSession(str(variant_dir / DECODER_FILE), options, providers=providers)
        self.provider = self.decoder.get_providers()[0]
        self.dtype = np.float16 if self.meta.dtype == "float16" else np.float32
        layers = self.meta.n_decoder_layers
        self.new_names = [f"new_{kind}_{i}" for i in range(layers) for kind in ("k", "v")]
        self.past_names = [f"past_{kind}_{i}" for i in range(layers) for kind in ("k", "v")]

    def decode(self, sources: list[list[int]], steps: int, forced: np.ndarray | None) -> tuple[np.ndarray, bool]:
        """(B, steps) best token at each position, fed the best token (greedy) or `forced`'s; whether every
        log-probability was finite."""
        meta = self.meta
        ids = np.full((len(sources), max(map(len, sources))), meta.pad_id, dtype=np.int64)
        for row, source in enumerate(sources):
            ids[row, : len(source)] = source
        mask = ids != meta.pad_id
        names = [output.name for output in self.encoder.get_outputs()]
        cross = dict(zip(names, self.encoder.run(None, {"src_ids": ids, "src_mask": mask}), strict=True))
        rows = len(sources)
        past = [np.zeros((rows, meta.n_heads, 0, meta.head_dim), self.dtype) for _ in self.past_names]
        tokens = np.full(rows, meta.bos_id, dtype=np.int64)
        best, finite = [], True
        for position in range(steps):
            feeds = {
                "tokens": tokens, "positions": np.full(rows, position, dtype=np.int64), "src_mask": mask,
                "past_keep": np.ones((rows, position), dtype=bool), "row_scores": np.zeros(rows, np.float32),
                "top_k": np.asarray([1], np.int64), **cross, **dict(zip(self.past_names, past, strict=True)),
            }  # fmt: skip
            log_probs, *new = self.decoder.run(["log_probs", *self.new_names], feeds)
            finite = finite and bool(np.isfinite(log_probs).all())
            best.append(np.argmax(log_probs, axis=1))
            past = [np.concatenate([cache, step], axis=2) for cache, step in zip(past, new, strict=True)]
            tokens = best[-1] if forced is None else forced[:, position]
        return np.stack(best, axis=1), finite


def measure(model_dir: Path, provider: str) -> Agreement:
    """The fp16 graphs of `model_dir` against its fp32 graphs on `provider` (see the module docstring);
    RuntimeError where onnxruntime put a graph on another provider."""
    fp32, fp16 = (_Graphs(model_dir / "onnx" / variant, provider) for variant in ("fp32", "fp16"))
    if {fp32.provider, fp16.provider} != {_name(provider)}:
        raise RuntimeError(f"onnxruntime ran the graphs on {fp32.provider} and {fp16.provider}, not {_name(provider)}")
    sources = probe_sources(model_dir)
    steps = min(STEPS, fp32.meta.max_target_len)
    reference, reference_finite = fp32.decode(sources, steps, forced=None)
    candidate, finite = fp16.decode(sources, steps, forced=reference)
    # Positions up to and including fp32's first end of sentence: past it the fed tokens are nobody's output.
    ended = np.cumsum(reference == fp32.meta.eos_id, axis=1)
    compared = (ended == 0) | ((ended == 1) & (reference == fp32.meta.eos_id))
    agree = float((candidate == reference)[compared].mean())
    return Agreement(int(compared.sum()), round(agree, 4), finite and reference_finite)


def _name(provider: str) -> str:
    return PROVIDER_NAMES[provider]


def record_gate(model_dir: Path, provider: str, found: Agreement) -> None:
    """`found` as `provider`'s record in the model directory's variants.json (other providers' kept)."""
    meta = read_metadata(model_dir / "onnx" / "fp16")
    scores = {**asdict(found), "passed": found.passed, "recipe": meta.recipe}
    record = {
        "gate": AGREEMENT_GATE,
        "weights_sha256": meta.source_sha256,
        "probes": PROBES,
        "agreement_needed": AGREEMENT,
        "variants": {"fp16": scores},
    }
    path = model_dir / VARIANTS_FILE
    by_provider = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(by_provider | {provider: record}, indent=2, sort_keys=True) + "\n")


def gate_fp16(model_dir: Path, provider: str) -> Agreement | None:
    """Measure and record the gate on `provider`; None (nothing recorded) where onnxruntime cannot run that
    provider here, so that `auto` serves fp32 rather than trust a measurement made elsewhere."""
    try:
        found = measure(model_dir, provider)
    except RuntimeError as err:  # no such provider here, or its libraries failed to load
        log.warning("fp16 gate not measured (%s): auto serves fp32", err)
        return None
    record_gate(model_dir, provider, found)
    verdict = "passed" if found.passed else f"failed (needs {AGREEMENT} and finite): auto serves fp32"
    log.info("fp16 gate on %s: best tokens agree at %.1f%% of %d positions, finite %s: %s",
             provider, 100 * found.agreement, found.positions, found.finite, verdict)  # fmt: skip
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.fp16_gate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="an imported model with fp32 and fp16 graphs")
    parser.add_argument("--provider", choices=sorted(PROVIDER_NAMES), default="cuda")
    parser.add_argument("--record", action="store_true", help="write the result into the model's variants.json")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        found = measure(args.model_dir, args.provider)
    except RuntimeError as err:
        print(f"export.fp16_gate: error: {err}", file=sys.stderr)
        return 2
    if args.record:
        record_gate(args.model_dir, args.provider, found)
    seconds = round(time.monotonic() - started, 2)
    print(json.dumps({**asdict(found), "passed": found.passed, "provider": args.provider, "seconds": seconds}))
    return 0 if found.passed else 1


if __name__ == "__main__":
    sys.exit(main())
