"""gRPC reflection answers under both service names clients ask for, v1 and v1alpha, and lists the service."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from server.edge.server import SERVICE_NAME
from tests.serving import fake_model, running_server

# The two protos' messages have the same fields and numbers: v1alpha's classes read and write v1's messages.
REFLECTION_SERVICES = ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"]


def ask(channel: grpc.Channel, service: str, request: reflection_pb2.ServerReflectionRequest) -> object:
    call = channel.stream_stream(
        f"/{service}/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    (response,) = list(call(iter([request]), timeout=30))
    return response


@pytest.mark.parametrize("service", REFLECTION_SERVICES)
def test_reflection_v1_and_v1alpha_list_the_translator_and_describe_it(tiny_model_dir: Path, service: str) -> None:
    """Broken once on purpose (v1alpha alone, as grpcio-reflection registers it), v1 answered UNIMPLEMENTED."""
    with running_server(fake_model(tiny_model_dir)) as served:
        listed = ask(served.channel, service, reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in listed.list_services_response.service}  # type: ignore[attr-defined]
        described = {
            name: ask(served.channel, service, reflection_pb2.ServerReflectionRequest(file_containing_symbol=name))
            for name in (SERVICE_NAME, service)
        }
    assert {SERVICE_NAME, "grpc.health.v1.Health", *REFLECTION_SERVICES} <= names
    for name, answer in described.items():  # each listed service, reflection's own included, can be described
        assert answer.HasField("file_descriptor_response"), (name, answer)  # type: ignore[attr-defined]
