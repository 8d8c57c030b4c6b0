"""Whether an imported model's float16 graphs may serve where `--variant auto` runs on CUDA: the gate a model served by
hub id gets in place of the BLEU gate, which needs a test set that the hub does not carry.

What float16 risks in weights trained in float32 is range and rounding: an activation past 65,504 turns into inf and
then NaN (the failure some Marian models show in float16), or rounding flips the decoder's choices. This gate
measures both on the provider that will serve the graphs. Probe sources are made of the source vocabulary's most
probable whole words (word salad in the source language, so no corpus is needed); the fp32 graphs decode them
greedily; each fp16 build is then fed the same tokens (teacher forcing): the plain encoder and step, and the fused
encoder and capturable fused step that `--kv-cache auto` serves on CUDA (over static buffers, bound as the server
binds them). A model whose target code is its forced first token (NLLB-200, M2M100) gets it at the first step, as
the server forces it, and that position is not compared. At every position up to fp32's end of sentence each build's
best token must be fp32's at AGREEMENT of the positions, with every log-probability finite. The record goes into
variants.json under the provider, marked `"gate": AGREEMENT_GATE`, with the weights and the recipe it measured
(model.directory.passed_gate trusts it for fp16 alone: int8 changes the arithmetic on purpose, which only a BLEU
gate prices).

    python -m export.fp16_gate --model-dir DIR --provider cuda [--record]   # measure (and record) it by hand

Exit status: 0 passed, 1 failed (both recorded with --record), 2 not measured (no such provider here, or
onnxruntime failed): `export.hub` runs it so, in a process of its own, so that the CUDA context it opens goes
with it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import sentencepiece as spm

from model.directory import (
    AGREEMENT_GATE,
    DECODER_FILE,
    ENCODER_FILE,
    FUSED_DECODER_FILE,
    FUSED_ENCODER_FILE,
    MAX_BIAS_PER_ROW,
    VARIANTS_FILE,
    ExportMetadata,
    buffer_head_dim,
    log_probs_from_ranking,
    read_metadata,
)
from model.files import load_config
from model.m2m_tokenizer import SPM_FILE as M2M_SPM
from model.marian_tokenizer import SOURCE_SPM
from model.tokenizer import open_tokenizer

log = logging.getLogger(__name__)

AGREEMENT = 0.9  # least share of positions where fp16's best token is fp32's
PROBES = 24  # probe sentences
PROBE_WORDS = (6, 14)  # words per probe, at least and below at most
STEPS = 24  # decoder positions each probe runs, at most
FREQUENT_WORDS = 400  # the probes draw from the source vocabulary's this many most probable whole words
SEED = 0
PROVIDER_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
PROVIDER_OPTIONS = {"cuda": {"use_tf32": "0"}}  # float32 in float32, as the server runs it (server/backend/sessions.py)
SOURCE_SPM_BY_SCHEME = {"marian": SOURCE_SPM, "m2m": M2M_SPM}  # the SentencePiece model the probes' words come from


@dataclass(frozen=True)
class Agreement:
    """fp16 against fp32 on the probes: positions compared, the share where the best tokens agree (the least
    of the fp16 builds'; each build's by its step graph's name), and whether every fp16 log-probability was
    finite."""

    positions: int
    agreement: float
    finite: bool
    by_graph: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.finite and self.agreement >= AGREEMENT


def probe_direction(model_dir: Path) -> tuple[str, str]:
    """The (source, target) the probes are translated in: the model's first source and its first target."""
    directions = open_tokenizer(model_dir, load_config(model_dir).tokenizer).directions
    return directions.sources[0], directions.targets_from(directions.sources[0])[0]


def probe_sources(model_dir: Path, count: int = PROBES, seed: int = SEED) -> list[list[int]]:
    """`count` word-salad sources in the model's source language, as model ids in `probe_direction` (with the
    target's tag, or the source's code, where the model reads one)."""
    scheme = load_config(model_dir).tokenizer
    tokenizer = open_tokenizer(model_dir, scheme)
    sp = spm.SentencePieceProcessor(model_file=str(model_dir / SOURCE_SPM_BY_SCHEME[scheme]))
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
    source, target = probe_direction(model_dir)
    texts = [" ".join(rng.choice(vocabulary, size=int(rng.integers(*PROBE_WORDS)))) for _ in range(count)]
    return [tokenizer.encode_source(text, target, source) for text in texts]


def forced_first(model_dir: Path, meta: ExportMetadata) -> int | None:
    """The probes' first output token where the model's is forced (the target's code), as the server forces it."""
    return meta.tag_ids[probe_direction(model_dir)[1]] if meta.spec().forced_bos else None


def _session(path: Path, provider: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # as the server opens them
    options.log_severity_level = 3  # onnxruntime's notes on node placement are not the gate's business
    providers = [(_name(provider), PROVIDER_OPTIONS.get(provider, {}))]
    return ort.InferenceSession(str(path), options, providers=providers)


class _Graphs:
    """One variant's encoder and ordinary decoder step, stepped over buffers of the model's whole target length,
    each bound as both past and present as the server binds them (server/backend/working_batch.py)."""

    encoder_file, step_file = ENCODER_FILE, DECODER_FILE

    def __init__(self, variant_dir: Path, provider: str) -> None:
        self.meta: ExportMetadata = read_metadata(variant_dir)
        if _name(provider) not in ort.get_available_providers():
            raise RuntimeError(f"onnxruntime offers no {_name(provider)} here")
        self.encoder = _session(variant_dir / self.encoder_file, provider)
        self.decoder = _session(variant_dir / self.step_file, provider)
        self.provider = self.decoder.get_providers()[0]
        self.device = "cuda" if self.provider == PROVIDER_NAMES["cuda"] else "cpu"
        self.dtype = np.float16 if self.meta.dtype == "float16" else np.float32
        self.past_names = [f"past_{kind}_{i}" for i in range(self.meta.n_decoder_layers) for kind in ("k", "v")]
        self.buffer_head_dim = buffer_head_dim(self.meta.head_dim)

    def _encode(self, sources: list[list[int]]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The sources' padding mask (B, S) and the encoder's cross keys and values by name."""
        ids = np.full((len(sources), max(map(len, sources))), self.meta.pad_id, dtype=np.int64)
        for row, source in enumerate(sources):
            ids[row, : len(source)] = source
        mask = ids != self.meta.pad_id
        names = [output.name for output in self.encoder.get_outputs()]
        return mask, dict(zip(names, self.encoder.run(None, {"src_ids": ids, "src_mask": mask}), strict=True))

    def decode(
        self, sources: list[list[int]], steps: int, forced: np.ndarray | None, first: int | None = None
    ) -> tuple[np.ndarray, bool]:
        """(B, steps) best token at each position (`first`, where given, at the first), fed the best token (greedy)
        or `forced`'s; whether every log-probability was finite."""
        self._start(sources)
        tokens = np.full(len(sources), self.meta.bos_id, dtype=np.int64)
        best, finite = [], True
        for position in range(steps):
            log_probs = self._step(tokens, np.full(len(sources), position, dtype=np.int64))
            finite = finite and bool(np.isfinite(log_probs).all())
            chosen = np.argmax(log_probs, axis=1)
            best.append(chosen if position or first is None else np.full_like(chosen, first))
            tokens = best[-1] if forced is None else forced[:, position]
        return np.stack(best, axis=1), finite

    def _start(self, sources: list[list[int]]) -> None:
        """Encode the sources; bind the step's outputs, the cross keys and values and empty key/value buffers."""
        meta, rows = self.meta, len(sources)
        mask, cross = self._encode(sources)
        binding = self.binding = self.decoder.io_binding()
        self._bind_outputs(binding)
        outputs = {output.name for output in self.decoder.get_outputs()}
        for name, value in cross.items():
            feed = ort.OrtValue.ortvalue_from_numpy(value, self.device, 0)
            binding.bind_ortvalue_input(name, feed)
            if f"cross_present_{name.removeprefix('cross_')}" in outputs:  # the ordinary step: GroupQueryAttention
                binding.bind_ortvalue_output(f"cross_present_{name.removeprefix('cross_')}", feed)
        shape = (rows, meta.n_heads, meta.max_target_len, self.buffer_head_dim)
        for past in self.past_names:
            buffer = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self.dtype), self.device, 0)
            binding.bind_ortvalue_input(past, buffer)
            binding.bind_ortvalue_output(f"present_{past.removeprefix('past_')}", buffer)
        binding.bind_cpu_input("src_mask", mask)
        if "cross_rows" in {arg.name for arg in self.decoder.get_inputs()}:  # the ordinary step: a group per row
            binding.bind_cpu_input("cross_rows", np.arange(rows, dtype=np.int64)[:, None])
            binding.bind_cpu_input("row_cross", np.arange(rows, dtype=np.int64))
        binding.bind_cpu_input("row_scores", np.zeros(rows, np.float32))
        self._bind_bias(binding, rows)

    def _bind_outputs(self, binding: ort.IOBinding) -> None:
        for name in ("top_scores", "top_ids"):  # every id ranked: the whole distribution, on the host
            binding.bind_output(name, "cpu")

    def _bind_bias(self, binding: ort.IOBinding, rows: int) -> None:
        binding.bind_cpu_input("bias_ids", np.zeros((rows, 1), np.int64))
        binding.bind_cpu_input("bias_values", np.zeros((rows, 1), np.float32))
        binding.bind_cpu_input("top_k", np.asarray([self.meta.vocab_size], np.int64))

    def _step(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """(B, V) log-probabilities of one step; its keys and values written into the bound buffers."""
        self.binding.bind_cpu_input("tokens", tokens)
        self.binding.bind_cpu_input("positions", positions)
        self.decoder.run_with_iobinding(self.binding)
        scores, ids = (value.numpy() for value in self.binding.get_outputs()[:2])  # bound first, then the buffers
        return log_probs_from_ranking(scores, ids, self.meta.vocab_size)


class _FusedGraphs(_Graphs):
    """The fused encoder and the capturable fused step, whose log_probs output is the whole distribution."""

    encoder_file, step_file = FUSED_ENCODER_FILE, FUSED_DECODER_FILE

    def _bind_outputs(self, binding: ort.IOBinding) -> None:
        binding.bind_output("log_probs", "cpu")  # the first output bound: get_outputs()[0], on the host
        for name in ("top_scores", "top_ids"):
            binding.bind_output(name, self.device, 0)

    def _bind_bias(self, binding: ort.IOBinding, rows: int) -> None:
        binding.bind_cpu_input("bias_ids", np.zeros((rows, MAX_BIAS_PER_ROW), np.int64))
        binding.bind_cpu_input("bias_values", np.zeros((rows, MAX_BIAS_PER_ROW), np.float32))

    def _step(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        self.binding.bind_cpu_input("tokens", tokens)
        self.binding.bind_cpu_input("positions", positions)
        self.decoder.run_with_iobinding(self.binding)
        return np.asarray(self.binding.get_outputs()[0].numpy())  # the buffers stay where they are


def measure(model_dir: Path, provider: str) -> Agreement:
    """The fp16 builds of `model_dir` against its fp32 graphs on `provider` (see the module docstring);
    RuntimeError where onnxruntime put a graph on another provider."""
    reference_graphs = _Graphs(model_dir / "onnx" / "fp32", provider)
    fp16_dir = model_dir / "onnx" / "fp16"
    builds = [_Graphs(fp16_dir, provider)]
    if (fp16_dir / FUSED_DECODER_FILE).is_file() and (fp16_dir / FUSED_ENCODER_FILE).is_file():
        builds.append(_FusedGraphs(fp16_dir, provider))
    if {g.provider for g in (reference_graphs, *builds)} != {_name(provider)}:
        raise RuntimeError(
            f"onnxruntime ran the graphs on {sorted({g.provider for g in (reference_graphs, *builds)})}, not "
            f"{_name(provider)}"
        )
    sources, first = probe_sources(model_dir), forced_first(model_dir, reference_graphs.meta)
    steps = min(STEPS, reference_graphs.meta.max_target_len)
    reference, finite = reference_graphs.decode(sources, steps, forced=None, first=first)
    # Positions up to and including fp32's first end of sentence: past it the fed tokens are nobody's output.
    eos = reference_graphs.meta.eos_id
    ended = np.cumsum(reference == eos, axis=1)
    compared = (ended == 0) | ((ended == 1) & (reference == eos))
    if first is not None:  # the forced code is nobody's choice
        compared[:, 0] = False
    by_graph: dict[str, float] = {}
    for build in builds:
        candidate, build_finite = build.decode(sources, steps, forced=reference, first=first)
        finite = finite and build_finite
        by_graph[build.step_file] = round(float((candidate == reference)[compared].mean()), 4)
    return Agreement(int(compared.sum()), min(by_graph.values()), finite, by_graph)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.fp16_gate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="an imported model with fp32 and fp16 graphs")
    parser.add_argument("--provider", choices=sorted(PROVIDER_NAMES), default="cuda")
    parser.add_argument("--record", action="store_true", help="write the result into the model's variants.json")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        found = measure(args.model_dir, args.provider)
    except Exception as err:  # onnxruntime's own errors are no RuntimeError
        print(f"export.fp16_gate: error: not measured: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    if args.record:
        record_gate(args.model_dir, args.provider, found)
    seconds = round(time.monotonic() - started, 2)
    print(json.dumps({**asdict(found), "passed": found.passed, "provider": args.provider, "seconds": seconds}))
    return 0 if found.passed else 1


if __name__ == "__main__":
    sys.exit(main())
