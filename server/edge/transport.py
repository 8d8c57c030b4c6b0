"""How the gRPC server is reached, from the config: its HTTP/2 connection timers, its cap on calls, TLS
credentials, the interceptor chain, and the check that its port is free before anything binds it."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import grpc

from server.edge.config import LimitsConfig, SecurityConfig, ServingConfig
from server.edge.interceptors import AuthInterceptor, Interceptor, ParseInterceptor
from server.edge.loading import ConfigError
from server.edge.metrics import Metrics

NEVER_MS = 2**31 - 1  # the largest duration grpc takes (24.8 days), for a timer that is off


def connection_options(serving: ServingConfig) -> list[tuple[str, int]]:
    """grpc's HTTP/2 connection timers from the config (docs/reliability.md, "Connections", says why each default).

    Age: GOAWAY after it (gRPC adds +-10% jitter), calls in flight get the grace; clients dial again and
    re-resolve, so replicas the autoscaler adds get traffic from clients already connected. Idle:
    connections without calls close, and dial again on their next call. Keepalive: pings find a client
    gone without closing its connection and cancel its calls, freeing their slots before their deadline;
    pings are allowed on connections without calls too, both ways, so clients whose own keepalive is at
    least `min_ping_interval_s` keep their connections (gRPC's default answers such pings with GOAWAY).
    """
    options = [
        ("grpc.keepalive_time_ms", _ms(serving.keepalive_time_s) or NEVER_MS),
        ("grpc.keepalive_timeout_ms", _ms(serving.keepalive_timeout_s)),
        # grpc closes on an unanswered ping only once this one (default 1 min) has passed too
        ("grpc.http2.ping_timeout_ms", _ms(serving.keepalive_timeout_s)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(serving.min_ping_interval_s)),
    ]
    optional = [  # 0 = never: left to grpc, whose default is no limit
        ("grpc.max_connection_age_ms", serving.max_connection_age_s),
        ("grpc.max_connection_age_grace_ms", serving.max_connection_age_grace_s),
        ("grpc.max_connection_idle_ms", serving.max_connection_idle_s),
    ]
    return options + [(name, _ms(seconds)) for name, seconds in optional if seconds > 0]


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def max_concurrent_rpcs(limits: LimitsConfig) -> int | None:
    """gRPC's own cap on calls in progress (None: no cap). Off by default: it counts health checks too,
    so a cap near what the queue holds would fail readiness probes under load, and its refusals come
    from gRPC, not the service, so they are neither counted in the metrics nor say "queue is full"."""
    return limits.max_concurrent_rpcs or None


def server_credentials(security: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured PEM files (client certificates required with a client CA)."""
    if security.tls_cert is None or security.tls_key is None:
        return None
    client_ca = _read_pem(security.tls_client_ca, "TLS client CA") if security.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(_read_pem(security.tls_key, "TLS key"), _read_pem(security.tls_cert, "TLS certificate"))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def interceptors(security: SecurityConfig, metrics: Metrics) -> list[Interceptor]:
    """Authentication first (a refused call's request is never parsed), then request parsing."""
    chain: list[Interceptor] = [ParseInterceptor(metrics)]
    if security.auth_token_file is not None:
        token = _read_file(security.auth_token_file, "auth token file").decode().strip()
        if not token:
            raise ConfigError(f"the auth token file {security.auth_token_file} is empty")
        chain.insert(0, AuthInterceptor(token, metrics))
    return chain


def _read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read the {what} {path}: {err.strerror}") from err


def _read_pem(path: Path, what: str) -> bytes:
    """A PEM file's bytes; ConfigError naming it if it holds no PEM block (gRPC would only fail to bind)."""
    data = _read_file(path, what)
    if b"-----BEGIN " not in data:
        raise ConfigError(f"the {what} {path} is not PEM (no -----BEGIN line): give the PEM file, not DER or a path")
    return data


def check_port_free(host: str, port: int) -> None:
    """ConfigError naming the port if a socket on `host` cannot bind it, as gRPC's bind (without SO_REUSEPORT)
    would fail: tried first, so that the operator reads one line, not gRPC's own error before it; and before the
    `--processes` parent's children share the port with SO_REUSEPORT, where a server already there would take
    their connections' share without a word. Port 0 (any free port) is always free."""
    if port == 0:
        return
    address = metrics_address(host)
    # gRPC binds "[::]" as IPv4's wildcard too where the host has no IPv6
    addresses = (address, "0.0.0.0") if address == "::" else (address,)
    try:
        found = [a for each in addresses for a in socket.getaddrinfo(each, port, type=socket.SOCK_STREAM)]
    except socket.gaierror as err:
        raise ConfigError(f"could not bind {host}:{port}: {host} does not resolve ({err.strerror})") from err
    refusals = []
    for family, kind, protocol, _, bound in found:
        try:
            with socket.socket(family, kind, protocol) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are no listener
                probe.bind(bound)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ConfigError(f"could not bind {host}:{port}: the port is in use (another server?)") from err
            refusals.append(err)
    if len(refusals) == len(found):  # gRPC binds if any of the host's addresses can be
        raise ConfigError(f"could not bind {host}:{port}: {refusals[0].strerror}")


def metrics_address(host: str) -> str:
    """The gRPC bind address as the metrics HTTP server takes it: "[::]" -> "::", "" -> every interface."""
    return host.strip("[]") or "0.0.0.0"
