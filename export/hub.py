"""A served model directory for a hub id or a transformers directory: fetched, imported, exported, cached.

    python -m export.hub Helsinki-NLP/opus-mt-de-en[@REVISION] [--cache-dir DIR] [--variants fp32,int8]
    python -m export.hub Helsinki-NLP/opus-mt-de-en --cache-dir DIR --variants fp16 --fp16-gate cuda  # as auto on CUDA

The cache holds one directory per (repository, commit sha, model-directory FORMAT_VERSION, build recipe):
`<cache>/models--org--name/<sha>/f<FORMAT_VERSION>-<variants>-<recipe hash>/` (a local directory's under
`local/<its name>/<sha256 of its files>/`: its name gives the languages), published whole by
export/publish.py. A start that finds it verified makes no download and builds nothing. `translate-server
--model` calls `ensure_model`; this entrypoint fills a shared volume ahead of the servers (an init container).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from export.fetch import (
    FetchError,
    HubSettings,
    ModelName,
    download,
    local_revision,
    parse_name,
    require_readable_weights,
    resolve_commit,
)
from export.publish import Stopped, never, obtain
from model.directory import FORMAT_VERSION, VARIANTS

log = logging.getLogger(__name__)

OPSET = 18
MB = 1e6


class BuildError(Exception):
    """The fetched model cannot be built into a served directory; the message is one line saying why."""


@dataclass(frozen=True)
class BuildPlan:
    """Which graphs to build and how: the part of a cached directory's key that is this project's choice."""

    variants: tuple[str, ...] = ("fp32",)  # fp32 beside fp16, which falls back to it where its gate fails
    int8_7bit: bool = False  # int8 with 7-bit weights per output channel (CPUs without VNNI)
    opset: int = OPSET
    fp16_gate: str = ""  # the provider whose fp16 agreement gate the build measures (export/fp16_gate.py), if any

    def recipe(self) -> str:
        from export.hf import IMPORT_RULES
        from export.quantize import int8_recipe

        parts = [f"import rules {IMPORT_RULES}", f"opset {self.opset}", *self.variants]
        if "int8" in self.variants:
            parts.append(int8_recipe(self.int8_7bit, self.int8_7bit))
        if self.fp16_gate:
            parts.append(f"fp16 gated on {self.fp16_gate}")
        return "; ".join(parts)

    def folder(self) -> str:
        """f<FORMAT_VERSION>-<variants>-<hash of the recipe>: a changed recipe or format never reuses a build."""
        digest = hashlib.sha256(f"{FORMAT_VERSION}\n{self.recipe()}".encode()).hexdigest()[:8]
        return f"f{FORMAT_VERSION}-{'+'.join(self.variants)}-{digest}"


@dataclass(frozen=True)
class BuiltModel:
    """A model directory ready to serve and what ListModels says of its origin."""

    name: str  # the hub id (or the local directory's name): the name requests route by
    revision: str  # the commit sha it was built from (a content hash for a local directory)
    directory: Path  # the published model directory
    built: bool  # True when this call built it, False when it came from the cache


def plan_for(variant: str, provider: str, cpu_int8: str) -> BuildPlan:
    """The graphs `--variant` needs on `provider`. auto builds fp32 on CPU (no BLEU gate can price an imported
    model's int8 without a test set) and fp32 and fp16 on CUDA, where the build measures fp16 against fp32
    (export/fp16_gate.py) and model.directory.choose_variant serves fp16 if it agreed, else fp32."""
    if variant == "auto" and provider == "cuda":
        return BuildPlan(("fp32", "fp16"), fp16_gate="cuda")
    if variant in ("auto", "fp32"):
        return BuildPlan()
    from export.quantize import int8_flags_for

    per_channel, _ = int8_flags_for(cpu_int8)
    return BuildPlan((variant,), int8_7bit=variant == "int8" and per_channel)


def ensure_model(
    text: str, plan: BuildPlan, cache_dir: Path, hub: HubSettings, stopped: Callable[[], bool] = never
) -> BuiltModel:
    """The cached build of the model `text` names, built and published first when missing or corrupt; raises
    export.publish.Stopped once `stopped()` is true while it waits or between the steps of a build."""
    name = parse_name(text)
    commit = resolve_commit(name, hub) if name.local is None else name.revision or local_revision(name.local)
    final = cache_dir / origin(name) / commit / plan.folder()
    identity = {"repository": name.repository, "revision": commit, "format_version": FORMAT_VERSION,
                "recipe": plan.recipe()}  # fmt: skip
    try:
        directory, built = obtain(
            final, identity, lambda staging: build(name, commit, staging, plan, hub, stopped), stopped
        )
    except BaseException:  # a build that failed leaves no empty folders behind it in the cache
        _remove_empty(final.parent, up_to=cache_dir)
        raise
    if not built:
        log.info("%s@%s: serving the cached build %s", name.repository, commit[:12], directory)
    return BuiltModel(name.repository, commit, directory, built)


def origin(name: ModelName) -> Path:
    """The cache folder of a model's builds, one per commit below it: the hub's `models--org--name` for a hub id
    or one of its snapshots; `local/<name>` for another directory, as two directories holding the same files
    under other names (opus-mt-de-en, opus-mt-en-de) import as other languages."""
    if name.local is None or name.revision is not None:
        return Path(name.cache_folder)
    return Path("local") / name.repository


def _remove_empty(folder: Path, up_to: Path) -> None:
    """`folder` and its parents below `up_to`, each only while empty (another replica's build may sit beside)."""
    while folder != up_to and up_to in folder.parents:
        try:
            folder.rmdir()
        except OSError:  # not empty, or gone
            return
        folder = folder.parent


def build(
    name: ModelName, commit: str, out: Path, plan: BuildPlan, hub: HubSettings, stopped: Callable[[], bool] = never
) -> None:
    """Import the transformers files into `out`, then export the plan's graphs into `out/onnx`; between the
    steps, stop (Stopped) when asked to."""
    source = name.local or download(name, commit, hub)
    require_readable_weights(name, commit, source)
    started = time.monotonic()
    _unless(stopped, f"building {name.repository}")
    log.info("building %s@%s (%s) in %s", name.repository, commit[:12], plan.recipe(), out)
    _import(name, source, out)
    log.info("imported %s in %.1f s", name.repository, time.monotonic() - started)
    _unless(stopped, f"building {name.repository}")
    from export.builder.weights import WeightsError

    try:
        _export(out, plan)
    except WeightsError as err:  # the snapshot's config.json and weights disagree
        detail = str(err).replace(f"{out / 'model.safetensors'}", "the weights").removeprefix("the weights: ")
        weights = "model.safetensors" if (source / "model.safetensors").is_file() else "pytorch_model.bin"
        raise BuildError(
            f"{name.text}: config.json and {weights} of {source} disagree ({detail}); a partial or mixed "
            "download? fetch it again"
        ) from err
    (out / "model.safetensors").unlink()  # the graphs carry the weights; decoding.json keeps their sha256
    if plan.fp16_gate:
        _unless(stopped, f"building {name.repository}")
        _gate_fp16(name, out, plan.fp16_gate)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log.info("built %s: %.1f MB in %.1f s", name.repository, size / MB, time.monotonic() - started)


def _unless(stopped: Callable[[], bool], what: str) -> None:
    if stopped():
        raise Stopped(f"stopped {what}")


def _import(name: ModelName, source: Path, out: Path) -> None:
    from export.hf import DamagedFiles, UnsupportedModel, import_model
    from export.hf import parse_args as import_args

    # The importer names a snapshot (`models--org--name/snapshots/<sha>`) by its repository, whose name gives
    # the languages (opus-mt-de-en) where the tokenizer config names none; a directory by its own name.
    try:
        import_model(import_args(["--model", str(source), "--out", str(out)]))
    except UnsupportedModel as err:
        # a download cut short says so; anything else is an architecture the importer cannot carry
        why = "" if isinstance(err, DamagedFiles) else "the importer cannot carry this model: "
        raise BuildError(f"{name.text}: {why}{err}") from err
    except KeyError as err:  # a config without a field every Marian config has
        raise BuildError(f"{name.text}: the importer cannot carry this model: config.json lacks {err}") from err


def _export(out: Path, plan: BuildPlan) -> None:
    from export.__main__ import main as export_main

    argv = ["--model-dir", str(out), "--variants", ",".join(plan.variants), "--opset", str(plan.opset)]
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        status = export_main([*argv, *(["--int8-7bit"] if plan.int8_7bit else [])])
    if status != 0:
        reason = errors.getvalue().strip().splitlines()
        raise BuildError(reason[-1] if reason else f"python -m export exited {status}")


def _gate_fp16(name: ModelName, out: Path, provider: str) -> None:
    """export/fp16_gate.py in a process of its own (the CUDA context it opens goes with it), its result recorded
    in `out`'s variants.json; BuildError where it could not measure, so that nothing is published under a
    gated build's key without its record and the next start measures again."""
    command = [sys.executable, "-m", "export.fp16_gate", "--model-dir", str(out), "--provider", provider, "--record"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):  # 1: measured and failed, recorded (auto serves fp32)
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise BuildError(f"{name.text}: the fp16 gate could not run on {provider} ({last}); serve --variant fp32, "
                         "or --variant fp16 on your own word")  # fmt: skip
    log.info("%s: fp16 gate on %s: %s", name.repository, provider, done.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.hub", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a hub id (org/name[@revision]) or a transformers directory")
    parser.add_argument("--cache-dir", type=Path, required=True, help="the cache of built model directories")
    parser.add_argument("--variants", default="fp32", help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--int8-7bit", action="store_true", help="int8 with 7-bit weights (CPUs without VNNI)")
    parser.add_argument(
        "--fp16-gate", choices=("cuda",), default="",
        help="also measure fp16 against fp32 on this provider, as translate-server --variant auto does on CUDA "
        "(with --variants fp16: the same cached build)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    variants = tuple(dict.fromkeys(v for v in args.variants.split(",") if v))
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variants {unknown}")
    if args.fp16_gate and "fp16" not in variants:
        parser.error("--fp16-gate needs --variants fp16")
    from huggingface_hub import constants  # huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE at import

    hub = HubSettings(Path(constants.HF_HUB_CACHE), bool(constants.HF_HUB_OFFLINE))
    try:
        built = ensure_model(
            args.model, BuildPlan(variants, args.int8_7bit, fp16_gate=args.fp16_gate), args.cache_dir, hub
        )
    except (FetchError, BuildError) as err:
        print(f"export.hub: error: {err}", file=sys.stderr)
        return 2
    print(built.directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
