"""The client side of a relay link (station.relay_link): a station's calls to its successor's link, over a pool of
connections, each with a shared-memory segment for its rows where the successor shares this host (station.link_shm).
"""
from __future__ import annotations

import os
import socket
import threading
import time

import grpc
from google.protobuf.message import DecodeError

from mesh.core.proto import station_pb2 as pb
from mesh.core.transport import StationTls
from station.interceptors import WireBytes
from station.link_frames import (CODES, ERROR, HELLO, REPLY, REQUEST, REQUEST_SHM, SHM, LinkError, frame, read_frame,
                                 send_frame, tls_context)
from station.link_shm import RowsSegment


class RelayLinkClient:
    """Calls to one station's relay link, over a pool of connections (one call on each at a time)."""

    def __init__(self, host: str, port: int, *, token: str | None, tls: StationTls | None,
                 max_message_bytes: int, wire: WireBytes, max_idle: int = 8, shm_bytes: int = 0) -> None:
        """`wire`: where request ("out") and reply ("in") bytes are counted; `shm_bytes`: offer each connection a
        shared-memory segment of this size for its rows (station.link_shm; 0: never), taken where the station
        shares this host."""
        self.address = (host, port)
        self._hello = frame(HELLO, token.encode() if token is not None else b"")
        self._ssl = tls_context(tls, server=False) if tls is not None else None
        self._server_name = tls.server_name if tls is not None else None
        self._max_body = max_message_bytes
        self._wire = wire
        self._max_idle = max_idle
        self._shm_bytes = min(shm_bytes, max_message_bytes)
        self._idle: list[tuple[socket.socket, RowsSegment | None]] = []
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self, deadline: float) -> tuple[socket.socket, RowsSegment | None]:
        """A new connection, past HELLO, and the shared-memory segment its station accepted (None: rows by TCP)."""
        conn = self._open(deadline)
        try:
            return conn, self._offer_segment(conn, deadline)
        except ConnectionError:  # a station that hung up on the offer (it knows no such frame): never offer again
            conn.close()
            self._shm_bytes = 0
            return self._open(deadline), None
        except BaseException:
            conn.close()
            raise

    def _open(self, deadline: float) -> socket.socket:
        """A new connection whose HELLO the station accepted."""
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

    def _offer_segment(self, conn: socket.socket, deadline: float) -> RowsSegment | None:
        """Offer the station a new segment: it where accepted (the station shares this host), else None, and after
        a refusal (another host) no offer again; ConnectionError where the station hung up on the offer."""
        made = RowsSegment.create(self._shm_bytes) if self._shm_bytes else None
        if made is None:
            return None
        segment, offer, path = made
        try:
            conn.sendall(frame(SHM, offer))
            self._expect_reply(conn, deadline)
            return segment
        except LinkError as err:
            segment.close()
            self._shm_bytes = 0
            if err.code != grpc.StatusCode.FAILED_PRECONDITION:  # not a refusal: the station closes the connection
                raise ConnectionError(f"relay link: the station answered a shared-memory offer with {err}") from None
            return None
        except BaseException:
            segment.close()
            raise
        finally:
            try:
                os.unlink(path)
            except OSError:  # already gone: nothing to leave behind
                pass

    def _expect_reply(self, conn: socket.socket, deadline: float) -> bytearray:
        got = read_frame(conn, self._max_body, deadline)
        if got is None:
            raise ConnectionError("the station closed the connection without answering")
        kind, status, _, body, _ = got
        if kind == ERROR:
            raise LinkError(CODES.get(status, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))
        if kind != REPLY:
            raise LinkError(grpc.StatusCode.INTERNAL, f"relay link: frame kind {kind} where a reply was expected")
        return body

    def forward(self, request: pb.ForwardRequest, timeout_s: float, rows: memoryview | None = None
                ) -> pb.ForwardReply:
        """Send `request` (with `rows`: its hidden rows' bytes, sent beside it, `request.hidden` holding their dtype
        and shape), return the station's reply within `timeout_s`; LinkError with the status it stands for
        (UNAVAILABLE: the station cannot be reached or went away; DEADLINE_EXCEEDED: no answer in time)."""
        deadline = time.monotonic() + timeout_s
        data = request.SerializeToString()
        conn = segment = None
        try:
            with self._lock:
                conn, segment = self._idle.pop() if self._idle else (None, None)
            if conn is None:
                conn, segment = self._connect(deadline)
            conn.settimeout(max(1e-3, deadline - time.monotonic()))
            seconds = max(1e-3, deadline - time.monotonic())
            if segment is not None and rows is not None and rows.nbytes <= segment.size:
                segment.write(rows)
                conn.sendall(frame(REQUEST_SHM, data, seconds=seconds, rows_length=rows.nbytes))
            else:
                send_frame(conn, REQUEST, data, rows=rows, seconds=seconds)
            self._wire.add("out", len(data) + (rows.nbytes if rows is not None else 0))
            body = self._expect_reply(conn, deadline)
            self._wire.add("in", len(body))
            reply = pb.ForwardReply.FromString(body)
        except (LinkError, OSError, ValueError, DecodeError) as err:  # the connection cannot be trusted after it
            if conn is not None:
                conn.close()
            if segment is not None:
                segment.close()
            if isinstance(err, LinkError):
                raise
            if isinstance(err, TimeoutError):  # socket.timeout is TimeoutError
                raise LinkError(grpc.StatusCode.DEADLINE_EXCEEDED, "relay link: no answer before the deadline") from None
            raise LinkError(grpc.StatusCode.UNAVAILABLE, f"relay link: {type(err).__name__}: {err}") from None
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append((conn, segment))
                conn = None
        if conn is not None:
            conn.close()
            if segment is not None:
                segment.close()
        return reply

    def close(self) -> None:
        """Close the idle connections (a call in progress closes its own when it ends)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn, segment in idle:
            conn.close()
            if segment is not None:
                segment.close()
