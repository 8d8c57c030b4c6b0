"""The model-directory contract, below both export/ and server/: file names, the metadata written beside
each exported variant (versioned), the model spec the engine needs, and the files tracked beside a model
that the service reads (variants.json: the BLEU gate; decoding.json: decoding defaults); never training
flags. Imports neither torch nor onnxruntime."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model.directions import Directions, DirectionsError

log = logging.getLogger(__name__)

METADATA_FILE = "metadata.json"
ENCODER_FILE = "encoder.onnx"
DECODER_FILE = "decoder_step.onnx"
# The decoder step built from onnxruntime's fused contrib ops with fixed shapes, so that CUDA can capture it
# (export/builder/fused_step.py), beside the ordinary one in the fp16 variant (and fp32 when asked) of models whose
# head size GroupQueryAttention takes; read only by the captured runner (`--kv-cache fused`).
FUSED_DECODER_FILE = "decoder_step_fused.onnx"
FUSED_ENCODER_FILE = "encoder_fused.onnx"  # the encoder from fused ops (export/builder/fused_encoder.py), beside it
STATIC_TOP_K = 16  # candidates the captured step ranks per row: 2 x the widest beam a request may ask for
# Most bias entries (token id, value) a decoder step takes per row, in every runner: the fixed width of the
# captured step's bias inputs, which a captured graph cannot widen.
MAX_BIAS_PER_ROW = 32


def log_probs_from_ranking(scores: np.ndarray, ids: np.ndarray, vocab: int) -> np.ndarray:
    """(B, V) float32 log-probabilities from a decoder step that ranked every id (`top_k` = V, row scores 0, no
    bias): each score back in its id's column. The ordinary step outputs no (B, V) distribution; parity checks
    read it this way. A column no candidate fills stays NaN: a row of NaN ranks the graph's padding columns."""
    log_probs = np.full((len(ids), vocab), np.nan, np.float32)
    rows, ranks = np.nonzero(ids < vocab)
    log_probs[rows, ids[rows, ranks]] = scores[rows, ranks]
    return log_probs


# The captured step's self-attention is onnxruntime's GroupQueryAttention, whose kernels take head sizes in
# multiples of this: a model of another head size has no capturable step, whatever the export is asked.
HEAD_DIM_MULTIPLE = 8
# Weightless graphs that move cache rows on the device (export/kv_ops.py), beside the fused graphs
KV_MOVE_FILE = "kv_move.onnx"
KV_WRITE_FILE = "kv_write.onnx"
# The layout of an exported variant directory. Bump it whenever what export writes changes meaning; the
# server then refuses older exports with a message naming the command that rebuilds them.
FORMAT_VERSION = 6
VARIANT_FILES = (METADATA_FILE, ENCODER_FILE, DECODER_FILE)  # what every variant holds
VARIANTS = ("fp32", "int8", "fp16")
# The onnxruntime whose GroupQueryAttention takes query_seqlens with attention_bias: several queries per cross group
QUERY_SEQLENS_SINCE = (1, 32)
VARIANTS_FILE = "variants.json"  # BLEU gate results, tracked beside the shipped model
AGREEMENT_GATE = "fp16 agreement"  # a variants.json record of export/fp16_gate.py (imported models), not BLEU
DECODING_FILE = "decoding.json"  # decoding defaults tuned on the validation set, tracked beside the model
DEFAULT_LENGTH_PENALTY = 1.0  # for a direction the model directory has no tuned value for
# decoding.json's length-penalty key (and ListModels') for every direction without a value of its own: an
# any-to-any model's one default, where naming each of its directions would name thousands
EVERY_DIRECTION = "*"
MAX_LENGTH_PENALTY = 2.0
DEFAULT_BY_PROVIDER = {"cuda": "fp16", "cpu": "int8"}


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know of a model; read from the exported metadata."""

    vocab_size: int  # V: token ids are 0 .. V - 1; a step ranks at most V candidates per row
    max_source_len: int  # longest source in tokens, language tag and EOS included
    max_target_len: int  # most tokens a slot can feed (and so generate)
    bos_id: int  # first decoder input of every row
    eos_id: int  # ends a hypothesis
    pad_id: int  # never produced
    tag_ids: dict[str, int]  # target-language tag id by language code, e.g. {"en": 4, "de": 5}; {} if none
    directions: Directions  # the (source, target) language pairs the model translates, listed or any to any
    source_vocab_size: int  # source ids are 0 .. source_vocab_size - 1 (a model may have two vocabularies)
    forced_eos: bool = False  # a hypothesis at the output limit ends with EOS (ModelConfig.forced_eos_at_limit)
    patient_beam: bool = False  # beam search stops only when no live row could beat the K-th (ModelConfig's)
    # The target language's code is the first generated token, at log-probability 0 (ModelConfig.forced_bos)
    forced_bos: bool = False
    banned_words: tuple[tuple[int, ...], ...] = ()  # sequences no hypothesis completes (ModelConfig's)


def capturable_head_dim(head_dim: int) -> bool:
    """Whether a model of this head size can have the capturable step (and so the captured runner)."""
    return head_dim % HEAD_DIM_MULTIPLE == 0


def buffer_head_dim(head_dim: int) -> int:
    """The head size of the ordinary decoder step's key/value buffers: the model's, padded with zeros up to a
    multiple of HEAD_DIM_MULTIPLE, which the step's attention kernel needs."""
    return -(-head_dim // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


def takes_cross_groups(onnxruntime_version: str) -> bool:
    """Whether this onnxruntime runs a step with several queries per cross group (`ExportMetadata.cross_groups`)."""
    return tuple(int(part) for part in onnxruntime_version.split(".")[:2]) >= QUERY_SEQLENS_SINCE


class MetadataError(ValueError):
    """An export directory is missing files or does not match its metadata."""


@dataclass(frozen=True)
class ExportMetadata:
    format_version: int  # FORMAT_VERSION of the export that wrote it
    model_config: dict[str, Any]  # model.config.ModelConfig as a dict
    variant: str  # fp32 | int8 | fp16
    dtype: str  # float dtype of the graph's activations: float32 | float16
    opset: int  # ONNX opset of both graphs
    exporter: str  # e.g. "torch 2.x onnx (dynamo=False)"
    source_sha256: str  # sha256 of the source model.safetensors
    n_decoder_layers: int
    n_heads: int
    head_dim: int
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    tag_ids: dict[str, int]  # target-language tag id by language code; {} for a single-pair model
    languages: dict[str, Any]  # the directions it translates, as languages.json writes them (model.directions)
    max_source_len: int
    max_target_len: int
    # How the graphs were derived from the weights (dtype, quantization scheme); the BLEU gate is trusted
    # only for the recipe it measured.
    recipe: str
    # The decoder step's cross groups take several queries each (a sentence's beams share one copy of its
    # source's keys and values): export.builder.decoder.shares_cross_groups. Else every group is one row.
    cross_groups: bool

    def spec(self) -> ModelSpec:
        return ModelSpec(
            vocab_size=self.vocab_size,
            max_source_len=self.max_source_len,
            max_target_len=self.max_target_len,
            bos_id=self.bos_id,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            tag_ids=dict(self.tag_ids),
            directions=Directions.from_json(self.languages, METADATA_FILE),
            source_vocab_size=int(self.model_config.get("src_vocab_size") or self.vocab_size),
            forced_eos=bool(self.model_config.get("forced_eos_at_limit", False)),
            patient_beam=bool(self.model_config.get("patient_beam", False)),
            forced_bos=bool(self.model_config.get("forced_bos", False)),
            banned_words=tuple(tuple(word) for word in self.model_config.get("banned_words", ())),
        )

    def write(self, variant_dir: Path) -> Path:
        path = variant_dir / METADATA_FILE
        path.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
        return path


def read_metadata(variant_dir: Path) -> ExportMetadata:
    """Read and check a variant directory: this format version, every graph present, metadata complete and
    consistent."""
    rebuild = f"export it again with python -m export --model-dir {variant_dir.parent.parent}"
    if not (variant_dir / METADATA_FILE).is_file():
        raise MetadataError(f"missing {METADATA_FILE} in export directory {variant_dir}")
    data = json.loads((variant_dir / METADATA_FILE).read_text())
    found = data.get("format_version") if isinstance(data, dict) else None
    if found != FORMAT_VERSION:
        raise MetadataError(f"{variant_dir} is in model-directory format {found}, not {FORMAT_VERSION}: {rebuild}")
    for name in VARIANT_FILES:
        if not (variant_dir / name).is_file():
            raise MetadataError(f"missing {name} in export directory {variant_dir}: {rebuild}")
    try:
        meta = ExportMetadata(**data)
        Directions.from_json(meta.languages, str(variant_dir / METADATA_FILE))
    except (TypeError, DirectionsError) as exc:
        raise MetadataError(f"{variant_dir / METADATA_FILE} does not match ExportMetadata ({exc}): {rebuild}") from exc
    cfg = meta.model_config
    expected = {"vocab_size": meta.vocab_size, "n_heads": meta.n_heads, "n_decoder_layers": meta.n_decoder_layers}
    mismatched = [k for k, v in expected.items() if cfg.get(k) != v]
    if mismatched or cfg.get("d_model", 0) != meta.n_heads * meta.head_dim:
        raise MetadataError(f"{variant_dir / METADATA_FILE}: model config disagrees on {mismatched or ['d_model']}")
    if variant_dir.name in VARIANTS and meta.variant != variant_dir.name:
        raise MetadataError(f"{variant_dir} holds variant {meta.variant!r}")
    return meta


def available_variants(model_dir: Path) -> list[str]:
    """Variants exported under `<model_dir>/onnx`, in the canonical order."""
    root = model_dir / "onnx"
    return [v for v in VARIANTS if all((root / v / f).is_file() for f in VARIANT_FILES)]


GATE_BEAM_SIZE = 4  # the gate's search: what the server decodes by default
# CPU features that give int8 matrix products their own kernels (exact int32 dot products). Without them
# onnxruntime multiplies u8 x s8 pairs into int16 first, which saturates with 8-bit weights: an int8 gate
# measured with them says nothing about a CPU without them (export --int8-7bit is the recipe for those).
INT8_DOT_FLAGS = {"vnni": ("avx512_vnni", "avx_vnni", "amx_int8"), "dotprod": ("asimddp", "i8mm")}


def int8_kernels(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This CPU's class for int8 matrix products: "vnni" (x86), "dotprod" (Arm), "plain", or "unknown"."""
    if not cpuinfo.is_file():
        return "unknown"
    flags = {
        flag
        for line in cpuinfo.read_text().splitlines()
        if line.startswith(("flags", "Features")) and ":" in line
        for flag in line.split(":", 1)[1].split()
    }
    return next((kind for kind, names in INT8_DOT_FLAGS.items() if flags & set(names)), "plain")


def passed_gate(model_dir: Path, variant: str, provider: str) -> bool:
    """True if `variants.json` records this variant's BLEU within the gate of fp32, measured with the
    provider that will serve it, on the whole test set, on the weights its graphs were exported from,
    on graphs made by the same recipe (a changed quantization scheme must be measured again), with the
    search the server runs (beam 4, today's `decoding.json` length penalties), and for int8 on a CPU of
    the same int8 class (`int8_kernels`).

    The file keeps one measurement per provider. The provider matters for fp16: on CPU onnxruntime runs
    most fp16 ops in float32 (it inserts casts), so a CPU gate says little about fp16 on CUDA. A gate
    measured elsewhere, on other weights (retrained, exported again, not re-scored) or on a subset says
    nothing about these graphs: "auto" then serves fp32 and says why, rather than a variant never checked.
    An imported model built by `translate-server --model` on CUDA carries an agreement record instead
    (export/fp16_gate.py: its fp16 graphs against its fp32 graphs, no test set needed), trusted for fp16 only.
    """
    path = model_dir / VARIANTS_FILE
    if not path.is_file():
        return False
    record = json.loads(path.read_text()).get(provider)
    if record is not None and record.get("gate") == AGREEMENT_GATE:  # a hub build's: no test set to run BLEU on
        fix = f"run python -m export.fp16_gate --model-dir {model_dir} --provider {provider} --record"
    else:
        fix = f"run python -m server.gates.variants --model-dir {model_dir} --provider {provider}"
    if record is None:
        log.warning("%s holds no BLEU gate measured with the %s provider: not serving %s; %s",
                    path, provider, variant, fix)  # fmt: skip
        return False
    scores = record.get("variants", {}).get(variant, {})
    if not scores.get("passed", False):
        if record.get("gate") == AGREEMENT_GATE and scores:
            log.warning("%s: %s failed its agreement gate with fp32 on %s (%s): not serving it",
                        path, variant, provider, {k: scores.get(k) for k in ("agreement", "finite")})  # fmt: skip
        return False
    meta = read_metadata(model_dir / "onnx" / variant)
    weights = meta.source_sha256
    if scores.get("recipe") != meta.recipe:
        log.warning("%s measured %s graphs made another way (%r) than these (%r): not trusted; %s",
                    path, variant, scores.get("recipe"), meta.recipe, fix)  # fmt: skip
        return False
    if record.get("weights_sha256") != weights:
        log.warning("%s was measured on other weights than the %s graphs' (%s...): not trusted; %s",
                    path, variant, weights[:12], fix)  # fmt: skip
        return False
    if record.get("gate") == AGREEMENT_GATE:  # fp16 against fp32 on probes (export/fp16_gate.py): float16 alone
        return variant == "fp16"
    if record.get("limit") is not None:
        log.warning("%s was measured on the first %s test pairs only: not trusted; %s", path, record["limit"], fix)
        return False
    return _same_search(path, record, model_dir, weights, fix) and _same_int8_cpu(path, record, variant, provider, fix)


def _same_search(path: Path, record: dict[str, Any], model_dir: Path, weights: str, fix: str) -> bool:
    """The gate decoded as the server will: beam 4, the length penalties `decoding.json` sets today."""
    if record.get("beam_size") != GATE_BEAM_SIZE:
        log.warning("%s was measured with beam %s, not %d: not trusted; %s",
                    path, record.get("beam_size"), GATE_BEAM_SIZE, fix)  # fmt: skip
        return False
    measured = record.get("length_penalty")
    if not isinstance(measured, dict) or read_length_penalties(model_dir, measured, weights) != measured:
        log.warning("%s was measured with length penalties %s, not today's decoding.json: not trusted; %s",
                    path, measured, fix)  # fmt: skip
        return False
    return True


def _same_int8_cpu(path: Path, record: dict[str, Any], variant: str, provider: str, fix: str) -> bool:
    if variant != "int8" or provider != "cpu":
        return True
    here = int8_kernels()
    if record.get("cpu_int8") != here or here == "unknown":
        measured = record.get("cpu_int8")
        log.warning("%s measured int8 on a CPU with %s int8 kernels, this one has %s: not trusted; %s on this "
                    "CPU (or export --int8-7bit where it lacks VNNI)", path, measured, here, fix)  # fmt: skip
        return False
    return True


def choose_variant(model_dir: Path, requested: str, provider: str) -> str:
    """Resolve "auto" to the provider's fast variant if it passed its gate (`passed_gate`), else fp32."""
    available = available_variants(model_dir)
    if requested != "auto":
        if requested not in available:
            raise MetadataError(f"variant {requested!r} is not exported under {model_dir / 'onnx'} ({available})")
        return requested
    preferred = DEFAULT_BY_PROVIDER.get(provider)
    if preferred in available and passed_gate(model_dir, preferred, provider):
        return preferred
    if "fp32" not in available:
        raise MetadataError(f"no fp32 export under {model_dir / 'onnx'}; run python -m export --model-dir {model_dir}")
    return "fp32"


def direction_name(source: str, target: str) -> str:
    """How a translation direction is named in files, metrics and ListModels: "de-en"."""
    return f"{source}-{target}"


def read_decoding_defaults(model_dir: Path, weights_sha256: str) -> tuple[int | None, int | None]:
    """decoding.json's default beam width and output limit (an imported model's generation defaults, which
    `python -m export.hf` writes); None where it sets none. Checked like the length penalties."""
    path = model_dir / DECODING_FILE
    record = json.loads(path.read_text()) if path.is_file() else {}
    if not isinstance(record, dict) or not {"beam_size", "max_output_len"} & set(record):
        return None, None
    if record.get("weights_sha256") != weights_sha256:
        raise MetadataError(f"{path} was written for other weights than the exported graphs'; import the model again")
    values = [record.get(name) for name in ("beam_size", "max_output_len")]
    for name, value in zip(("beam_size", "max_output_len"), values, strict=True):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise MetadataError(f"{path}: {name} must be a whole number >= 0, got {value!r}")
    beam, max_output_len = values
    return (beam or None), (max_output_len or None)


def direction_names(directions: Directions) -> list[str]:
    """How decoding.json and ListModels key a model's length penalties: each listed pair by `direction_name`,
    an any-to-any model's directions all by EVERY_DIRECTION."""
    if directions.any_to_any:
        return [EVERY_DIRECTION]
    return [direction_name(s, t) for s, t in directions.listed]


def served_length_penalty(value: object) -> bool:
    """Whether `value` is a length penalty the server serves: a number in 0..MAX_LENGTH_PENALTY."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0.0 <= value <= MAX_LENGTH_PENALTY


def read_length_penalties(model_dir: Path, directions: Iterable[str], weights_sha256: str) -> dict[str, float]:
    """The default length penalty of every direction: `decoding.json`'s value for it, else its value for
    EVERY_DIRECTION (which the result then holds too), else 1.0.

    `python -m server.gates.length_penalty --write` tunes it per direction on the validation set. The file
    must name the weights the graphs were exported from (`weights_sha256`): a value tuned on other
    weights is refused, not served silently. Values are rounded to float32, the proto's type, so a
    client that sends back what ListModels reported decodes exactly as with the default.
    """
    defaults = dict.fromkeys(directions, DEFAULT_LENGTH_PENALTY)
    path = model_dir / DECODING_FILE
    if not path.is_file():
        return defaults
    record = json.loads(path.read_text())
    tuned = record.get("length_penalty") if isinstance(record, dict) else None
    if not isinstance(tuned, dict):
        raise MetadataError(f'{path}: expected {{"length_penalty": {{"de-en": 1.0, ...}}, "weights_sha256": ...}}')
    if record.get("weights_sha256") != weights_sha256:
        raise MetadataError(
            f"{path} was tuned on other weights than the exported graphs' ({weights_sha256[:12]}...): "
            f"run python -m server.gates.length_penalty --model-dir {model_dir} --values 0.6,0.8,1.0,1.2,1.4,1.6 "
            "--write, or delete it to serve 1.0"
        )
    if unknown := sorted(set(tuned) - set(defaults) - {EVERY_DIRECTION}):
        raise MetadataError(f"{path} sets a length penalty for {unknown}; the model translates {sorted(defaults)}")
    for name, value in tuned.items():
        if not served_length_penalty(value):
            raise MetadataError(f"{path}: length_penalty[{name!r}] must be a number in 0..{MAX_LENGTH_PENALTY}")
    shared = dict.fromkeys(defaults, tuned[EVERY_DIRECTION]) if EVERY_DIRECTION in tuned else {}
    return defaults | {name: float(np.float32(value)) for name, value in (shared | tuned).items()}
