"""Client side of the security options: channels with TLS or mutual TLS, and bearer-token metadata.

Shared by the `translate` CLI and the health check, so both reach a server whatever it requires.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc

Metadata = tuple[tuple[str, str], ...]

# How a client of several replicas rides out one shutting down: round robin over every address the name resolves
# to, each replica's own health (a replica turns NOT_SERVING at SIGTERM and leaves the rotation at once), and a
# retry of a call answered UNAVAILABLE (a replica refusing calls while it drains: "retry on another replica"),
# which round robin sends to the next one. A translation is idempotent, so a retry is always safe. Plain round
# robin answers every call sent to the draining replica UNAVAILABLE until its connection closes
# (docs/operations.md#clients-and-rolling-updates).
SERVICE = "translation.v1.Translator"
CLIENT_SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": SERVICE},
        "methodConfig": [
            {
                "name": [{"service": SERVICE}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "0.5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }
)


def open_channel(
    address: str,
    tls_ca: Path | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    tls_server_name: str | None = None,
    service_config: str | None = None,
) -> grpc.Channel:
    """Plaintext unless a CA (TLS) or a client certificate and key (mutual TLS) is given; `service_config` is
    gRPC's JSON service config for the channel (CLIENT_SERVICE_CONFIG for translation calls; a health check
    goes without one, as client-side health checking would hide the status it asks for).

    `tls_server_name` is the name the server's certificate must carry when it is not the address's
    host: a health check on 127.0.0.1 of a server whose certificate names its public DNS name. Given
    alone it means TLS too, verified against the system's CA roots.
    """
    options = [("grpc.service_config", service_config)] if service_config else []
    if tls_ca is None and tls_cert is None and tls_server_name is None:
        return grpc.insecure_channel(address, options=options)
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(tls_ca), private_key=_read(tls_key), certificate_chain=_read(tls_cert)
    )
    options += [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def auth_metadata(token: str | None) -> Metadata:
    """Call metadata that carries `token` (none without one); works over plaintext and TLS alike."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def _read(path: Path | None) -> bytes | None:
    return None if path is None else path.read_bytes()
