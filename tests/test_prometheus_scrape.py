"""The monitoring path end to end: a real Prometheus server (Debian's `prometheus` binary) scrapes the real
translation service on loopback while gRPC clients send it Translate and TranslateStream requests. Prometheus's
HTTP API must then return the request counters, token counters and latency quantiles that the dashboard and the
alerts are built on, with the values the traffic implies, and every dashboard query and alert rule must evaluate
there without error.

The service runs as its own process (`python -m server.edge.main`, the images' entry point, with `translate-server`'s
flags) on a tiny exported model, so Prometheus sees exactly what it would see in a deployment.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from server.edge.healthcheck import check
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc
from tests.ci_tools import required_tool
from tests.test_deploy import PROMETHEUS, dashboard_queries

PROMETHEUS_BIN = shutil.which("prometheus")


@pytest.fixture(scope="module", autouse=True)
def prometheus_binary() -> str:
    """Every test here needs the binary: missing, they skip, and fail under CI, which installs it."""
    return required_tool("prometheus", "apt-get install prometheus (.ci/run does)")


SCRAPE_INTERVAL_S = 1.0
ROOT = Path(__file__).resolve().parents[1]
# (method, source, target, texts): one RPC each; both language pairs and both translation methods get series.
TRAFFIC: list[tuple[str, str, str, list[str]]] = [
    ("Translate", "de", "en", ["Das Haus ist groß."]),
    ("Translate", "de", "en", ["Er wartete.", "Lernfähigkeit"]),
    ("Translate", "en", "de", ["The house is big."]),
    ("TranslateStream", "de", "en", ["Geheimpolizei", "Steuerpult"]),
    ("Translate", "de", "en", ["Leidenschaft"]),
    ("Translate", "en", "de", ["secret police", "console", "passion"]),
]
BAD_PAIR = ("Translate", "de", "fr", ["Das Haus ist groß."])  # unknown language pair: INVALID_ARGUMENT
# The server serves two models (the tiny one twice, under two names); these calls name the second.
SECOND_MODEL = "second"
SECOND_MODEL_TRAFFIC: list[tuple[str, str, str, list[str]]] = [
    ("Translate", "en", "de", ["The house is big."]),
    ("TranslateStream", "de", "en", ["Geheimpolizei"]),
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_for(check: Callable[[], bool], timeout: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args!r} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if check():
            return
        time.sleep(0.2)
    pytest.fail(f"{proc.args!r} not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ----------------------------------------------------------------------------------------------- service


@dataclass(frozen=True)
class Service:
    grpc_address: str
    metrics_address: str


@pytest.fixture(scope="module")
def service(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """`translate-server` on the tiny model exported to fp32, on free loopback ports, until SERVING."""
    from tests.serving import export_tiny_onnx

    model_dir = export_tiny_onnx(tiny_model_dir).parents[1]  # `python -m export` once per session, shared
    second = tmp_path_factory.mktemp("models") / SECOND_MODEL
    shutil.copytree(model_dir, second)
    grpc_port, metrics_port = _free_port(), _free_port()
    args = ["--port", str(grpc_port), "--metrics-port", str(metrics_port), "--model-dir", str(model_dir)]
    args += ["--model-dir", str(second)]
    args += ["--host", "127.0.0.1", "--variant", "fp32", "--provider", "cpu", "--threads", "1", "--drain-seconds", "2"]
    args += ["--cache-size", "100"]  # as the images run: the cache panels get series (no sentence repeats per model)
    log_path = tmp_path_factory.mktemp("logs") / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "server.edge.main", *args], cwd=ROOT, stdout=log, stderr=log)
        address = f"127.0.0.1:{grpc_port}"
        try:
            _wait_for(lambda: check(address, timeout=1.0), 120, proc, log_path)
            yield Service(grpc_address=address, metrics_address=f"127.0.0.1:{metrics_port}")
        finally:
            _stop(proc)


@dataclass(frozen=True)
class Call:
    """One RPC as the client saw it."""

    method: str
    lang_pair: str
    code: grpc.StatusCode
    seconds: float  # client-side wall time, an upper bound of what the server measures
    results: list[pb.TextResult]


def _call(service: Service, method: str, source: str, target: str, texts: list[str], model: str = "") -> Call:
    options = pb.TranslationOptions(source_language=source, target_language=target, model=model)
    request = pb.TranslateRequest(texts=texts, options=options)
    start = time.monotonic()
    with grpc.insecure_channel(service.grpc_address) as channel:
        stub = pb_grpc.TranslatorStub(channel)
        try:
            if method == "Translate":
                results = list(stub.Translate(request, timeout=60).results)
            else:
                results = [m.result for m in stub.TranslateStream(request, timeout=60) if m.HasField("result")]
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            results, code = [], error.code()  # type: ignore[attr-defined]  # a stub's RpcError is a grpc.Call
    return Call(method, f"{source}-{target}", code, time.monotonic() - start, results)


# -------------------------------------------------------------------------------------------- Prometheus


class Prometheus:
    """A real Prometheus on a free loopback port, scraping `target` every second, with the alert rules loaded."""

    def __init__(self, target: str, workdir: Path) -> None:
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S:g}s", "evaluation_interval": "1s"},
            "rule_files": [str(PROMETHEUS / "alerts.yml")],
            "scrape_configs": [{"job_name": "translation", "static_configs": [{"targets": [target]}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{_free_port()}"
        cmd = [
            str(PROMETHEUS_BIN),
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address={self.url.removeprefix('http://')}",
            "--log.level=warn",
        ]
        self.log_path = workdir / "prometheus.log"
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        _wait_for(self._ready, 60, self.proc, self.log_path)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def scalar(self, expr: str) -> float:
        """The single value of `expr`; NaN when the result is empty."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else math.nan

    def by_label(self, expr: str, label: str) -> dict[str, float]:
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in self.query(expr)}

    def wait_until(self, expr: str, expected: float, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while (value := self.scalar(expr)) != expected:
            if time.monotonic() > deadline:
                pytest.fail(f"{expr} = {value}, expected {expected}")
            time.sleep(SCRAPE_INTERVAL_S / 2)

    def close(self) -> None:
        _stop(self.proc)
        self.log.close()


@dataclass(frozen=True)
class Traffic:
    prometheus: Prometheus
    calls: list[Call]  # the successful ones, in order; one INVALID_ARGUMENT request followed them

    def total(self, pair: str, count: Callable[[Call], int]) -> int:
        return sum(count(call) for call in self.calls if call.lang_pair == pair)


@pytest.fixture(scope="module")
def traffic(service: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traffic]:
    prometheus = Prometheus(service.metrics_address, tmp_path_factory.mktemp("prometheus"))
    try:
        prometheus.wait_until('sum(up{job="translation"})', 1.0)
        calls = []
        for method, source, target, texts in TRAFFIC:
            call = _call(service, method, source, target, texts)
            assert call.code == grpc.StatusCode.OK and len(call.results) == len(texts), call
            calls.append(call)
            time.sleep(SCRAPE_INTERVAL_S)  # spread the requests over scrapes, so rate() sees them arrive
        for method, source, target, texts in SECOND_MODEL_TRAFFIC:
            calls.append(call := _call(service, method, source, target, texts, SECOND_MODEL))
            assert call.code == grpc.StatusCode.OK and len(call.results) == len(texts), call
        rejected = _call(service, *BAD_PAIR)
        assert rejected.code == grpc.StatusCode.INVALID_ARGUMENT, rejected
        prometheus.wait_until("sum(translation_requests_total)", float(len(calls) + 1))
        time.sleep(2 * SCRAPE_INTERVAL_S)  # a few more scrapes after the last request
        yield Traffic(prometheus, calls)
    finally:
        prometheus.close()


# ------------------------------------------------------------------------------------------------- tests


PAIRS = ("de-en", "en-de")


def _response_sum(traffic: Traffic, pair: str, field: str) -> int:
    """A TextResult count field (sentences, input_tokens, output_tokens) summed over one pair's responses."""
    return traffic.total(pair, lambda call: sum(int(getattr(result, field)) for result in call.results))


def test_request_counters_match_the_traffic(traffic: Traffic) -> None:
    p = traffic.prometheus
    for method in ("Translate", "TranslateStream"):
        for pair in PAIRS:
            sent = sum(1 for c in traffic.calls if c.method == method and c.lang_pair == pair)
            expr = f'sum(translation_requests_total{{method="{method}", code="OK", lang_pair="{pair}"}})'
            value = p.scalar(expr)  # NaN: no such series, right when nothing was sent
            assert math.isnan(value) if sent == 0 else value == sent, (expr, value, sent)
    assert p.scalar('sum(translation_requests_total{code="INVALID_ARGUMENT"})') == 1
    assert math.isnan(p.scalar('sum(translation_requests_total{code!~"OK|INVALID_ARGUMENT"})'))


def test_every_model_has_its_own_series(traffic: Traffic) -> None:
    """Requests, sentences and the engine's gauges and steps per model; the refusal came before routing."""
    p = traffic.prometheus
    requests = p.by_label('sum by (model) (translation_requests_total{code="OK"})', "model")
    first = next(name for name in requests if name != SECOND_MODEL)  # the first model directory's name
    assert requests == {first: len(TRAFFIC), SECOND_MODEL: len(SECOND_MODEL_TRAFFIC)}, requests
    assert p.by_label('sum by (model) (translation_requests_total{code="INVALID_ARGUMENT"})', "model") == {"": 1}
    assert set(p.by_label("sum by (model) (translation_max_slots)", "model")) == {first, SECOND_MODEL}
    steps = p.by_label("sum by (model) (translation_decode_step_duration_seconds_count)", "model")
    assert steps.keys() == {first, SECOND_MODEL} and min(steps.values()) > 0, steps


def test_latency_histogram_times_every_ok_request_and_no_refusal(traffic: Traffic) -> None:
    p = traffic.prometheus
    counts = p.by_label("sum by (lang_pair) (translation_request_duration_seconds_count)", "lang_pair")
    for pair in PAIRS:
        assert counts.pop(pair) == traffic.total(pair, lambda call: 1), pair
    # The rejected request is counted (test_request_counters_match_the_traffic) but not timed: fast refusals
    # would drag the latency quantiles down exactly when a flood of them means the service is in trouble.
    assert sum(counts.values()) == 0, counts


def test_sentence_and_token_counters_match_the_responses(traffic: Traffic) -> None:
    """What Prometheus holds equals what the responses reported, pair by pair: the tokens/s panel is exact."""
    p = traffic.prometheus
    for metric, field in [
        ("translation_sentences_total", "sentences"),
        ("translation_input_tokens_total", "input_tokens"),
        ("translation_output_tokens_total", "output_tokens"),
    ]:
        scraped = p.by_label(f"sum by (lang_pair) ({metric})", "lang_pair")
        sent = {pair: _response_sum(traffic, pair, field) for pair in PAIRS}
        assert scraped == {pair: float(n) for pair, n in sent.items()}, metric


def test_p99_latency_as_the_dashboard_computes_it(traffic: Traffic) -> None:
    """The dashboard's p99 over a rate window, and the all-time p99, both within what the client measured."""
    p = traffic.prometheus
    windowed = p.scalar("histogram_quantile(0.99, sum by (le) (rate(translation_request_duration_seconds_bucket[1m])))")
    all_time = p.scalar("histogram_quantile(0.99, sum by (le) (translation_request_duration_seconds_bucket))")
    buckets = sorted(
        float(r["metric"]["le"])
        for r in p.query("sum by (le) (translation_request_duration_seconds_bucket)")
        if r["metric"]["le"] != "+Inf"
    )
    # histogram_quantile interpolates inside a bucket: the answer lies below the upper bound of the bucket that
    # holds the slowest request, and the server-side time can only be shorter than the client's.
    slowest = max(call.seconds for call in traffic.calls)
    bound = next(b for b in buckets if b >= slowest)
    for value in (windowed, all_time):
        assert 0.0 < value <= bound, (value, slowest, bound)


def test_dashboard_queries_run_on_live_data(traffic: Traffic) -> None:
    """Every panel query evaluates without error, and the ones fed by the traffic return series."""
    p = traffic.prometheus
    empty = []
    for title, expr in dashboard_queries(json.loads((ROOT / "docker/grafana/dashboards/translation.json").read_text())):
        if not p.query(expr):
            empty.append((title, expr.split("(")[-1].split("{")[0]))
    # Error queries may be empty only if nothing failed that way. One request did, at the edge
    # (INVALID_ARGUMENT), so every query has data but two: no request failed inside the engine
    # (tests/test_metrics.py drives that series through a real Engine), and none was refused
    # RESOURCE_EXHAUSTED (tests/test_servicer.py counts both reasons). Its two models' engines run in
    # processes of their own (the CPU default with two or more engines), so the process panels have data.
    assert empty == [
        ("Error rate by status", "translation_requests_rejected_total"),
        ("Failed sentences by reason and stage", "translation_sentences_failed_total"),
    ], f"queries with no data after traffic: {empty}"


def test_alert_rules_evaluate_and_stay_quiet_under_healthy_traffic(traffic: Traffic) -> None:
    groups = traffic.prometheus.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == 7, [r["name"] for r in rules]
    assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules]
    firing = [r["name"] for r in rules if r["state"] == "firing"]
    assert not firing, firing


def test_metrics_endpoint_is_plain_prometheus_text(service: Service) -> None:
    with urllib.request.urlopen(f"http://{service.metrics_address}/metrics", timeout=5) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        body = reply.read().decode()
    assert "translation_model_info{" in body and "translation_requests_total{" in body
    for series in ("process_resident_memory_bytes ", "process_cpu_seconds_total ", "python_gc_collections_total{"):
        assert series in body, series  # server.edge.process_metrics
    assert "_created" not in body


def test_image_healthcheck_command_reports_serving(service: Service) -> None:
    """The Dockerfiles' HEALTHCHECK command, run as the container runs it, against the live server."""
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        text = (ROOT / "docker" / dockerfile).read_text()
        command = re.search(r'HEALTHCHECK .*?CMD \["sh", "-c", "exec (.+?)"\]', text, re.S)
        assert command is not None, dockerfile
        port = service.grpc_address.rsplit(":", 1)[1]
        # `python` is the image's venv interpreter; here it is the one running the tests.
        shell = command.group(1).replace("python ", f"{sys.executable} ", 1)
        result = subprocess.run(["sh", "-c", shell], cwd=ROOT, env={**os.environ, "TRANSLATE_PORT": port}, timeout=30)
        assert result.returncode == 0, dockerfile
