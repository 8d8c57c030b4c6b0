"""One server, several models: each request routed by language pair (or model name) to its model's own engine,
answered exactly as that model alone answers it; unknown pairs and names refused naming what is served;
ListModels, the CLI and the metrics per model; a model whose engine dies fails only its own requests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from export.hf import main as import_main
from model.directions import Directions
from server.core.runner import Candidates, RowBias, Runner
from server.edge.loading import LoadedModel
from tests.marian_tiny import build_marian_dir
from tests.serving import (
    KillableRunner,
    export_tiny_onnx,
    onnx_model,
    request,
    runner_of,
    running_server,
    sample_value,
    status_of,
    wait_until,
)
from tests.tiny import TINY_PAIRS

OURS, MARIAN = "ours", "opus-tiny-de-en"  # model names: their directories' names
GERMAN = [de for de, _ in TINY_PAIRS[:8]]
ENGLISH = [en for _, en in TINY_PAIRS[:8]]
# (source, target, model named in the request): what each mixed-load call asks, and who must answer it
CALLS = [("de", "en", ""), ("en", "de", ""), ("de", "en", MARIAN), ("de", "en", OURS)]


@pytest.fixture(scope="module")
def model_dirs(tiny_exported_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(tiny_exported_dir, root / OURS)
    hf = build_marian_dir(root / "hf")
    assert import_main(["--model", str(hf), "--out", str(root / MARIAN)]) == 0
    export_tiny_onnx(root / MARIAN)
    return {OURS: root / OURS, MARIAN: root / MARIAN}


def answers(model: LoadedModel | list[LoadedModel], calls: list[tuple[str, str, str]]) -> list[list[str]]:
    """Each call's translations, the calls sent concurrently (8 at a time) on one server."""
    texts = {"de": GERMAN, "en": ENGLISH}
    with running_server(model) as served, ThreadPoolExecutor(8) as pool:

        def translate(call: tuple[str, str, str]) -> list[str]:
            source, target, name = call
            reply = served.stub.Translate(request(texts[source], source, target, model=name, beam_size=2), timeout=60)
            return [result.translation for result in reply.results]

        return list(pool.map(translate, calls))


def test_mixed_pairs_under_concurrent_load_are_answered_as_each_model_alone_answers(
    model_dirs: dict[str, Path],
) -> None:
    """Every de->en call names no model, so routing's tie rule decides it: the first in load order. Broken
    once on purpose (`Backends.route` taking the last of the equal fits), the first de->en answer was the Marian's."""
    ours_alone = answers(onnx_model(model_dirs[OURS]), [("de", "en", ""), ("en", "de", "")])
    marian_alone = answers(onnx_model(model_dirs[MARIAN]), [("de", "en", "")])
    expected = {CALLS[0]: ours_alone[0], CALLS[1]: ours_alone[1], CALLS[2]: marian_alone[0], CALLS[3]: ours_alone[0]}
    calls = CALLS * 6
    together = answers([onnx_model(model_dirs[OURS]), onnx_model(model_dirs[MARIAN])], calls)
    for call, got in zip(calls, together, strict=True):
        assert got == expected[call], call
    assert ours_alone[0] != marian_alone[0]  # the two models really translate differently


@pytest.fixture(scope="module")
def two_models(model_dirs: dict[str, Path]) -> list[LoadedModel]:
    return [onnx_model(model_dirs[OURS]), onnx_model(model_dirs[MARIAN])]


def test_unknown_pairs_and_names_are_refused_naming_what_is_served(two_models: list[LoadedModel]) -> None:
    with running_server(two_models) as served:
        unknown_pair = status_of(lambda: served.stub.Translate(request(["Hallo."], "de", "fr")))
        assert unknown_pair.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "'de' -> 'fr'" in unknown_pair.details and f"{MARIAN}: de-en" in unknown_pair.details
        assert f"{OURS}: de-en, en-de" in unknown_pair.details
        unknown_name = status_of(lambda: served.stub.Translate(request(["Hallo."], model="gpt")))
        assert unknown_name.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "'gpt'" in unknown_name.details and OURS in unknown_name.details and MARIAN in unknown_name.details
        wrong_pair = status_of(lambda: served.stub.Translate(request(["Hello."], "en", "de", model=MARIAN)))
        assert wrong_pair.code == grpc.StatusCode.INVALID_ARGUMENT and "'en' -> 'de'" in wrong_pair.details


def test_list_models_the_cli_and_the_metrics_cover_every_model(two_models: list[LoadedModel]) -> None:
    from server.proto.translation.v1 import translation_pb2 as pb

    with running_server(two_models) as served:
        listed = served.stub.ListModels(pb.ListModelsRequest()).models
        assert [(m.name, [(p.source, p.target) for p in m.pairs]) for m in listed] == [
            (OURS, [("de", "en"), ("en", "de")]),
            (MARIAN, [("de", "en")]),
        ]
        # defaults: ours the server's, the import its generation config's (num_beams 4, max_length 24)
        assert [(m.default_beam_size, m.default_max_output_len) for m in listed] == [(4, 0), (4, 23)]
        cli = [sys.executable, "-m", "server.client.cli", "--server", served.address, "--list-models"]
        lines = subprocess.run(cli, capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
        assert [line.split(":")[0] for line in lines] == [OURS, MARIAN] and "de-en, en-de" in lines[0]
        for name in (OURS, MARIAN):
            served.stub.Translate(request(["Das Haus ist groß."], model=name))
        registry = served.registry
        for name in (OURS, MARIAN):
            assert sample_value(registry, "translation_requests_total", method="Translate", code="OK", model=name) == 1
            assert sample_value(registry, "translation_sentences_total", lang_pair="de-en", model=name) == 1
            assert sample_value(registry, "translation_max_slots", model=name) > 0
            assert sample_value(registry, "translation_decode_step_duration_seconds_count", model=name) > 0


def test_a_model_whose_engine_dies_fails_only_its_own_requests(model_dirs: dict[str, Path]) -> None:
    marian = onnx_model(model_dirs[MARIAN])
    killable = KillableRunner(runner_of(marian))
    models = [onnx_model(model_dirs[OURS]), LoadedModel(killable, marian.tokenizer, marian.description)]
    with running_server(models) as served:
        killable.kill.set()
        dead = status_of(lambda: served.stub.Translate(request(["Das Haus ist groß."], model=MARIAN), timeout=30))
        assert dead.code == grpc.StatusCode.UNAVAILABLE and "engine failed" in dead.details
        alive = served.stub.Translate(request(["Das Haus ist groß."], model=OURS), timeout=30)
        assert alive.results[0].sentences == 1  # the other model's engine goes on answering
        wait_until(served.server.engine_died.is_set)  # what makes `serve` drain the others and exit non-zero


def test_model_directories_come_from_the_flags_in_order(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    from server.edge.config import DEFAULT_MODEL_DIR, EnginesConfig, ModelsConfig, ServerConfig
    from server.edge.loading import StartupError, load_models, model_directories

    both = tmp_path / "models"
    both.mkdir()
    for name, directory in model_dirs.items():
        (both / name).symlink_to(directory)
    (both / "notes").mkdir()  # no onnx/: not a model
    assert model_directories(ModelsConfig()) == [DEFAULT_MODEL_DIR]
    assert model_directories(ModelsConfig(models_dir=both)) == [both / MARIAN, both / OURS]
    assert model_directories(ModelsConfig(model_dirs=(DEFAULT_MODEL_DIR,), models_dir=both / "notes")) == [
        DEFAULT_MODEL_DIR
    ]  # an empty mount point beside a model: no error
    with pytest.raises(StartupError, match="nothing to serve"):
        model_directories(ModelsConfig(models_dir=both / "notes"))
    cpu = EnginesConfig(variant="fp32", provider="cpu", threads=1)
    config = ServerConfig(models=ModelsConfig(model_dirs=(model_dirs[OURS],), models_dir=both), engines=cpu)
    with pytest.raises(StartupError, match=r"share the name \['ours'\]"):
        load_models(config)
    # A directory that is not there is named before any model loads (broken once on purpose, found only when its
    # turn came: after every model before it had loaded and warmed)
    typo = ServerConfig(models=ModelsConfig(model_dirs=(model_dirs[OURS], tmp_path / "modles")), engines=cpu)
    with pytest.raises(StartupError, match="modles does not exist"):
        load_models(typo, stopped=lambda: pytest.fail("the models began to load before the check"))


@pytest.mark.parametrize(
    ("cores", "models", "provider", "flags", "plan"),
    [
        (2, 1, "cpu", {}, (2, 1)),  # one single-threaded engine per core
        (8, 2, "cpu", {}, (4, 1)),  # the cores split between the models
        (2, 3, "cpu", {}, (1, 1)),  # more models than cores: one engine each, one thread
        (2, 1, "cpu", {"threads": 2}, (1, 2)),  # threads asked for: as many engines as fit
        (4, 1, "cpu", {"engines": 1}, (1, 0)),  # one engine alone: onnxruntime's default, every core
        (16, 1, "cuda", {}, (2, 0)),  # two engines on a GPU: one's host work overlaps the other's kernels
        (16, 2, "cuda", {}, (1, 0)),  # split between the models
        (16, 3, "cuda", {}, (1, 0)),  # one each at least
        (16, 1, "cuda", {"engines": 1}, (1, 0)),
    ],
)
def test_the_engine_plan_splits_the_cores(
    cores: int, models: int, provider: str, flags: dict[str, Any], plan: tuple[int, int]
) -> None:
    from server.edge.config import EnginesConfig
    from server.edge.loading import engine_plan

    assert engine_plan(cores, models, provider, EnginesConfig(**flags)) == plan


class CountingRunner(KillableRunner):
    """Counts the decoder steps it runs once `counting` is set (after warmup), to see which replica got work."""

    def __init__(self, inner: Runner) -> None:
        super().__init__(inner)
        self.counting = False
        self.steps = 0

    def step(
        self, slots: list[int], tokens: list[int], positions: list[int], row_scores: list[float], k: int,
        bias: RowBias | None = None,
    ) -> Candidates:  # fmt: skip
        self.steps += self.counting
        return super().step(slots, tokens, positions, row_scores, k, bias)


def test_replicas_of_a_model_share_its_requests_and_answer_as_one(model_dirs: dict[str, Path]) -> None:
    """Two engines of one model: concurrent requests spread over both (the least loaded takes each), the answers
    are the model's, ListModels shows the model once and its gauges add up both engines."""
    from server.proto.translation.v1 import translation_pb2 as pb

    alone = answers(onnx_model(model_dirs[OURS]), [("de", "en", "")])[0]
    replicas = [onnx_model(model_dirs[OURS]) for _ in range(2)]
    counting = [CountingRunner(runner_of(r)) for r in replicas]
    models = [LoadedModel(c, r.tokenizer, r.description) for c, r in zip(counting, replicas, strict=True)]
    with running_server(models) as served, ThreadPoolExecutor(8) as pool:
        for c in counting:
            c.counting = True  # after warmup
        calls = list(pool.map(lambda _: served.stub.Translate(request(GERMAN, beam_size=2), timeout=60), range(16)))
        assert all([r.translation for r in call.results] == alone for call in calls)
        assert all(c.steps > 0 for c in counting), [c.steps for c in counting]
        assert [m.name for m in served.stub.ListModels(pb.ListModelsRequest()).models] == [OURS]
        slots = sum(r.runner.max_slots for r in replicas)
        assert sample_value(served.registry, "translation_max_slots", model=OURS) == slots
        assert len(served.server.engines) == 2


@pytest.mark.parametrize(("cpu_max", "cap"), [("max 100000", None), ("150000 100000", 2), ("50000 100000", 1)])
def test_a_container_cpu_quota_caps_the_cores(tmp_path: Path, cpu_max: str, cap: int | None) -> None:
    import os

    from server.edge.loading import available_cores

    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    cores = len(os.sched_getaffinity(0))
    assert available_cores(tmp_path / "cpu.max") == (cores if cap is None else min(cores, cap))
    assert available_cores(tmp_path / "missing") == cores


def test_server_processes_sharing_engines_send_calls_that_arrive_together_to_different_idle_engines() -> None:
    """Each server process routes from a turn of its own (its index among `--processes`): a call that another
    process has just sent is not in an engine's load until the engine reports it. Broken once on purpose (every
    process counting from 0), two calls arriving together at two processes went to the same idle engine."""
    from types import SimpleNamespace
    from typing import cast

    from server.edge.backends import Backend, Backends
    from server.edge.flags import parse_config
    from server.edge.request import CallOptions

    spec = SimpleNamespace(directions=Directions.of_pairs((("de", "en"),)))
    model = SimpleNamespace(name="shared")
    engines: list[object] = [SimpleNamespace(load=0, draining=False, failed=False) for _ in range(2)]
    replicas = [cast(Backend, SimpleNamespace(engine=e, spec=spec, model=model)) for e in engines]
    options = CallOptions(source_language="de", target_language="en")

    def engine_of(backends: Backends) -> int:
        chosen = backends.route(options)[0].engine
        return next(i for i, engine in enumerate(engines) if engine is chosen)

    assert sorted(engine_of(Backends(replicas, first_turn=index)) for index in (0, 1)) == [0, 1]
    assert parse_config([], {}).serving.process_index == 0  # set by the supervisor for each server process, no flag
    one = Backends(replicas)  # this process: one engine after the other while both stay idle
    assert {engine_of(one) for _ in range(2)} == {0, 1}


def test_a_code_one_model_cannot_tell_apart_goes_to_a_model_it_fits_plainly() -> None:
    """Broken once on purpose (one `try` around every model's routing), `ar` was refused as "could mean any of
    ary, arz" although another model serves Arabic plainly."""
    from types import SimpleNamespace
    from typing import cast

    from server.edge.backends import Backend, Backends
    from server.edge.errors import InvalidRequest
    from server.edge.request import CallOptions

    def backend(name: str, pairs: tuple[tuple[str, str], ...]) -> Backend:
        engine = SimpleNamespace(load=0, draining=False, failed=False)
        return cast(
            Backend,
            SimpleNamespace(
                engine=engine,
                spec=SimpleNamespace(directions=Directions.of_pairs(pairs)),
                model=SimpleNamespace(name=name),
            ),
        )

    dialects = backend("opus-mt-en-ar-dialects", (("en", "ary"), ("en", "arz")))
    arabic = backend("opus-mt-en-ar", (("en", "ara"),))
    options = CallOptions(source_language="en", target_language="ar")
    assert Backends([dialects, arabic]).route(options)[0].model.name == "opus-mt-en-ar"
    with pytest.raises(InvalidRequest, match="could mean any of ary, arz"):
        Backends([dialects]).route(options)


@pytest.mark.parametrize("source", ["en", "eng", "EN-US"])
def test_a_language_goes_to_the_specialised_model_however_the_client_spells_it(source: str) -> None:
    """opus-mt-en-de, opus-mt-en-ROMANCE and a tc-big en-mul (source `eng`) loaded in that order, the multilingual
    one listed first to show that load order is not what decides. Broken once on purpose (a verbatim code fitting
    above every spelling), `eng->de` and `eng->es` went to en-mul; and en-ROMANCE's `>>pt_br<<` beside `>>pt_BR<<`
    refused `pt-BR` as ambiguous, which sent it to en-mul while `pt` stayed on en-ROMANCE."""
    from types import SimpleNamespace
    from typing import cast

    from server.edge.backends import Backend, Backends
    from server.edge.request import CallOptions

    def backend(name: str, pairs: tuple[tuple[str, str], ...]) -> Backend:
        engine = SimpleNamespace(load=0, draining=False, failed=False)
        return cast(
            Backend,
            SimpleNamespace(
                engine=engine,
                spec=SimpleNamespace(directions=Directions.of_pairs(pairs)),
                model=SimpleNamespace(name=name),
            ),
        )

    targets = ("deu", "spa", "por", "pob", "fra", "ita", "nld", "pol", "ces", "fin", "swe", "dan", "nob", "tur", "ell")
    multilingual = backend("opus-mt-tc-big-en-mul", tuple(("eng", t) for t in targets))  # hundreds, in a release
    german = backend("opus-mt-en-de", (("en", "de"),))
    romance = backend("opus-mt-en-ROMANCE", tuple(("en", t) for t in ("fr", "es", "pt", "pt_br", "pt_BR", "it")))
    backends = Backends([multilingual, german, romance])
    routed = {}
    for target in ("de", "DE", "es", "pt", "pt-BR", "PT-BR", "fr"):
        chosen, route = backends.route(CallOptions(source_language=source, target_language=target))
        routed[target] = (chosen.model.name, route.target)
    assert routed == {
        "de": ("opus-mt-en-de", "de"),
        "DE": ("opus-mt-en-de", "de"),
        "es": ("opus-mt-en-ROMANCE", "es"),
        "pt": ("opus-mt-en-ROMANCE", "pt"),
        "pt-BR": ("opus-mt-en-ROMANCE", "pt_BR"),
        "PT-BR": ("opus-mt-en-ROMANCE", "pt_BR"),
        "fr": ("opus-mt-en-ROMANCE", "fr"),
    }
    group = backend("opus-mt-ROMANCE-en", tuple((s, "en") for s in ("fr", "fr_BE", "es", "it", "pt")))
    french = backend("opus-mt-fr-en", (("fr", "en"),))
    assert Backends([group, french]).route(CallOptions(source_language="fr", target_language="en"))[0].model.name == (
        "opus-mt-fr-en"
    )
