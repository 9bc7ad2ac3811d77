"""The relay link's frames (station.relay_link): how a hop's messages are cut on a TCP or TLS stream.

A frame is a fixed header and a body:

    magic "WMRL" | version u8 | kind u8 | status u16 | body length u32 | seconds f64    (little-endian)

    HELLO   client -> station, once per connection: the body is the cluster token (empty without one)
    REQUEST client -> station: a ForwardRequest; `seconds` is the time left of the caller's own deadline
    REPLY   station -> client: a ForwardReply (to HELLO: empty, the token was accepted)
    ERROR   station -> client: `status` is the gRPC status code, the body its UTF-8 message

Nothing here knows the station: reading and writing frames, the status codes they carry, and the TLS contexts.
"""
from __future__ import annotations

import os
import socket
import ssl
import struct
import tempfile
import time

import grpc

from mesh.core.transport import StationTls

MAGIC = b"WMRL"
VERSION = 1
HELLO, REQUEST, REPLY, ERROR = 1, 2, 3, 4
HEADER = struct.Struct("<4sBBHId")
HANDSHAKE_TIMEOUT_S = 10.0  # a connection must finish TLS and say HELLO within this
CODES = {code.value[0]: code for code in grpc.StatusCode}  # a frame's status number -> its gRPC status


class LinkError(Exception):
    """A call over the link failed; `code` is the gRPC status it stands for."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: int, body: bytes = b"", *, status: int = 0, seconds: float = 0.0) -> bytes:
    """One frame as bytes (header and body joined: for the small ones)."""
    return HEADER.pack(MAGIC, VERSION, kind, status, len(body), seconds) + body


def send_frame(sock: socket.socket, kind: int, body: bytes, *, seconds: float = 0.0) -> None:
    """Send one frame; over plain TCP the header and the body go in one call without joining them (a MiB copy)."""
    head = HEADER.pack(MAGIC, VERSION, kind, 0, len(body), seconds)
    if isinstance(sock, ssl.SSLSocket):  # no scatter-gather through TLS
        sock.sendall(head + body)
        return
    sent = sock.sendmsg([head, body])
    if sent < len(head):
        sock.sendall(head[sent:])
        sent = len(head)
    if sent - len(head) < len(body):
        sock.sendall(memoryview(body)[sent - len(head):])


def recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytearray | None:
    """n bytes from `sock` (None: the peer closed before the first byte); TimeoutError past `deadline`."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    # a blocking plain socket waits in the kernel for the whole frame: one wake-up and one GIL round trip for a
    # MiB, not one per segment (TLS and timed sockets take what has come and loop)
    wait_all = socket.MSG_WAITALL if deadline is None and not isinstance(sock, ssl.SSLSocket) else 0
    while got < n:
        if deadline is not None:
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
        k = sock.recv_into(view[got:], n - got, wait_all)
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError(f"the peer closed the connection {got} bytes into a {n}-byte read")
        got += k
    return buf


def read_frame(sock: socket.socket, max_body: int, deadline: float | None = None
                ) -> tuple[int, int, float, bytearray] | None:
    """(kind, status, seconds, body) of the next frame, None at a clean end; LinkError for a frame not to be
    trusted (the connection cannot go on after it)."""
    head = recv_exact(sock, HEADER.size, deadline)
    if head is None:
        return None
    magic, version, kind, status, length, seconds = HEADER.unpack(head)
    if magic != MAGIC:
        raise LinkError(grpc.StatusCode.INVALID_ARGUMENT, f"relay link: not a relay-link frame (magic {bytes(magic)!r})")
    if version != VERSION:
        raise LinkError(grpc.StatusCode.INVALID_ARGUMENT, f"relay link: frame version {version}, this station "
                        f"speaks {VERSION}")
    if length > max_body:
        raise LinkError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"relay link: a {length}-byte frame is over the "
                        f"{max_body}-byte limit")
    body = recv_exact(sock, length, deadline) if length else bytearray()
    if body is None:
        raise ConnectionError("the peer closed the connection after a frame header")
    return kind, status, seconds, body


def pem_file(pem: bytes) -> str:
    """A private temporary file holding `pem` (ssl loads certificates and keys from files only)."""
    fd, path = tempfile.mkstemp(suffix=".pem")
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return path


def tls_context(tls: StationTls, *, server: bool) -> ssl.SSLContext:
    """The mutual-TLS context of one side of a link: this side's certificate and key, peers checked against the
    cluster CA (a station's certificate against `tls.server_name`, as gRPC checks it)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH,
                                     cadata=tls.ca.decode())
    cert, key = pem_file(tls.cert), pem_file(tls.key)
    try:
        ctx.load_cert_chain(cert, key)
    finally:
        os.unlink(cert)
        os.unlink(key)
    if server:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


