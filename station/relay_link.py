"""The relay link: a relayed wave's hop from one station to the next as framed protobuf over a plain TCP
connection (TLS where the cluster has it), without gRPC's per-call machinery.

What a relayed hop carries is the same ForwardRequest / ForwardReply as a gRPC Forward call (station.proto,
tensors as raw bytes); only the carriage differs. On this project's 2-core machines a 1 MiB gRPC call costs
its two ends ~0.9 ms of CPU and ~3 thread switches, the link ~0.5 ms and one wake-up per side
(bench/out/session23_ab.txt), which is what limits a chain of GPU-speed stations. gRPC stays for every call
from the orchestrator, for health and for a successor that offers no link (InfoReply.relay_port 0).

A frame is a fixed header and a body:

    magic "WMRL" | version u8 | kind u8 | status u16 | body length u32 | seconds f64    (little-endian)

    HELLO   client -> station, once per connection: the body is the cluster token (empty without one)
    REQUEST client -> station: a ForwardRequest; `seconds` is the time left of the caller's own deadline
    REPLY   station -> client: a ForwardReply (to HELLO: empty, the token was accepted)
    ERROR   station -> client: `status` is the gRPC status code, the body its UTF-8 message

One connection carries one call at a time (a caller takes an idle connection of its pool or opens one), so
a reply always answers the connection's last request. The station serves each connection on a thread of its
own, at most `max_connections` at once. A frame that cannot be trusted (bad magic or version, over the size
limit) is answered with an ERROR and the connection closed; a body that does not parse is answered with
INVALID_ARGUMENT and the connection goes on; a wrong token gets UNAUTHENTICATED and a close. Whatever a
connection sends, the station goes on serving the others.
"""
from __future__ import annotations

import hmac
import logging
import os
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from mesh.core.proto import station_pb2 as pb
from mesh.core.transport import StationTls, check_token
from station.interceptors import WireBytes

log = logging.getLogger(__name__)

MAGIC = b"WMRL"
VERSION = 1
HELLO, REQUEST, REPLY, ERROR = 1, 2, 3, 4
HEADER = struct.Struct("<4sBBHId")
HANDSHAKE_TIMEOUT_S = 10.0  # a connection must finish TLS and say HELLO within this
_CODES = {code.value[0]: code for code in grpc.StatusCode}

# what the station answers a request with: its reply, or a status code and message
Answer = Callable[[pb.ForwardRequest, Callable[[], float | None]], "pb.ForwardReply | tuple[grpc.StatusCode, str]"]


class LinkError(Exception):
    """A call over the link failed; `code` is the gRPC status it stands for."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _frame(kind: int, body: bytes = b"", *, status: int = 0, seconds: float = 0.0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, status, len(body), seconds) + body


def _send(sock: socket.socket, kind: int, body: bytes, *, seconds: float = 0.0) -> None:
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


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytearray | None:
    """n bytes from `sock` (None: the peer closed before the first byte); TimeoutError past `deadline`."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError(f"the peer closed the connection {got} bytes into a {n}-byte read")
        got += k
    return buf


def _read_frame(sock: socket.socket, max_body: int, deadline: float | None = None
                ) -> tuple[int, int, float, bytearray] | None:
    """(kind, status, seconds, body) of the next frame, None at a clean end; LinkError for a frame not to be
    trusted (the connection cannot go on after it)."""
    head = _recv_exact(sock, HEADER.size, deadline)
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
    body = _recv_exact(sock, length, deadline) if length else bytearray()
    if body is None:
        raise ConnectionError("the peer closed the connection after a frame header")
    return kind, status, seconds, body


def _pem_file(pem: bytes) -> str:
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
    cert, key = _pem_file(tls.cert), _pem_file(tls.key)
    try:
        ctx.load_cert_chain(cert, key)
    finally:
        os.unlink(cert)
        os.unlink(key)
    if server:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class RelayLinkServer:
    """A station's relay-link listener: one thread accepting, one per open connection (at most
    `max_connections`), each answering REQUEST frames with `answer`."""

    def __init__(self, host: str, answer: Answer, *, token: str | None, tls: StationTls | None,
                 max_message_bytes: int, wire: WireBytes, max_connections: int = 32) -> None:
        """`answer(request, time_remaining)`: the station's Forward; `wire`: where request ("in") and reply ("out")
        bytes are counted, as the gRPC Forward counts them."""
        self._answer = answer
        self._token = f"{check_token(token)}".encode() if token is not None else b""
        self._ssl = tls_context(tls, server=True) if tls is not None else None
        self._max_body = max_message_bytes
        self._wire = wire
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_connections = max_connections
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = self._listener.getsockname()[1]
        self._stopped = False
        self.requests = 0  # REQUEST frames received (read by tests and benchmarks)
        threading.Thread(target=self._accept_loop, name="relay-link-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed: stop()
            if not self._slots.acquire(blocking=False):
                self._refuse(conn, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"relay link: {self._max_connections} connections already open")
                continue
            threading.Thread(target=self._serve_connection, args=(conn,), name="relay-link", daemon=True).start()

    @staticmethod
    def _refuse(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
        try:
            conn.sendall(_frame(ERROR, message.encode(), status=code.value[0]))
        except OSError:
            pass
        conn.close()

    def _serve_connection(self, raw: socket.socket) -> None:
        conn = raw
        with self._lock:
            self._open.add(raw)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw.settimeout(HANDSHAKE_TIMEOUT_S)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(raw, server_side=True)  # `raw` is detached from its descriptor
                with self._lock:
                    self._open.discard(raw)
                    self._open.add(conn)
            if not self._hello(conn):
                return
            while not self._stopped:
                conn.settimeout(None)
                try:
                    frame = _read_frame(conn, self._max_body)
                except LinkError as err:
                    self._refuse(conn, err.code, str(err))
                    return
                if frame is None:
                    return
                kind, _, seconds, body = frame
                if kind != REQUEST:
                    self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, f"relay link: frame kind {kind} where a "
                                 "request was expected")
                    return
                self._reply(conn, body, seconds)
        except (OSError, ValueError) as err:  # the peer went away, a TLS failure, a handshake timeout
            log.debug("relay link: connection ended: %s", err)
        finally:
            with self._lock:
                self._open.discard(raw)
                self._open.discard(conn)
            conn.close()
            raw.close()
            self._slots.release()

    def _hello(self, conn: socket.socket) -> bool:
        """Read the HELLO frame and check its token; True when the connection may go on."""
        try:
            frame = _read_frame(conn, 4096, time.monotonic() + HANDSHAKE_TIMEOUT_S)
        except LinkError as err:
            self._refuse(conn, err.code, str(err))
            return False
        if frame is None:
            return False
        kind, _, _, body = frame
        if kind != HELLO or not hmac.compare_digest(bytes(body), self._token):
            self._refuse(conn, grpc.StatusCode.UNAUTHENTICATED, "relay link: missing or wrong cluster token")
            return False
        conn.sendall(_frame(REPLY))
        return True

    def _reply(self, conn: socket.socket, body: bytearray, seconds: float) -> None:
        """Answer one REQUEST body on `conn`."""
        self._wire.add("in", len(body))
        with self._lock:
            self.requests += 1
        try:
            request = pb.ForwardRequest.FromString(body)
        except DecodeError as err:
            conn.sendall(_frame(ERROR, f"request: not a valid protobuf message: {type(err).__name__}: {err}".encode(),
                                status=grpc.StatusCode.INVALID_ARGUMENT.value[0]))
            return
        deadline = time.monotonic() + seconds if seconds > 0 else None
        outcome = self._answer(request, lambda: None if deadline is None else deadline - time.monotonic())
        if isinstance(outcome, tuple):
            code, message = outcome
            conn.sendall(_frame(ERROR, message.encode(errors="replace"), status=code.value[0]))
            return
        data = outcome.SerializeToString()
        self._wire.add("out", len(data))
        _send(conn, REPLY, data)

    def stop(self) -> None:
        """Close the listener and every open connection (callers see UNAVAILABLE)."""
        self._stopped = True
        self._listener.close()
        with self._lock:
            for conn in list(self._open):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class RelayLinkClient:
    """Calls to one station's relay link, over a pool of connections (one call on each at a time)."""

    def __init__(self, host: str, port: int, *, token: str | None, tls: StationTls | None,
                 max_message_bytes: int, wire: WireBytes, max_idle: int = 8) -> None:
        """`wire`: where request ("out") and reply ("in") bytes are counted."""
        self.address = (host, port)
        self._hello = _frame(HELLO, token.encode() if token is not None else b"")
        self._ssl = tls_context(tls, server=False) if tls is not None else None
        self._server_name = tls.server_name if tls is not None else None
        self._max_body = max_message_bytes
        self._wire = wire
        self._max_idle = max_idle
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self, deadline: float) -> socket.socket:
        conn = socket.create_connection(self.address, timeout=max(1e-3, deadline - time.monotonic()))
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(conn, server_hostname=self._server_name)
            conn.sendall(self._hello)
            self._expect_reply(conn, deadline)
            return conn
        except BaseException:
            conn.close()
            raise

    def _expect_reply(self, conn: socket.socket, deadline: float) -> bytearray:
        frame = _read_frame(conn, self._max_body, deadline)
        if frame is None:
            raise ConnectionError("the station closed the connection without answering")
        kind, status, _, body = frame
        if kind == ERROR:
            raise LinkError(_CODES.get(status, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))
        if kind != REPLY:
            raise LinkError(grpc.StatusCode.INTERNAL, f"relay link: frame kind {kind} where a reply was expected")
        return body

    def forward(self, request: pb.ForwardRequest, timeout_s: float) -> pb.ForwardReply:
        """Send `request`, return the station's reply within `timeout_s`; LinkError with the status it stands for
        (UNAVAILABLE: the station cannot be reached or went away; DEADLINE_EXCEEDED: no answer in time)."""
        deadline = time.monotonic() + timeout_s
        data = request.SerializeToString()
        conn = None
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = self._connect(deadline)
            conn.settimeout(max(1e-3, deadline - time.monotonic()))
            _send(conn, REQUEST, data, seconds=max(1e-3, deadline - time.monotonic()))
            self._wire.add("out", len(data))
            body = self._expect_reply(conn, deadline)
            self._wire.add("in", len(body))
            reply = pb.ForwardReply.FromString(body)
        except LinkError:
            if conn is not None:
                conn.close()
            raise
        except (TimeoutError, socket.timeout):
            if conn is not None:
                conn.close()
            raise LinkError(grpc.StatusCode.DEADLINE_EXCEEDED, "relay link: no answer before the deadline") from None
        except (OSError, ValueError, DecodeError) as err:
            if conn is not None:
                conn.close()
            raise LinkError(grpc.StatusCode.UNAVAILABLE, f"relay link: {type(err).__name__}: {err}") from None
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                conn = None
        if conn is not None:
            conn.close()
        return reply

    def close(self) -> None:
        """Close the idle connections (a call in progress closes its own when it ends)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
