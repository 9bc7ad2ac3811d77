"""The station server's interceptors: the cluster token check and strict request parsing."""
from __future__ import annotations

import hmac
import threading
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from mesh.core.proto import station_pb2 as pb
from mesh.core.transport import check_token

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Station"].full_name  # "wavemesh.v1.Station"
OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # method prefixes served without the cluster token
FORWARD_METHOD = f"/{SERVICE_NAME}/Forward"
FORWARD_STEPS_METHOD = f"/{SERVICE_NAME}/ForwardSteps"  # Forward's several-step variant, its replies streamed
INFO_METHOD = f"/{SERVICE_NAME}/Info"


class WireBytes:
    """Forward message bytes by direction ("in", "out"), counted as the messages are parsed and serialized (the
    lengths gRPC handles: no second encoding to measure them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = {"in": 0, "out": 0}

    def add(self, direction: str, nbytes: int) -> None:
        """Count `nbytes` more in `direction`."""
        with self._lock:
            self._bytes[direction] += nbytes

    def totals(self) -> dict[str, int]:
        """The bytes so far, by direction."""
        with self._lock:
            return dict(self._bytes)

    def counting(self, parse: Callable[[bytes], object], serialize: Callable[[object], bytes], *, received: str,
                 sent: str) -> tuple[Callable[[bytes], object], Callable[[object], bytes]]:
        """`parse` and `serialize` counting what they read as `received` and what they write as `sent`."""
        def parse_counted(data: bytes) -> object:
            self.add(received, len(data))
            return parse(data)

        def serialize_counted(message: object) -> bytes:
            data = serialize(message)
            self.add(sent, len(data))
            return data

        return parse_counted, serialize_counted


def _rewrapped(handler, behavior, request_deserializer, response_serializer):
    """A method handler of `handler`'s kind (a unary or a reply-streaming call) with these parts."""
    make = (grpc.unary_stream_rpc_method_handler if handler.unary_stream is not None
            else grpc.unary_unary_rpc_method_handler)
    return make(behavior, request_deserializer=request_deserializer, response_serializer=response_serializer)


class CountForwardBytes(grpc.ServerInterceptor):
    """Count every Forward (and ForwardSteps) request's and reply's bytes into `wire` (requests "in", replies
    "out")."""

    def __init__(self, wire: WireBytes) -> None:
        self._wire = wire

    def intercept_service(self, continuation, handler_call_details):
        """Wrap Forward's request parser and reply serializer; other methods pass untouched."""
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in (FORWARD_METHOD, FORWARD_STEPS_METHOD):
            return handler
        behavior = handler.unary_unary or handler.unary_stream
        if behavior is None:
            return handler
        parse, serialize = self._wire.counting(handler.request_deserializer, handler.response_serializer,
                                               received="in", sent="out")
        return _rewrapped(handler, behavior, parse, serialize)


class TokenAuth(grpc.ServerInterceptor):
    """Refuse, with UNAUTHENTICATED, every call outside OPEN_SERVICES without `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {check_token(token)}".encode()

        def deny(request: bytes, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token "
                          "(metadata `authorization: Bearer <token>`)")

        def deny_stream(request: bytes, context: grpc.ServicerContext):
            deny(request, context)
            yield from ()

        self._deny = grpc.unary_unary_rpc_method_handler(deny)  # no deserializer: the request is never decoded
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    def intercept_service(self, continuation, handler_call_details):
        """Pass health checks and calls carrying the token; answer all others with the refusal."""
        if handler_call_details.method.startswith(OPEN_SERVICES):
            return continuation(handler_call_details)
        given = next((v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"), "")
        given = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given, self._expected):
            return continuation(handler_call_details)
        return self._deny_stream if handler_call_details.method == FORWARD_STEPS_METHOD else self._deny


class StrictDecode(grpc.ServerInterceptor):
    """Answer a request whose bytes do not parse with INVALID_ARGUMENT (gRPC's own answer is INTERNAL): the
    Station's methods and the open health check alike."""

    def intercept_service(self, continuation, handler_call_details):
        """Wrap the Station handlers taking one request so a parse failure reaches them as a refusal, not an
        exception."""
        handler = continuation(handler_call_details)
        if (handler is None or (handler.unary_unary is None and handler.unary_stream is None)
                or not handler_call_details.method.startswith((f"/{SERVICE_NAME}/", *OPEN_SERVICES))):
            return handler
        parse = handler.request_deserializer

        def safe_parse(data: bytes) -> object:
            try:
                return parse(data)
            except DecodeError as err:  # a bad varint or length, invalid UTF-8 in a string, ...
                return _Malformed(f"{type(err).__name__}: {err}")

        def refuse_malformed(request, context: grpc.ServicerContext) -> None:
            if isinstance(request, _Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid protobuf message: {request}")

        def guarded(request, context: grpc.ServicerContext):
            refuse_malformed(request, context)
            return handler.unary_unary(request, context)

        def guarded_stream(request, context: grpc.ServicerContext):
            refuse_malformed(request, context)
            yield from handler.unary_stream(request, context)

        behavior = guarded if handler.unary_unary is not None else guarded_stream
        return _rewrapped(handler, behavior, safe_parse, handler.response_serializer)


class _Malformed(str):
    """What StrictDecode hands on in place of a request that did not parse (the parser's message)."""
