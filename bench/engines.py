"""One small adapter per offline engine behind a common interface.

Every engine takes the same token ids (language tag + pieces + EOS, exactly what our encoder sees),
the same beam size and the same thread count, and returns the best hypothesis' ids per source, so
throughput is counted in the same target tokens everywhere and outputs can be compared id for id.
The served path is measured end to end through gRPC by bench.loadgen, not here.
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from model.directory import FUSED_DECODER_FILE
from model.files import load_config

if TYPE_CHECKING:
    from server.backend.runtime import OnnxRunner


class Unavailable(RuntimeError):
    """The engine cannot run here (missing package, export or device); the bench records why."""


class OfflineEngine(Protocol):
    name: str

    def translate(self, sources: list[list[int]], beam_size: int) -> list[list[int]]:
        """Best hypothesis ids (EOS excluded) for each source, decoded as one batch."""
        ...


@dataclass(frozen=True)
class EngineSettings:
    """What every engine shares, so that the comparison is like for like."""

    model_dir: Path
    device: str  # "cpu" or "cuda"
    threads: int  # intra-op threads for every engine
    max_len: int  # most generated tokens per sentence
    max_batch: int  # sentences per batch call
    # An imported OPUS-MT model's transformers directory: CTranslate2 converts it with its own converter
    # (ct2-transformers-converter), as its users do; None for our own models (bench.ct2_convert's spec).
    hf_dir: Path | None = None


class PyTorchEngine:
    """Our reference decoder (model/training/decode.py), eager PyTorch, one sentence at a time."""

    def __init__(self, settings: EngineSettings) -> None:
        import torch

        from model.training.artifact import load_artifact

        if settings.device == "cuda" and not torch.cuda.is_available():
            raise Unavailable("torch has no CUDA device")
        torch.set_num_threads(settings.threads)
        self.name = "pytorch-eager"
        self.model = load_artifact(settings.model_dir, settings.device)
        self.max_len = settings.max_len

    def translate(self, sources: list[list[int]], beam_size: int) -> list[list[int]]:
        from model.training.decode import beam_search

        # The reference decoder has no batch dimension: it is the spec, not a server.
        return [list(beam_search(self.model, src, beam_size, self.max_len)[0].tokens) for src in sources]


class TransformersEngine:
    """transformers' batched `generate` on an imported model's own transformers directory: what most OPUS-MT
    users run, and the baseline CTranslate2's README measures against. float16 on CUDA, float32 on CPU; the pad
    ban and the search's stopping as the model's generation config says, as our import reads them."""

    def __init__(self, settings: EngineSettings) -> None:
        if settings.hf_dir is None:
            raise Unavailable("transformers runs an imported model's transformers directory: pass --hf-dir")
        try:
            import torch
            from transformers import AutoModelForSeq2SeqLM
        except ImportError as err:
            raise Unavailable(f"transformers is not installed ({err})") from err
        if settings.device == "cuda" and not torch.cuda.is_available():
            raise Unavailable("torch has no CUDA device")
        torch.set_num_threads(settings.threads)
        dtype = torch.float16 if settings.device == "cuda" else torch.float32
        self.name = "transformers-generate"
        model = AutoModelForSeq2SeqLM.from_pretrained(settings.hf_dir, dtype=dtype)
        self.model = model.to(settings.device).eval()  # type: ignore[arg-type]  # transformers types .to oddly
        self.settings = settings

    def translate(self, sources: list[list[int]], beam_size: int) -> list[list[int]]:
        import torch

        config = self.model.config
        width = max(len(s) for s in sources)
        ids = torch.full((len(sources), width), config.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sources), width), dtype=torch.long)
        for row, source in enumerate(sources):
            ids[row, : len(source)] = torch.tensor(source)
            mask[row, : len(source)] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.settings.device), attention_mask=mask.to(self.settings.device),
                num_beams=beam_size, max_new_tokens=self.settings.max_len, min_length=0, length_penalty=1.0,
                do_sample=False,
            )  # fmt: skip
        results = []
        for row in out.tolist():
            generated = row[1:]  # after the decoder's start token
            end = generated.index(config.eos_token_id) if config.eos_token_id in generated else len(generated)
            results.append([t for t in generated[:end] if t != config.pad_token_id])
        return results


class CTranslate2Engine:
    """CTranslate2 `translate_batch` on a model converted by bench.ct2_convert.

    Two thread layouts: one translator worker with every thread (`workers=1`: best for one sentence
    at a time), or one worker per thread with one thread each (CTranslate2's layout for throughput on
    CPU: each call's sub-batches of `max_batch` sentences, sorted by length, run on the workers in
    parallel). The bench measures both, and compares with the better.
    """

    def __init__(self, settings: EngineSettings, compute_type: str, work_dir: Path, workers: int = 1) -> None:
        try:
            import ctranslate2
        except ImportError as err:
            raise Unavailable(f"ctranslate2 is not installed ({err})") from err

        from bench.ct2_convert import convert, convert_transformers, piece_list

        if settings.device == "cuda" and ctranslate2.get_cuda_device_count() == 0:
            raise Unavailable("CTranslate2 sees no CUDA device")
        if compute_type not in ctranslate2.get_supported_compute_types(settings.device):
            raise Unavailable(f"compute type {compute_type} unsupported on {settings.device}")
        if workers > 1 and (settings.device != "cpu" or settings.threads < workers):
            raise Unavailable(f"{workers} workers need the CPU and {workers}+ threads (at 1 thread: the plain layout)")
        self.name = f"ctranslate2-{compute_type}" + (f"-{workers}workers" if workers > 1 else "")
        out = work_dir / self.name
        if load_config(settings.model_dir).tokenizer in ("marian", "m2m"):  # imported: from its own checkpoint
            if settings.hf_dir is None:
                raise Unavailable("an imported model is compared with CTranslate2 converted from its transformers "
                                  "directory: pass --hf-dir")  # fmt: skip
            model_path = convert_transformers(settings.hf_dir, out, quantization=compute_type)
        else:
            model_path = convert(settings.model_dir, out, quantization=compute_type)
        self.translator = ctranslate2.Translator(
            str(model_path), device=settings.device, compute_type=compute_type, inter_threads=workers,
            intra_threads=max(1, settings.threads // workers),
        )  # fmt: skip
        self.vocabulary = piece_list(settings.model_dir)
        self.settings = settings

    def translate(self, sources: list[list[int]], beam_size: int) -> list[list[int]]:
        from bench.ct2_convert import translate_ids

        return translate_ids(
            self.translator, self.vocabulary, sources, beam_size, self.settings.max_len, self.settings.max_batch
        )


class OnnxEngine:
    """Our ONNX decoder offline: server.core.offline.translate_ids over the runner the server would open
    (server.backend.runners.open_runner, caches placed as `--kv-cache` places them: auto by default). `fused`
    opens the captured runner on any device, so that a CPU rehearses the CUDA engine (uncaptured there)."""

    def __init__(self, settings: EngineSettings, variant: str, kv_cache: str = "auto", name: str = "") -> None:
        variant_dir = settings.model_dir / "onnx" / variant
        for module in ("server.backend.runtime", "server.core.offline"):
            if importlib.util.find_spec(module) is None:
                raise Unavailable(f"{module} is not in this checkout")
        if not (variant_dir / "decoder_step.onnx").is_file():
            raise Unavailable(f"no export at {variant_dir} (python -m export --model-dir {settings.model_dir})")
        if kv_cache == "fused" and not (variant_dir / FUSED_DECODER_FILE).is_file():
            raise Unavailable(f"no capturable decoder step in {variant_dir} (its head size, or an older export)")
        from server.backend.captured import CapturedRunner
        from server.backend.runners import open_runner

        self.name = name or f"onnx-{variant}" + ("" if kv_cache == "auto" else f"-{kv_cache}")
        # Beam rows take one slot each: a full batch of beams must fit.
        slots = settings.max_batch * 4
        self.runner: OnnxRunner
        if kv_cache == "fused":
            self.runner = CapturedRunner(variant_dir, slots, settings.device, settings.threads)
        else:
            self.runner = open_runner(variant_dir, slots, settings.device, settings.threads, kv_cache=kv_cache)
        self.settings = settings

    def translate(self, sources: list[list[int]], beam_size: int) -> list[list[int]]:
        from server.core.offline import translate_ids

        results = translate_ids(self.runner, sources, beam_size, 1.0, self.settings.max_len)
        return [list(hyps[0].tokens) for hyps in results]


EngineFactory = Callable[[EngineSettings, Path], OfflineEngine]
# Name -> constructor; the bench runs them in this order.
ENGINES: dict[str, EngineFactory] = {
    "ctranslate2-float32": lambda s, work: CTranslate2Engine(s, "float32", work),
    "ctranslate2-int8": lambda s, work: CTranslate2Engine(s, "int8", work),
    "ctranslate2-float16": lambda s, work: CTranslate2Engine(s, "float16", work),
    # at 1 thread the same layout as the plain engine: skipped (workers > threads)
    "ctranslate2-float32-workers": lambda s, work: CTranslate2Engine(s, "float32", work, workers=max(2, s.threads)),
    "ctranslate2-int8-workers": lambda s, work: CTranslate2Engine(s, "int8", work, workers=max(2, s.threads)),
    "pytorch-eager": lambda s, work: PyTorchEngine(s),
    # the uncaptured step, the working batch on every device; the captured one is -fused
    "onnx-fp32": lambda s, work: OnnxEngine(s, "fp32", kv_cache="working", name="onnx-fp32"),
    "onnx-int8": lambda s, work: OnnxEngine(s, "int8"),
    "onnx-fp16": lambda s, work: OnnxEngine(s, "fp16", kv_cache="working", name="onnx-fp16"),
    "onnx-fp16-fused": lambda s, work: OnnxEngine(s, "fp16", kv_cache="fused"),  # CUDA graphs on CUDA
    "transformers-generate": lambda s, work: TransformersEngine(s),
}
# int8 is the CPU quantization, fp16 the GPU one (as in the export variants).
DEVICE_ENGINES: dict[str, list[str]] = {
    "cpu": [
        *("ctranslate2-float32", "ctranslate2-float32-workers", "ctranslate2-int8", "ctranslate2-int8-workers"),
        *("pytorch-eager", "onnx-fp32", "onnx-int8", "transformers-generate"),
    ],
    "cuda": [
        *("ctranslate2-float32", "ctranslate2-float16", "pytorch-eager", "onnx-fp32", "onnx-fp16"),
        *("onnx-fp16-fused", "transformers-generate"),
    ],
}
# An engine and the uncaptured engine whose ids it must reproduce exactly (the benchmark reports their agreement).
UNCAPTURED = {"onnx-fp16-fused": "onnx-fp16"}


def create(name: str, settings: EngineSettings, work_dir: Path | None = None) -> OfflineEngine:
    """Build engine `name`; raises Unavailable when it cannot run here."""
    if settings.max_len > load_config(settings.model_dir).max_len:
        raise ValueError(f"max_len {settings.max_len} exceeds the model's limit")
    return ENGINES[name](settings, work_dir or Path(tempfile.mkdtemp(prefix="bench-")))
