"""gRPC server reflection under both names clients ask for: `grpc.reflection.v1.ServerReflection` (grpcurl,
Postman and other current clients) and `grpc.reflection.v1alpha.ServerReflection` (older ones).

The two protos declare the same messages with the same field numbers, so grpcio-reflection's one servicer
answers both, its v1alpha messages read and sent as v1's. Where grpcio-reflection ships no v1 proto, a copy of
v1alpha's renamed to v1 is added to the descriptor pool, so that reflection describes its own v1 service too.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import suppress

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1 = "grpc.reflection.v1.ServerReflection"
V1ALPHA = reflection.SERVICE_NAME
V1_FILE = "grpc/reflection/v1/reflection.proto"


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection of `service_names` and of itself under both service names."""
    add_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer((*service_names, V1, V1ALPHA))  # type: ignore[attr-defined]
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    for name in (V1, V1ALPHA):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))


def add_v1_descriptor(pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Put the v1 reflection proto in `pool` (the default pool) unless a v1 descriptor is there already."""
    pool = pool or descriptor_pool.Default()
    with suppress(ImportError):  # a grpcio-reflection with a v1 proto: importing it registers its descriptor
        import grpc_reflection.v1.reflection_pb2  # type: ignore[import-not-found]  # noqa: F401
    try:
        pool.FindServiceByName(V1)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = V1_FILE, "grpc.reflection.v1"
    proto.ClearField("options")  # v1alpha's language packages
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # message fields; a scalar's must stay unset
                field.type_name = field.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    pool.AddSerializedFile(proto.SerializeToString())
