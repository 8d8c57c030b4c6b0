"""What happens to a call before a servicer sees it: authentication, then parsing the request.

- `AuthInterceptor` (only with a configured token): every call but health checks must carry
  `authorization: Bearer <token>`; any other is answered UNAUTHENTICATED before its request is parsed.
- `ParseInterceptor`: grpc answers a request that fails to deserialize with UNKNOWN and the parser's
  exception text; parsing it in the handler instead gives INVALID_ARGUMENT with a fixed message.

Both count what they refuse of the Translator's calls in the request metrics, like `server.edge.errors`
does for the servicer's own refusals, so the counters add up to what clients saw.
"""

from __future__ import annotations

import contextlib
import hmac
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from server.edge.errors import MALFORMED_MESSAGE, UNAUTHENTICATED_MESSAGE, CallRecord, request_id_metadata
from server.edge.logs import log_call, request_id
from server.edge.metrics import Metrics
from server.proto.translation.v1 import translation_pb2 as pb

TRANSLATOR = pb.DESCRIPTOR.services_by_name["Translator"].full_name
HEALTH = "grpc.health.v1.Health"  # probes (Docker, Kubernetes) carry no token
if TYPE_CHECKING:  # grpc's classes are generic only in the stubs
    Handler = grpc.RpcMethodHandler[Any, Any]
    Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    Handler = grpc.RpcMethodHandler
    Interceptor = grpc.aio.ServerInterceptor
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[Handler]]
_FACTORIES = {  # (request streaming, response streaming) -> handler factory
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _service_and_method(path: str) -> tuple[str, str]:
    """ "/translation.v1.Translator/Translate" -> ("translation.v1.Translator", "Translate")."""
    service, _, method = path.lstrip("/").partition("/")
    return service, method


def _count_refusal(
    metrics: Metrics | None, path: str, code: grpc.StatusCode, message: str, metadata: Iterable[tuple[str, Any]] | None
) -> tuple[tuple[str, str], ...]:
    """A call refused here: counted (the Translator's) as the servicer's refusals are, and written to the access log
    as every call is, so that a wrong token or a malformed message shows up there too. Returns the trailing
    metadata that tells the client the call's request id, as every other answer does."""
    service, method = _service_and_method(path)
    call = CallRecord(request_id=request_id(metadata))
    log_call(call.access_record(method, code, 0.0, message))
    if metrics is not None and service == TRANSLATOR:
        metrics.observe_request(method, code.name, "", 0.0)
    return request_id_metadata(call)


def _refusing(handler: Handler, code: grpc.StatusCode, message: str, trailing: tuple[tuple[str, str], ...]) -> Handler:
    """A handler of the same kind that answers `code` without reading the request."""

    async def refuse(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(code, message, trailing)

    factory = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return factory(refuse, request_deserializer=None, response_serializer=handler.response_serializer)


class AuthInterceptor(Interceptor):
    """Bearer-token check, in constant time; health checks are exempt."""

    def __init__(self, token: str, metrics: Metrics | None = None, exempt: Sequence[str] = (HEALTH,)) -> None:
        if not token:
            raise ValueError("the auth token must not be empty")
        self._token = token.encode()
        self._metrics = metrics
        self._exempt = frozenset(exempt)

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler:
        handler = await continuation(details)
        path = details.method
        if handler is None or _service_and_method(path)[0] in self._exempt:
            return handler
        if self.authorized(details.invocation_metadata):
            return handler
        code, metadata = grpc.StatusCode.UNAUTHENTICATED, details.invocation_metadata
        trailing = _count_refusal(self._metrics, path, code, UNAUTHENTICATED_MESSAGE, metadata)
        return _refusing(handler, code, UNAUTHENTICATED_MESSAGE, trailing)

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        values = [value for key, value in metadata or () if key == "authorization"]
        if len(values) != 1:
            return False
        value = values[0].encode() if isinstance(values[0], str) else values[0]
        scheme, _, token = value.partition(b" ")
        # compare_digest: the time taken does not tell how much of a guess was right
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._token)


class ParseInterceptor(Interceptor):
    """Deserialize single-message requests inside the handler, so a malformed one is INVALID_ARGUMENT."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self._metrics = metrics

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler  # streamed requests (reflection) keep grpc's own parsing
        return self._parsing(handler, details.method)

    def _parsing(self, handler: Handler, path: str) -> Handler:
        parse = handler.request_deserializer
        assert parse is not None, "checked by the caller"

        async def parsed(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            try:
                return parse(raw)
            except Exception:  # protobuf's DecodeError: bad wire format, or bad UTF-8 in a string field
                code, metadata = grpc.StatusCode.INVALID_ARGUMENT, context.invocation_metadata()
                trailing = _count_refusal(self._metrics, path, code, MALFORMED_MESSAGE, metadata)
                await context.abort(code, MALFORMED_MESSAGE, trailing)

        serialize = handler.response_serializer
        if not handler.response_streaming:
            unary: Any = handler.unary_unary

            async def unary_behavior(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                return await unary(await parsed(raw, context), context)

            return grpc.unary_unary_rpc_method_handler(unary_behavior, None, serialize)
        stream: Any = handler.unary_stream
        if not inspect.isasyncgenfunction(stream):  # writes with context.write (the health Watch)

            async def writing_behavior(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> None:
                await stream(await parsed(raw, context), context)

            return grpc.unary_stream_rpc_method_handler(writing_behavior, None, serialize)

        async def stream_behavior(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            # aclosing: closing this generator (the client went away) closes the servicer's now, freeing its slots
            async with contextlib.aclosing(stream(await parsed(raw, context), context)) as responses:
                async for response in responses:
                    yield response

        return grpc.unary_stream_rpc_method_handler(stream_behavior, None, serialize)
