"""Security options over real gRPC: TLS, mutual TLS, the bearer token; and what the code never does
(unpickle, load a model from outside its configured directory). Certificates are made per run."""

from __future__ import annotations

import ast
import datetime
import io
import ipaddress
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from server.client.channels import auth_metadata, open_channel
from server.client.cli import build_parser, run
from server.edge import interceptors
from server.edge.config import EnginesConfig, SecurityConfig, ServerConfig
from server.edge.errors import UNAUTHENTICATED_MESSAGE
from server.edge.flags import parse_config
from server.edge.healthcheck import check
from server.edge.loading import LoadedModel, StartupError, load_model
from server.edge.logs import ACCESS_LOGGER, REQUEST_ID_KEY
from server.edge.server import TranslationServer
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc
from tests.serving import (
    RunningServer,
    export_tiny_onnx,
    fake_model,
    health_status,
    request,
    running_server,
    sample_value,
    server_config,
    status_of,
)

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-token-for-tests"


@dataclass(frozen=True)
class Pki:
    """PEM files: a CA, a server certificate for localhost, a client certificate, and a stranger's."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # a client certificate from another CA
    stranger_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _certificate(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None = None,
    san: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    """Self-signed (a CA) without `issuer`, else signed by the issuer's key."""
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, signer = issuer if issuer is not None else (name, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _write(directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca_key, other_ca_key = _key(), _key()
    ca_path, _ = _write(directory, "ca", _certificate("test CA", ca_key), ca_key)
    localhost = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server_key, client_key, stranger_key = _key(), _key(), _key()
    server_cert = _certificate("localhost", server_key, ("test CA", ca_key), localhost)
    server = _write(directory, "server", server_cert, server_key)
    client = _write(directory, "client", _certificate("client", client_key, ("test CA", ca_key)), client_key)
    stranger_cert = _certificate("stranger", stranger_key, ("other CA", other_ca_key))
    stranger = _write(directory, "stranger", stranger_cert, stranger_key)
    return Pki(ca_path, *server, *client, *stranger)


def translate(channel: grpc.Channel, token: str | None = None) -> int:
    """Sentences translated by one small request over `channel`."""
    stub = pb_grpc.TranslatorStub(channel)
    reply = stub.Translate(request(["Das Haus ist groß."], beam_size=1), timeout=10, metadata=auth_metadata(token))
    return reply.results[0].sentences


def refused(channel: grpc.Channel, token: str | None = None) -> grpc.StatusCode:
    return status_of(lambda: translate(channel, token)).code


@pytest.fixture()
def model(tiny_model_dir: Path) -> LoadedModel:
    return fake_model(tiny_model_dir)


def test_tls_serves_tls_clients_only(model: LoadedModel, pki: Pki) -> None:
    config = server_config(security=SecurityConfig(tls_cert=pki.server_cert, tls_key=pki.server_key))
    with running_server(model, config) as served:
        with open_channel(served.address, tls_ca=pki.ca) as channel:
            assert translate(channel) == 1
            assert health_status(channel) == "SERVING"
        with grpc.insecure_channel(served.address) as plaintext:
            assert refused(plaintext) == grpc.StatusCode.UNAVAILABLE
        assert check(served.address, tls_ca=pki.ca)  # the Docker health check, given the CA
        assert not check(served.address)


def test_mutual_tls_requires_a_client_certificate_from_the_configured_ca(model: LoadedModel, pki: Pki) -> None:
    config = server_config(
        security=SecurityConfig(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca)
    )
    with running_server(model, config) as served:
        with open_channel(served.address, pki.ca, pki.client_cert, pki.client_key) as channel:
            assert translate(channel) == 1
        with open_channel(served.address, tls_ca=pki.ca) as anonymous:
            assert refused(anonymous) == grpc.StatusCode.UNAVAILABLE
        with open_channel(served.address, pki.ca, pki.stranger_cert, pki.stranger_key) as stranger:
            assert refused(stranger) == grpc.StatusCode.UNAVAILABLE
        assert check(served.address, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key)


def test_the_image_healthcheck_reaches_a_tls_server_from_its_environment(
    model: LoadedModel, pki: Pki, tmp_path: Path
) -> None:
    """The Dockerfile's fixed HEALTHCHECK command (127.0.0.1) against a TLS server whose certificate
    names only its public name: the TRANSLATE_HEALTHCHECK_* variables make it pass."""
    ca_key, key = _key(), _key()
    ca, _ = _write(tmp_path, "ca", _certificate("deploy CA", ca_key), ca_key)
    public_only = _certificate("translate.internal", key, ("deploy CA", ca_key), [x509.DNSName("translate.internal")])
    cert, key_path = _write(tmp_path, "server", public_only, key)
    with running_server(model, server_config(security=SecurityConfig(tls_cert=cert, tls_key=key_path))) as served:
        command = [sys.executable, "-m", "server.edge.healthcheck", "--address", f"127.0.0.1:{served.port}"]

        def healthcheck(**variables: str) -> int:
            env = {**os.environ, **{f"TRANSLATE_HEALTHCHECK_{k.upper()}": v for k, v in variables.items()}}
            return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, timeout=60, check=False).returncode

        assert healthcheck() == 1  # plaintext against TLS
        assert healthcheck(tls_ca=str(ca)) == 1  # the certificate does not name 127.0.0.1
        assert healthcheck(tls_ca=str(ca), tls_server_name="translate.internal") == 0


@pytest.fixture()
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(f"{TOKEN}\n")  # a trailing newline, as editors and `echo` write it
    return path


@pytest.fixture()
def guarded(model: LoadedModel, token_file: Path) -> Iterator[RunningServer]:
    with running_server(model, server_config(security=SecurityConfig(auth_token_file=token_file))) as served:
        yield served


def test_a_bearer_token_is_required_for_every_call_but_health(guarded: RunningServer) -> None:
    channel = guarded.channel
    for token in (None, "wrong", TOKEN[:-1], TOKEN + "x"):
        error = status_of(lambda: translate(channel, token))  # noqa: B023
        assert (error.code, error.details) == (grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
    stream = guarded.stub.TranslateStream(request(["Hallo."]), timeout=10)
    assert status_of(lambda: list(stream)).code == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(lambda: guarded.stub.ListModels(pb.ListModelsRequest())).code == grpc.StatusCode.UNAUTHENTICATED
    assert health_status(channel) == "SERVING"  # probes carry no token
    assert translate(channel, TOKEN) == 1
    lowercase = (("authorization", f"bearer {TOKEN}"),)
    assert guarded.stub.ListModels(pb.ListModelsRequest(), metadata=lowercase).models[0].name == "fake"
    unauthenticated = sample_value(
        guarded.registry, "translation_requests_total", method="Translate", code="UNAUTHENTICATED", lang_pair=""
    )
    assert unauthenticated == 4, "refused calls are counted like any other"


def test_without_one_token_the_request_is_refused_before_it_is_parsed(guarded: RunningServer) -> None:
    """Bytes that do not parse, sent over gRPC without a token, with the right one twice, or with a wrong
    one, are UNAUTHENTICATED; the same bytes with the token are INVALID_ARGUMENT (parsed, and refused as
    malformed), and a valid request with the token repeated is refused too.

    Deliberate breaks: a refusal that parses the request first (`_refusing` given the request's
    deserializer in `server/edge/interceptors.py`) fails the first assertion (UNKNOWN, "was corrupt", not
    UNAUTHENTICATED); accepting any number of `authorization` headers (`if not values` in
    `AuthInterceptor.authorized`) fails the repeated-header one (INVALID_ARGUMENT: it was parsed)."""
    garbage = b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"  # field 1, a length varint that never ends
    send = guarded.channel.unary_unary(
        "/translation.v1.Translator/Translate", request_serializer=None, response_deserializer=None
    )
    bearer = ("authorization", f"Bearer {TOKEN}")
    for metadata in ((), (bearer, bearer), (("authorization", "Bearer wrong"),)):
        error = status_of(lambda: send(garbage, timeout=10, metadata=metadata))  # noqa: B023
        assert (error.code, error.details) == (grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE), metadata
    parsed = status_of(lambda: send(garbage, timeout=10, metadata=(bearer,)))
    assert parsed.code == grpc.StatusCode.INVALID_ARGUMENT, "the bytes do not parse: only the token kept them out"
    valid = request(["Das Haus ist groß."], beam_size=1)
    twice = status_of(lambda: guarded.stub.Translate(valid, timeout=10, metadata=(bearer, bearer)))
    assert twice.code == grpc.StatusCode.UNAUTHENTICATED
    assert guarded.stub.Translate(valid, timeout=10, metadata=(bearer,)).results[0].sentences == 1


def test_reflection_needs_the_token_too(guarded: RunningServer) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with pytest.raises(grpc.RpcError) as info:
        ProtoReflectionDescriptorDatabase(guarded.channel).get_services()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]


def test_the_token_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return a == b

    monkeypatch.setattr(interceptors.hmac, "compare_digest", compare_digest)
    guard = interceptors.AuthInterceptor(TOKEN)
    assert guard.authorized((("authorization", f"Bearer {TOKEN}"),))
    assert not guard.authorized((("authorization", "Bearer nope"),))
    assert not guard.authorized((("authorization", f"Bearer {TOKEN}"), ("authorization", f"Bearer {TOKEN}")))
    assert compared == [(TOKEN.encode(), TOKEN.encode()), (b"nope", TOKEN.encode())]


def test_the_client_cli_speaks_tls_and_sends_the_token(model: LoadedModel, pki: Pki, token_file: Path) -> None:
    config = server_config(
        security=SecurityConfig(tls_cert=pki.server_cert, tls_key=pki.server_key, auth_token_file=token_file)
    )
    with running_server(model, config) as served:
        base = ["--server", served.address, "--source", "de", "--target", "en", "--tls-ca", str(pki.ca)]
        out, err = io.StringIO(), io.StringIO()
        assert run(build_parser().parse_args([*base, "--token", TOKEN]), ["Das Haus ist groß."], out, err) == 0
        assert len(out.getvalue().splitlines()) == 1
        from_env = build_parser({"TRANSLATE_TOKEN": TOKEN}).parse_args(base)
        assert run(from_env, ["Geheimpolizei"], io.StringIO(), io.StringIO()) == 0
        err = io.StringIO()
        assert run(build_parser().parse_args(base), ["Hallo"], io.StringIO(), err) == 16  # UNAUTHENTICATED
        assert "UNAUTHENTICATED" in err.getvalue()


def test_security_flags_parse_from_flags_and_environment() -> None:
    env = {"TRANSLATE_TLS_CERT": "/tls/crt", "TRANSLATE_TLS_KEY": "/tls/key", "TRANSLATE_AUTH_TOKEN_FILE": "/run/tok"}
    security = parse_config(["--tls-client-ca", "/tls/ca"], env).security
    assert (security.tls_cert, security.tls_key) == (Path("/tls/crt"), Path("/tls/key"))
    assert security.tls_client_ca == Path("/tls/ca")
    assert security.auth_token_file == Path("/run/tok")
    assert parse_config([], {}).security == SecurityConfig()
    assert SecurityConfig().tls_cert is None and SecurityConfig().auth_token_file is None
    with pytest.raises(ValueError, match="go together"):
        SecurityConfig(tls_cert=Path("/tls/crt"))
    with pytest.raises(ValueError, match="needs tls_cert"):
        SecurityConfig(tls_client_ca=Path("/tls/ca"))


@pytest.mark.parametrize("problem", ["missing token file", "empty token file", "missing certificate"])
def test_unusable_security_files_stop_startup_with_a_clear_message(tmp_path: Path, problem: str) -> None:
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    configs = {
        "missing token file": SecurityConfig(auth_token_file=tmp_path / "absent"),
        "empty token file": SecurityConfig(auth_token_file=empty),
        "missing certificate": SecurityConfig(tls_cert=tmp_path / "absent.crt", tls_key=tmp_path / "absent.key"),
    }
    with pytest.raises(StartupError, match=r"token file|TLS"):
        TranslationServer(server_config(security=configs[problem]))


FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def unsafe_loads(path: Path) -> list[str]:
    """Imports of unpickling modules, torch.load without weights_only=True, numpy loads with allow_pickle=True."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{path}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in FORBIDDEN_MODULES]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
            keywords = {k.arg: k.value for k in node.keywords}
            owner = ast.unparse(node.func.value)
            weights_only = keywords.get("weights_only")
            if owner == "torch" and not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append(f"{path}:{node.lineno} torch.load without weights_only=True")
            allow = keywords.get("allow_pickle")
            if owner in ("np", "numpy") and not (isinstance(allow, ast.Constant) and allow.value is False):
                found.append(f"{path}:{node.lineno} numpy load that may unpickle")
    return found


def test_nothing_is_ever_unpickled() -> None:
    files = [p for package in ("server", "export", "model") for p in (ROOT / package).rglob("*.py")]
    assert len(files) > 20
    assert [finding for path in files for finding in unsafe_loads(path)] == []


def test_unsafe_load_detector_catches_what_it_should(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nimport torch\nimport numpy as np\ntorch.load('x')\nnp.load('y')\n")
    assert len(unsafe_loads(bad)) == 3


class OpenedFiles:
    """Every file this process opens while `recording`: Python's own opens (the `open` audit event: builtins
    and `io.open`, `os.open`, `Path.read_*`), and the two libraries that open files natively, onnxruntime
    (a session from a path) and SentencePiece (a model file), spied at their classes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import onnxruntime
        import sentencepiece

        self.paths: list[Path] = []
        self.recording = False
        sys.addaudithook(self._audit)  # audit hooks cannot be removed: it records only while asked to
        self._spy(monkeypatch, onnxruntime.InferenceSession, "__init__")
        self._spy(monkeypatch, sentencepiece.SentencePieceProcessor, "LoadFromFile")

    def _audit(self, event: str, args: tuple[object, ...]) -> None:
        if self.recording and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
            self.paths.append(Path(os.fsdecode(args[0])))

    def _spy(self, monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> None:
        """Record the path that `cls.name` is given first."""
        original = getattr(cls, name)

        def spy(this: object, *args: object, **kwargs: object) -> object:
            path = args[0] if args else None
            if self.recording and isinstance(path, str | os.PathLike):
                self.paths.append(Path(path))
            return original(this, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)

    @contextmanager
    def record(self) -> Iterator[list[Path]]:
        self.paths, self.recording = [], True
        try:
            yield self.paths
        finally:
            self.recording = False


def test_the_model_is_read_only_from_the_configured_directory(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file opened while a model loads, through any function, is under the model directory.

    Deliberate break: `Path("/etc/hostname").read_text()` added to `load_model` fails this test (the audit
    hook records `/etc/hostname`); the former spies on three loader functions let it pass."""
    export_tiny_onnx(tiny_model_dir)
    files = OpenedFiles(monkeypatch)
    root = tiny_model_dir.resolve()
    config = ServerConfig(engines=EnginesConfig(variant="fp32", provider="cpu", threads=1))
    load_model(config, tiny_model_dir, in_process=True)  # once first: what it imports is not model data
    with files.record() as opened:
        load_model(config, tiny_model_dir, in_process=True)
    assert all(path.resolve().is_relative_to(root) for path in opened), opened
    onnx = {path.name for path in opened if path.suffix == ".onnx"}
    assert len(onnx) == 2 and {"metadata.json", "tokenizer.model"} <= {path.name for path in opened}  # encoder, step
    with pytest.raises(ValueError, match="variant must be one of"):
        EnginesConfig(variant="../../elsewhere")  # the variant names a subdirectory; it is never a path


def test_a_call_refused_before_the_servicer_is_written_to_the_access_log(
    guarded: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong token and a malformed message are answered before any servicer runs; each still writes its access
    record, with the client's request id (a new one sent back where the client sent none), so that failed logins
    show in the log as they do in the counters. (Broken once on purpose, only counted: five refusals counted, none
    logged.)"""
    from tests.test_logs import access_records

    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    wrong = (("authorization", "Bearer wrong"), (REQUEST_ID_KEY, "login-1"))
    assert status_of(lambda: translate(guarded.channel, "wrong")).code == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(lambda: guarded.stub.ListModels(pb.ListModelsRequest(), metadata=wrong)).code.name == (
        "UNAUTHENTICATED"
    )
    send = guarded.channel.unary_unary(
        "/translation.v1.Translator/Translate", request_serializer=None, response_deserializer=None
    )
    garbage = b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"
    malformed = status_of(lambda: send(garbage, timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),)))
    assert malformed.code == grpc.StatusCode.INVALID_ARGUMENT
    records = access_records(caplog)
    assert [(r["method"], r["status"]) for r in records] == [
        ("Translate", "UNAUTHENTICATED"), ("ListModels", "UNAUTHENTICATED"), ("Translate", "INVALID_ARGUMENT")
    ]  # fmt: skip
    assert records[1]["request_id"] == "login-1" and records[0]["detail"] == UNAUTHENTICATED_MESSAGE
    with pytest.raises(grpc.RpcError) as refused:  # the client learns the id its refusal was logged under
        guarded.stub.ListModels(pb.ListModelsRequest(), metadata=(("authorization", "Bearer wrong"),))
    trailing: Any = refused.value.trailing_metadata()  # type: ignore[attr-defined]
    sent_back = {key: value for key, value in trailing or ()}
    assert sent_back[REQUEST_ID_KEY] == access_records(caplog)[-1]["request_id"]
