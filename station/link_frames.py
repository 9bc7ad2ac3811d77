"""The relay link's frames (station.relay_link): how a hop's messages are cut on a TCP or TLS stream.

A frame is a fixed header and a body:

    magic "WMRL" | version u8 | kind u8 | status u16 | body length u32 | rows length u32 | seconds f64
    (little-endian), then the body, then the rows


    HELLO   client -> station, once per connection: the body is the cluster token (empty without one)
    REQUEST client -> station: a ForwardRequest; `seconds` is the time left of the caller's own deadline. Its
            hidden rows' bytes may follow the message as the frame's rows (the message's `hidden` then holds their
            dtype and shape, its data empty), so that neither side copies a MiB into and out of protobuf
    REPLY   station -> client: a ForwardReply (to HELLO: the token was accepted, the body FEATURES or empty)
    ERROR   station -> client: `status` is the gRPC status code, the body its UTF-8 message
    SHM     client -> station, at most once per connection after HELLO: the offer of a shared-memory segment
            (station.link_shm); REPLY accepts it, ERROR (FAILED_PRECONDITION) declines and the connection goes on
    REQUEST_SHM  as REQUEST, but its `rows length` bytes of rows are at the start of the accepted segment, not in
            the stream
    ANNOUNCE  client -> station: a ForwardRequest whose hidden rows are not computed yet (a relaying station sends it
            before its own step, so that its successor decodes the entries while that step runs); no answer until
    ROWS    client -> station, the next frame after an ANNOUNCE: its body the rows' dtype and shape (a Tensor message,
            data empty), the rows after it in the stream; `seconds` the time left now. The station answers the
            announced request as a REQUEST (REPLY or ERROR). A client whose step fails after its ANNOUNCE closes the
            connection instead: the station drops the announced request unanswered
    ROWS_SHM  as ROWS, the rows in the segment
    STEPS   client -> station: a ForwardRequest opening a steps session on the connection (station.steps_session): a
            several-step decode wave's entries as of its first step, its `steps` and the relay list after the
            station; no payload and no answer. It ends any session the connection had
    STEP    client -> station, inside a session: one step's hidden rows, the body the step's index (STEP_INDEX); the
            station derives the step's entries and answers STEP_REPLY (or ERROR, which ends the session)
    STEP_SHM  as STEP, the rows in the segment
    STEP_REPLY  station -> client: a step's answer (station.step_answers: KV and seconds of each station from the
            answering one on, the sampled token ids, the samples' message)

A station that knows ANNOUNCE and STEPS says so in its REPLY to HELLO, whose body lists what it speaks beyond REQUEST
(FEATURES, comma-separated); a client announces or opens sessions only where a station names them (an earlier
build's REPLY is empty or names ANNOUNCE alone).

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
from station.link_shm import RowsSegment

MAGIC = b"WMRL"
VERSION = 1
HELLO, REQUEST, REPLY, ERROR, SHM, REQUEST_SHM, ANNOUNCE, ROWS, ROWS_SHM = 1, 2, 3, 4, 5, 6, 7, 8, 9
STEPS, STEP, STEP_SHM, STEP_REPLY = 10, 11, 12, 13
IN_SEGMENT = (REQUEST_SHM, ROWS_SHM, STEP_SHM)  # the kinds whose rows are in the connection's segment, not the stream
ANNOUNCES, SESSIONS = b"announce", b"steps"  # what a station may speak beyond REQUEST
FEATURES = ANNOUNCES + b"," + SESSIONS  # a station's REPLY to HELLO
HEADER = struct.Struct("<4sBBHIId")
STEP_INDEX = struct.Struct("<I")  # a STEP frame's body: the step's index in its session
HANDSHAKE_TIMEOUT_S = 10.0  # a connection must finish TLS and say HELLO within this
CODES = {code.value[0]: code for code in grpc.StatusCode}  # a frame's status number -> its gRPC status


class LinkError(Exception):
    """A call over the link failed; `code` is the gRPC status it stands for."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: int, body: bytes = b"", *, status: int = 0, seconds: float = 0.0, rows_length: int = 0) -> bytes:
    """One frame without rows in the stream as bytes (header and body joined: for the small ones); `rows_length`:
    the rows a REQUEST_SHM or ROWS_SHM has in its segment."""
    return HEADER.pack(MAGIC, VERSION, kind, status, len(body), rows_length, seconds) + body


def send_frame(sock: socket.socket, kind: int, body: bytes, *, rows: memoryview | None = None,
               seconds: float = 0.0) -> None:
    """Send one frame (with `rows`, raw tensor bytes after the body); over plain TCP its parts go in one call
    without joining them (no MiB copy)."""
    rows = memoryview(b"") if rows is None else rows
    parts = [HEADER.pack(MAGIC, VERSION, kind, 0, len(body), rows.nbytes, seconds), body, rows]
    if isinstance(sock, ssl.SSLSocket):  # no scatter-gather through TLS
        sock.sendall(b"".join(parts))
        return
    sent = sock.sendmsg(parts)
    for part in parts:  # a partial send: the rest of each part in turn
        n = len(part) if not isinstance(part, memoryview) else part.nbytes
        if sent < n:
            sock.sendall(memoryview(part).cast("B")[sent:])
        sent = max(0, sent - n)


def recv_exact(sock: socket.socket, n: int, deadline: float | None, into: bytearray | None = None
               ) -> bytearray | memoryview | None:
    """n bytes from `sock` (None: the peer closed before the first byte); TimeoutError past `deadline`. With `into`
    (at least n bytes), they land in its first n bytes and a view of them is returned: no new MiB to allocate and
    fault in for each frame."""
    buf = bytearray(n) if into is None else memoryview(into)[:n]
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


def read_frame(sock: socket.socket, max_body: int, deadline: float | None = None, rows_into: RowsBuffer | None = None,
               segment: RowsSegment | None = None
               ) -> tuple[int, int, float, bytearray, bytearray | memoryview | None] | None:
    """(kind, status, seconds, body, rows or None) of the next frame, None at a clean end; LinkError for a frame
    not to be trusted (the connection cannot go on after it). `max_body` bounds the body and rows together.
    `rows_into`: the rows land in that buffer (a view of it returned, valid until its next frame); `segment`: the
    connection's accepted shared-memory segment, where a REQUEST_SHM's or ROWS_SHM's rows are (a view of them
    returned, valid until the connection answers them: station.link_shm)."""
    head = recv_exact(sock, HEADER.size, deadline)
    if head is None:
        return None
    magic, version, kind, status, length, rows_length, seconds = HEADER.unpack(head)
    if magic != MAGIC:
        raise LinkError(grpc.StatusCode.INVALID_ARGUMENT, f"relay link: not a relay-link frame (magic {bytes(magic)!r})")
    if version != VERSION:
        raise LinkError(grpc.StatusCode.INVALID_ARGUMENT, f"relay link: frame version {version}, this station "
                        f"speaks {VERSION}")
    if length + rows_length > max_body:
        raise LinkError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"relay link: a {length + rows_length}-byte frame is "
                        f"over the {max_body}-byte limit")
    if kind in IN_SEGMENT and (segment is None or rows_length > segment.size):
        raise LinkError(grpc.StatusCode.INVALID_ARGUMENT, f"relay link: {rows_length} bytes of rows in shared memory, "
                        "but this connection " + ("has no segment" if segment is None else
                                                  f"has a {segment.size}-byte segment"))
    body = recv_exact(sock, length, deadline) if length else bytearray()
    if kind in IN_SEGMENT:  # the rows are in the segment, not in the stream: read where they lie
        rows = segment.rows(rows_length)
    else:
        into = rows_into.take(rows_length) if rows_into is not None and rows_length else None
        rows = recv_exact(sock, rows_length, deadline, into) if rows_length else None
    if body is None or (rows_length and rows is None):
        raise ConnectionError("the peer closed the connection inside a frame")
    return kind, status, seconds, body, rows


class RowsBuffer:
    """One connection's buffer for the hidden rows of its frames, reused from frame to frame: a decode wave's MiB of
    rows then costs one copy out of the socket, not a fresh allocation whose pages fault in first (about 0.35 ms of
    a relaying SIMULATED station's CPU per step in the chain, bench/out/session26_ab.txt part 1). What is read into it is valid until the connection reads its
    next frame. Frames over `keep_bytes` (long prompt chunks, rare) get a buffer of their own, so that an idle
    connection never holds more than that."""

    def __init__(self, keep_bytes: int = 8 << 20) -> None:
        self._buf = bytearray()
        self._keep_bytes = keep_bytes

    def take(self, n: int) -> bytearray:
        """A buffer of at least n bytes: the kept one (grown up to `keep_bytes`), or a new one past that."""
        if n > self._keep_bytes:
            return bytearray(n)
        if len(self._buf) < n:
            self._buf = bytearray(n)
        return self._buf


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


