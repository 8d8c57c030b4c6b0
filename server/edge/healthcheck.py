"""Exit 0 iff the server's gRPC health check says SERVING (for Docker HEALTHCHECK and scripts).

Usage: python -m server.edge.healthcheck --address localhost:50051 [--service translation.v1.Translator]
For a server with TLS add --tls-ca (and --tls-cert/--tls-key for mutual TLS, --tls-server-name when
the certificate does not name the address's host); health needs no token. Every TLS flag also reads
from TRANSLATE_HEALTHCHECK_<FLAG> (flags win), so an image's fixed HEALTHCHECK command works on a
server that an operator switched to TLS: set TRANSLATE_HEALTHCHECK_TLS_CA and the rest beside
TRANSLATE_TLS_CERT.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from server.client.channels import open_channel
from server.edge.flags import env_name

ENV_PREFIX = "TRANSLATE_HEALTHCHECK_"


def check(
    address: str,
    service: str = "",
    timeout: float = 3.0,
    tls_ca: Path | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    tls_server_name: str | None = None,
) -> bool:
    """True iff `service` at `address` answers SERVING within `timeout` seconds."""
    with open_channel(address, tls_ca, tls_cert, tls_key, tls_server_name) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            sys.stderr.write(f"health check of {address} failed: {err.code().name}\n")
            return False
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        sys.stderr.write(f"{address} is {status}\n")
        return False
    return True


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ

    def from_env(flag: str) -> str | None:
        return env.get(env_name(flag, ENV_PREFIX)) or None

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="localhost:50051", help="HOST:PORT of the gRPC server")
    parser.add_argument("--service", default="", help='service name to check ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    for flag, help_text in (
        ("tls-ca", "PEM CA bundle: connect with TLS"),
        ("tls-cert", "PEM client certificate (mutual TLS)"),
        ("tls-key", "PEM key of --tls-cert"),
    ):
        default = from_env(flag)
        parser.add_argument(f"--{flag}", type=Path, default=Path(default) if default else None, help=help_text)
    parser.add_argument(
        "--tls-server-name", default=from_env("tls-server-name"), help="name the server's certificate carries"
    )
    args = parser.parse_args(argv)
    tls = (args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    sys.exit(0 if check(args.address, args.service, args.timeout, *tls) else 1)


if __name__ == "__main__":
    main()
