"""Exit 0 iff the server's gRPC health check says SERVING (for Docker HEALTHCHECK and scripts).

Usage: python -m server.healthcheck --address localhost:50051 [--service translation.v1.Translator]
For a server with TLS add --tls-ca (and --tls-cert/--tls-key for mutual TLS); health needs no token.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from server.channels import open_channel


def check(
    address: str,
    service: str = "",
    timeout: float = 3.0,
    tls_ca: Path | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
) -> bool:
    """True iff `service` at `address` answers SERVING within `timeout` seconds."""
    with open_channel(address, tls_ca, tls_cert, tls_key) as channel:
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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="localhost:50051", help="HOST:PORT of the gRPC server")
    parser.add_argument("--service", default="", help='service name to check ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument("--tls-ca", type=Path, default=None, help="PEM CA bundle: connect with TLS")
    parser.add_argument("--tls-cert", type=Path, default=None, help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", type=Path, default=None, help="PEM key of --tls-cert")
    args = parser.parse_args(argv)
    healthy = check(args.address, args.service, args.timeout, args.tls_ca, args.tls_cert, args.tls_key)
    sys.exit(0 if healthy else 1)


if __name__ == "__main__":
    main()
