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


class CountForwardBytes(grpc.ServerInterceptor):
    """Count every Forward request's and reply's bytes into `wire` (requests "in", replies "out")."""

    def __init__(self, wire: WireBytes) -> None:
        self._wire = wire

    def intercept_service(self, continuation, handler_call_details):
        """Wrap Forward's request parser and reply serializer; other methods pass untouched."""
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None or handler_call_details.method != FORWARD_METHOD:
            return handler
        parse, serialize = self._wire.counting(handler.request_deserializer, handler.response_serializer,
                                               received="in", sent="out")
        return grpc.unary_unary_rpc_method_handler(handler.unary_unary, request_deserializer=parse,
                                                   response_serializer=serialize)


class TokenAuth(grpc.ServerInterceptor):
    """Refuse, with UNAUTHENTICATED, every call outside OPEN_SERVICES without `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {check_token(token)}".encode()

        def deny(request: bytes, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token "
                          "(metadata `authorization: Bearer <token>`)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)  # no deserializer: the request is never decoded

    def intercept_service(self, continuation, handler_call_details):
        """Pass health checks and calls carrying the token; answer all others with the refusal."""
        if handler_call_details.method.startswith(OPEN_SERVICES):
            return continuation(handler_call_details)
        given = next((v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"), "")
        given = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given, self._expected):
            return continuation(handler_call_details)
        return self._deny


class StrictDecode(grpc.ServerInterceptor):
    """Answer a request whose bytes do not parse with INVALID_ARGUMENT (gRPC's own answer is INTERNAL): the
    Station's methods and the open health check alike."""

    def intercept_service(self, continuation, handler_call_details):
        """Wrap the unary Station handlers so a parse failure reaches them as a refusal, not an exception."""
        handler = continuation(handler_call_details)
        if (handler is None or handler.unary_unary is None
                or not handler_call_details.method.startswith((f"/{SERVICE_NAME}/", *OPEN_SERVICES))):
            return handler
        parse, behavior = handler.request_deserializer, handler.unary_unary

        def safe_parse(data: bytes) -> object:
            try:
                return parse(data)
            except DecodeError as err:  # a bad varint or length, invalid UTF-8 in a string, ...
                return _Malformed(f"{type(err).__name__}: {err}")

        def guarded(request, context: grpc.ServicerContext):
            if isinstance(request, _Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid protobuf message: {request}")
            return behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(guarded, request_deserializer=safe_parse,
                                                   response_serializer=handler.response_serializer)


class _Malformed(str):
    """What StrictDecode hands on in place of a request that did not parse (the parser's message)."""
