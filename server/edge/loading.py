"""Loading what the server serves: the models it is told to (directories, hub ids fetched and built through
export/), each opened on its provider with its tokenizer and what ListModels reports, and the plan of
engines over the node's cores. `StartupError` says, in one line for the operator, why a model cannot load.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from model.config import LANG_TAGS, ModelConfig
from model.files import CONFIG_FILE, WEIGHTS_FILE
from model.languages import bcp47, parse
from model.tokenizer import TextTokenizer, open_tokenizer
from server.core.runner import ModelSpec
from server.edge.config import CUDA_ENGINES, DEFAULT_MODEL_DIR, EnginesConfig, ModelsConfig, ServerConfig, SharedEngines
from server.edge.convert import DEFAULT_BEAM_SIZE, ModelDescription
from server.processes.engines import (
    OpenedGraphs,
    OpenedModel,
    RunnerSettings,
    SharedModel,
    close_model,
    open_model,
)
from server.text.documents import RequestLimits
from server.text.splitter import PUNCTUATION, rule_for

logger = logging.getLogger(__name__)
T = TypeVar("T")
WEIGHT_FILES = (CONFIG_FILE, WEIGHTS_FILE)  # what a model directory builds its graphs from


class StartupError(RuntimeError):
    """The server cannot start as configured; the message says why, for the operator."""


class ConfigError(StartupError):
    """The configuration names what cannot serve (a path, a port, a file, a model): exit status 2, as a bad flag."""


class ModelSourceError(ConfigError):
    """A --model that cannot be served as named (unknown, unreachable, not importable)."""


@dataclass(frozen=True)
class ModelSource:
    """A model directory to serve, the name requests route by, and the commit it was built from ("" if none)."""

    directory: Path
    name: str
    revision: str = ""


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve: the engine process holding it (a runner in this process for offline tools and
    tests), its tokenizer and what ListModels reports."""

    runner: OpenedModel
    tokenizer: TextTokenizer
    description: ModelDescription


def resolve_provider(requested: str) -> str:
    """ "cuda" or "cpu": auto picks CUDA when onnxruntime offers its execution provider."""
    if requested != "auto":
        return requested
    import onnxruntime  # imported here: tests that inject a runner never load onnxruntime

    return "cuda" if "CUDAExecutionProvider" in onnxruntime.get_available_providers() else "cpu"


def model_directories(models: ModelsConfig) -> list[Path]:
    """The directories to serve, in load order: each --model-dir, then every directory inside --models-dir
    that holds an export (onnx/), by name; none of these nor a --model given: the shipped model. An empty
    --models-dir beside another model is no error (an image's mount point with nothing mounted yet); with
    nothing to serve it is."""
    directories = list(models.model_dirs)
    if models.models_dir is None:
        return directories or ([] if models.models else [DEFAULT_MODEL_DIR])
    check_is_directory(models.models_dir, "models directory")
    found = sorted(d for d in models.models_dir.iterdir() if (d / "onnx").is_dir())
    if not found and not directories and not models.models:
        raise ConfigError(f"no model directory (one with onnx/) in {models.models_dir}: nothing to serve")
    if not found:
        logger.warning("no model directory (one with onnx/) in %s", models.models_dir)
    return directories + found


def load_models(config: ServerConfig, stopped: Callable[[], bool] = lambda: False) -> list[LoadedModel]:
    """Every configured model, each under its name (a directory's, or the hub id of a --model), which must be
    unique, loaded once per engine (`engine_plan`): replicas of a model share its name and are listed one after
    the other. A --model still building or waiting for another replica's build gives up once `stopped()`."""
    if shared_engines := config.serving.engine_sockets:
        return [attach_model(shared, socket) for shared in shared_engines for socket in shared.sockets]
    sources = model_sources(config, stopped)
    provider = resolve_provider(config.engines.provider)
    engines, threads = engine_plan(available_cores(), len(sources), provider, config.engines)
    logger.info(
        "%d engine process(es) per model, %s intra-op thread(s) each, at nice %d",
        engines, threads or "onnxruntime's default", config.engines.engine_nice,
    )  # fmt: skip
    each = replace(config, engines=replace(config.engines, threads=threads))
    models: list[LoadedModel] = []
    for source in [source for source in sources for _ in range(engines)]:
        if stopped():
            break
        models.append(load_model(each, source.directory, source.name, source.revision))
    if stopped():  # a signal while loading, the last engine's included: serve nothing, leave no engine behind
        for model in models:
            close_model(model.runner)
        return []
    return models


def model_sources(config: ServerConfig, stopped: Callable[[], bool]) -> list[ModelSource]:
    """Every model to serve (directories, then each --model fetched and built), their names unique; a directory
    that is not there is named before any model loads or builds."""
    directories = checked_model_directories(config.models)
    sources = [ModelSource(d, d.resolve().name) for d in directories] + fetch_models(config, stopped)
    names = [source.name for source in sources]
    if duplicated := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(f"two models share the name {duplicated}: rename a directory, names route requests")
    return sources


def checked_model_directories(models: ModelsConfig) -> list[Path]:
    """`model_directories`, each checked to hold a model (`check_model_directory`): a mistake in any is named
    before a port is bound or a model loads or builds."""
    directories = model_directories(models)
    for directory in directories:
        check_model_directory(directory)
    return directories


def check_is_directory(path: Path, what: str) -> None:
    """ConfigError saying what `path` is, where it is not a directory."""
    if not path.exists():
        raise ConfigError(f"{what} {path} does not exist")
    if not path.is_dir():
        raise ConfigError(f"{what} {path} is a file, not a directory")


def check_model_directory(model_dir: Path) -> None:
    """ConfigError unless `model_dir` is a directory holding exported graphs or the weights to build them from."""
    from model.directory import available_variants

    check_is_directory(model_dir, "model directory")
    lacking = [name for name in WEIGHT_FILES if not (model_dir / name).is_file()]
    if lacking and not available_variants(model_dir):
        raise ConfigError(
            f"model directory {model_dir} holds no model: no exported graphs (onnx/<variant>/) and no "
            f"{' or '.join(lacking)} to build them from"
        )


def attach_model(shared: SharedEngines, socket: str) -> LoadedModel:
    """A model whose engine the `--processes` parent runs, attached over its socket."""
    try:
        runner = SharedModel(socket)
    except (OSError, EOFError, RuntimeError) as err:  # gone, or closing as it answered
        raise StartupError(f"cannot reach the shared engine of {shared.name} at {socket}: {err}") from err
    try:
        return describe_model(shared.directory, shared.name, shared.revision, shared.variant, runner)
    except Exception as err:  # a tokenizer that does not match the engine's graphs
        close_model(runner)
        raise StartupError(f"cannot load the model from {shared.directory}: {type(err).__name__}: {err}") from err


def fetch_models(config: ServerConfig, stopped: Callable[[], bool]) -> list[ModelSource]:
    """Each --model fetched, imported and built for the served variant, or found built in the cache."""
    if not config.models.models:
        return []
    try:  # the [import] extra: huggingface_hub and the graph builder
        from export.fetch import FetchError, HubSettings
        from export.hub import BuildError, ensure_model, plan_for
        from export.publish import Stopped
    except ImportError as err:
        raise ModelSourceError(f"--model needs pip install 'translate-service[import]' ({err})") from err
    from model.directory import int8_kernels
    from server.edge.logs import adopt_library_loggers

    adopt_library_loggers("huggingface_hub")

    plan = plan_for(config.engines.variant, resolve_provider(config.engines.provider), int8_kernels())
    cache = config.models.model_cache
    hub = HubSettings(config.models.hf_hub_cache, config.models.hf_offline)
    sources = []
    for model in config.models.models:
        try:
            built = ensure_model(model, plan, cache, hub, stopped)
        except (FetchError, BuildError) as err:
            raise ModelSourceError(str(err)) from err
        except Stopped as err:
            raise StartupError(f"{err}: the server is shutting down") from err
        except OSError as err:
            raise StartupError(f"cannot build {model} into the model cache {cache}: {err}") from err
        except Exception as err:  # a fault of the importer or exporter on this model: its traceback is logged
            logger.exception("building %s failed", model)
            raise StartupError(f"cannot build {model}: {type(err).__name__}: {err}") from err
        sources.append(ModelSource(built.directory, built.name, built.revision))
    return sources


def available_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may use: its affinity (taskset, cpusets), capped by a cgroup v2 CPU quota (a
    container's --cpus, a Kubernetes CPU limit), which the affinity does not show."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    return cores if quota == "max" else max(1, min(cores, -(-int(quota) // int(period))))


def engine_plan(cores: int, models: int, provider: str, config: EnginesConfig) -> tuple[int, int]:
    """(engines per model, intra-op threads per engine). On CPU one single-threaded engine per core serves more
    than one engine with every core (docs/decisions.md): by default the cores are
    split between the models' engines. On CUDA two engines on the GPU, split between the models, at least one
    each, so that one engine's host work between steps overlaps another's kernels (docs/decisions.md)."""
    if provider != "cpu":
        return config.engines or max(1, CUDA_ENGINES // models), config.threads
    engines = config.engines or max(1, cores // (models * (config.threads or 1)))
    threads = config.threads or (max(1, cores // (engines * models)) if engines * models > 1 else 0)
    return engines, threads


def load_model(
    config: ServerConfig, model_dir: Path, name: str | None = None, revision: str = "", *, in_process: bool = False
) -> LoadedModel:
    """Open the configured variant of the exported model in an engine process, named `name` (default: the
    directory's name); StartupError naming the cause if it cannot. `in_process` opens the runner in this process
    instead, for offline tools and tests that drive it; the server never does."""
    check_model_directory(model_dir)
    build_missing_graphs(model_dir, config.engines.variant, resolve_provider(config.engines.provider))
    try:
        return _open_model(config, model_dir, name or model_dir.resolve().name, revision, in_process)
    except Exception as err:  # missing files, bad metadata, corrupt graphs, a tokenizer that does not match
        raise StartupError(f"cannot load the model from {model_dir}: {type(err).__name__}: {err}") from err


def build_missing_graphs(model_dir: Path, variant: str, provider: str) -> None:
    """Build the graphs a start on `provider` serves (`graphs_served`) that a model directory with weights lacks,
    as `python -m export` does (in its own process, so that the memory the build takes goes with it); the build
    needs no torch."""
    has_weights = all((model_dir / name).is_file() for name in WEIGHT_FILES)
    needed = graphs_served(model_dir, variant, provider)
    if not has_weights or set(needed) <= set(current_variants(model_dir)):
        return
    command = [sys.executable, "-m", "export", "--model-dir", str(model_dir), "--variants", ",".join(needed)]
    logger.info("graphs missing or of an older export in %s: building them (%s)", model_dir, " ".join(command[1:]))
    started = time.perf_counter()
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    if built.returncode != 0:
        last = (built.stderr.strip().splitlines() or ["no output"])[-1]
        raise StartupError(f"building the graphs of {model_dir} failed: {last}")
    logger.info("built the graphs of %s in %.1f s", model_dir, time.perf_counter() - started)


def current_variants(model_dir: Path) -> list[str]:
    """The exported variants not of another model-directory format: such an export is derived from the weights
    beside it, so it is built again rather than refused. A damaged one counts as current: loading it names it."""
    from model.directory import FORMAT_VERSION, METADATA_FILE, available_variants

    def stale(variant: str) -> bool:
        try:
            found = json.loads((model_dir / "onnx" / variant / METADATA_FILE).read_text())
        except (OSError, ValueError):
            return False
        return isinstance(found, dict) and found.get("format_version") != FORMAT_VERSION

    return [variant for variant in available_variants(model_dir) if not stale(variant)]


def graphs_served(model_dir: Path, variant: str, provider: str) -> list[str]:
    """The variants a start with `--variant variant` on `provider` ("cpu" or "cuda") may serve: the variant asked
    for (which never falls back), or for auto fp32 and the provider's fast variant where the model's
    variants.json records it passed that provider's gate. Nothing else: fp16 graphs on a CPU, which never serves
    them, or fp32 graphs beside an int8 asked for, would only cost their build and their disk."""
    from model.directory import DEFAULT_BY_PROVIDER, VARIANTS_FILE

    if variant != "auto":
        return [variant]
    fast = DEFAULT_BY_PROVIDER[provider]
    path = model_dir / VARIANTS_FILE
    record = json.loads(path.read_text()).get(provider, {}) if path.is_file() else {}
    passed = record.get("variants", {}).get(fast, {}).get("passed", False)
    return ["fp32", fast] if passed else ["fp32"]


def _open_model(config: ServerConfig, model_dir: Path, name: str, revision: str, in_process: bool) -> LoadedModel:
    # Every file comes from model_dir: the variant is one of a fixed set of names, never a path.
    from model.directory import choose_variant

    engines = config.engines
    provider = resolve_provider(engines.provider)

    def open_on(provider: str) -> tuple[str, OpenedGraphs]:
        variant = choose_variant(model_dir, engines.variant, provider)
        settings = RunnerSettings(
            model_dir / "onnx" / variant, engines.slots_for(provider), provider, engines.threads, engines.kv_cache,
            engines.spin_threads,
        )  # fmt: skip
        return variant, open_model(settings, in_process)

    variant, runner = open_on(provider)
    if provider == "cuda" and runner.provider != "CUDAExecutionProvider":  # onnxruntime fell back to CPU
        why = f"onnxruntime could not run {variant} on CUDA and fell back to {runner.provider} (its log says why)"
        close_model(runner)  # a child holding the fallback session is not kept
        if engines.provider == "cuda":  # asked for explicitly: never hold a GPU while computing on the CPU
            raise StartupError(f"{why}; fix the CUDA libraries or serve with --provider cpu")
        logger.warning("%s; --provider auto: serving on the CPU", why)
        provider = "cpu"
        variant, runner = open_on(provider)
    return describe_model(model_dir, name, revision, variant, runner)


def describe_model(
    model_dir: Path, name: str, revision: str, variant: str, runner: OpenedGraphs | SharedModel
) -> LoadedModel:
    """The opened `variant` of the model in `model_dir` with its tokenizer and what ListModels reports."""
    from model.directory import available_variants, direction_names, read_decoding_defaults, read_length_penalties

    meta = runner.metadata
    directions = direction_names(runner.spec.directions)
    length_penalty = read_length_penalties(model_dir, directions, meta.source_sha256)
    beam_size, max_output_len = read_decoding_defaults(model_dir, meta.source_sha256)
    logger.info("loaded %s variant %s on %s with %s caches", model_dir, variant, runner.provider, runner.kv_cache)
    description = ModelDescription(
        name=name,
        revision=revision,
        variant=variant,
        available_variants=available_variants(model_dir),
        provider=runner.provider,
        opset=int(meta.opset),
        model_sha256=str(meta.source_sha256),
        dtype=str(meta.dtype),
        default_length_penalty=length_penalty,
        default_beam_size=beam_size or DEFAULT_BEAM_SIZE,
        default_max_output_len=max_output_len or 0,
        target_tags=target_tags(runner.spec, ModelConfig.from_dict(meta.model_config)),
    )
    log_sentence_rules(name, runner.spec)
    tokenizer = load_tokenizer(model_dir, runner.spec, ModelConfig.from_dict(meta.model_config))
    return LoadedModel(runner, tokenizer, description)


def target_tags(spec: ModelSpec, cfg: ModelConfig) -> dict[str, str]:
    """The tag text the model reads in front of a source, by target code: `>>pob<<` (Marian) or `<2en>`; none for
    a model whose target code is its forced first output token (NLLB-200, M2M100), which reads no tag."""
    if cfg.forced_bos:
        return {}
    if cfg.tokenizer == "marian":
        return {target: f">>{target}<<" for target in spec.tag_ids}
    return {target: LANG_TAGS[target] for target in spec.tag_ids if target in LANG_TAGS}


def log_sentence_rules(name: str, spec: ModelSpec) -> None:
    """Say which sentence rule each source language gets (pysbd's, or the punctuation fallback)."""
    for source in spec.directions.sources:
        rule = rule_for(source)
        how = f"pysbd's {rule!r} rules" if rule != PUNCTUATION else "the punctuation rule (pysbd has none)"
        group = " (a group: each request's own language code chooses)" if parse(source).is_group else ""
        logger.info("%s: source %s (%s) is split into sentences by %s%s", name, source, bcp47(source), how, group)


def load_tokenizer(model_dir: Path, spec: ModelSpec, cfg: ModelConfig) -> TextTokenizer:
    """The model's tokenizer: the files the exported graphs were trained or imported with, whose language
    tags and pairs are those the graphs know."""
    tokenizer = open_tokenizer(model_dir, cfg.tokenizer, cfg.tokenizer_sha256)
    if tokenizer.tag_ids != spec.tag_ids or tokenizer.directions != spec.directions:
        raise ValueError(f"tokenizer tags {tokenizer.tag_ids} differ from the model's {spec.tag_ids}")
    return tokenizer


def request_limits(config: ServerConfig, slots: int, queue: int) -> RequestLimits:
    """The documented limits, tightened to what an engine of `slots` slots and `queue` places can ever take: a
    request over them is refused INVALID_ARGUMENT (and ListModels says so), never "queue full, retry" forever."""
    documented = RequestLimits()
    return replace(
        documented,
        max_beam_size=min(documented.max_beam_size, slots),
        max_sentences=min(documented.max_sentences, queue),
        max_response_bytes=config.limits.max_message_bytes,
    )
