"""The client side of a relay link (station.relay_link): a station's calls to its successor's link, over a pool of
connections, each with a shared-memory segment for its rows where the successor shares this host (station.link_shm).
A call is one request and its answer (`forward`), a request announced before its rows exist (`announce`, then
`complete` with the rows or `abandon`), or a steps session over one connection (`open_steps`, then a StepsCall's
`step` for each decode step's rows).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from mesh.core.proto import station_pb2 as pb
from mesh.core.transport import StationTls
from station.interceptors import WireBytes
from station.link_frames import (ANNOUNCE, ANNOUNCES, CODES, ERROR, HELLO, REPLY, REQUEST, REQUEST_SHM, ROWS, ROWS_SHM,
                                 SESSIONS, SHM, STEP, STEP_INDEX, STEP_REPLY, STEP_SHM, STEPS, LinkError, frame,
                                 read_frame, send_frame, tls_context)
from station.link_shm import RowsSegment
from station.step_answers import StepAnswer, unpack_step_answer

IN_SEGMENT_KIND = {REQUEST: REQUEST_SHM, ROWS: ROWS_SHM, STEP: STEP_SHM}  # a frame's kind with its rows in the segment


def segment_space(segment: RowsSegment | None, nbytes: int) -> memoryview | None:
    """The first `nbytes` of a connection's segment where it has one and they fit, else None."""
    return segment.rows(nbytes) if segment is not None and nbytes <= segment.size else None


@dataclass(frozen=True, slots=True)
class Announced:
    """A request sent ahead of its rows (RelayLinkClient.announce): the client and connection it holds until they
    follow (`client.complete`, or `client.abandon`)."""

    client: RelayLinkClient
    conn: socket.socket
    segment: RowsSegment | None
    deadline: float  # time.monotonic() past which the answer is late
    sent_bytes: int  # the message's bytes, counted with the rows'

    def rows_space(self, nbytes: int) -> memoryview | None:
        """Where the request's `nbytes` of rows may be put before `complete`: the connection's shared-memory
        segment, where they fit (rows written there cross the hop without a copy into it); None: no such place."""
        return segment_space(self.segment, nbytes)


@dataclass(frozen=True, slots=True)
class StepsCall:
    """An open steps session (RelayLinkClient.open_steps): the connection it holds, its rows' segment, and what its
    answers are checked against. `client.send_step` sends each step and `client.step_answer` reads its answer;
    `client.finish` or `client.abandon` ends it."""

    client: RelayLinkClient
    conn: socket.socket
    segment: RowsSegment | None
    n_entries: int
    vocab_size: int

    def rows_space(self, nbytes: int) -> memoryview | None:
        """Where a step's `nbytes` of rows may be put before `client.send_step` (as Announced.rows_space)."""
        return segment_space(self.segment, nbytes)


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
        self._features: frozenset[bytes] = frozenset()  # what the station speaks beyond REQUEST (its REPLY to HELLO)

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
            self._features = frozenset(bytes(self._expect_reply(conn, deadline)).split(b","))
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

    def _expect_reply(self, conn: socket.socket, deadline: float, expected: int = REPLY) -> bytearray:
        got = read_frame(conn, self._max_body, deadline)
        if got is None:
            raise ConnectionError("the station closed the connection without answering")
        kind, status, _, body, _ = got
        if kind == ERROR:
            raise LinkError(CODES.get(status, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))
        if kind != expected:
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
            conn, segment = self._take(deadline)
            self._send(conn, segment, REQUEST, data, rows, deadline)
            return self._answer(conn, segment, deadline, len(data) + (rows.nbytes if rows is not None else 0))
        except (LinkError, OSError, ValueError, DecodeError) as err:
            raise self._failed(conn, segment, err) from None

    def announce(self, request: pb.ForwardRequest, timeout_s: float) -> Announced | None:
        """Send `request` now, its hidden rows later (`complete`, or `abandon` where they never come): for a station
        that announces its successor's message before its own step. None where this station does not take
        announcements (an earlier build); LinkError as `forward`."""
        led = self._lead(ANNOUNCES, ANNOUNCE, request, timeout_s)
        return None if led is None else Announced(self, *led)

    def _lead(self, feature: bytes, kind: int, request: pb.ForwardRequest, timeout_s: float
              ) -> tuple[socket.socket, RowsSegment | None, float, int] | None:
        """Send `request` as the first frame (`kind`: ANNOUNCE, STEPS) of an exchange on a connection it then holds,
        where the station speaks `feature`: (the connection, its segment, the deadline, the bytes sent); None where
        it does not; LinkError as `forward`."""
        deadline = time.monotonic() + timeout_s
        conn = segment = None
        try:
            conn, segment = self._take(deadline)
            if feature not in self._features:
                self._give_back(conn, segment)
                return None
            data = request.SerializeToString()
            conn.sendall(frame(kind, data, seconds=max(1e-3, deadline - time.monotonic())))
            return conn, segment, deadline, len(data)
        except (LinkError, OSError, ValueError) as err:
            raise self._failed(conn, segment, err) from None

    def complete(self, announced: Announced, header: pb.Tensor, rows: memoryview) -> pb.ForwardReply:
        """Send the rows of an announced request (`header`: their dtype and shape) and return the station's reply;
        LinkError as `forward`."""
        conn, segment, deadline = announced.conn, announced.segment, announced.deadline
        body = header.SerializeToString()
        try:
            self._send(conn, segment, ROWS, body, rows, deadline)
            return self._answer(conn, segment, deadline, announced.sent_bytes + len(body) + rows.nbytes)
        except (LinkError, OSError, ValueError, DecodeError) as err:
            raise self._failed(conn, segment, err) from None

    def open_steps(self, request: pb.ForwardRequest, timeout_s: float, *, n_entries: int, vocab_size: int
                   ) -> StepsCall | None:
        """Open a steps session for a several-step wave (`request`: its entries as of its first step, its steps, the
        relay list after the station; no payload), over one connection it holds until `finish` or `abandon`. None
        where the station takes no sessions (an earlier build); LinkError as `forward`."""
        led = self._lead(SESSIONS, STEPS, request, timeout_s)
        if led is None:
            return None
        conn, segment, _, sent = led
        self._wire.add("out", sent)
        return StepsCall(self, conn, segment, n_entries, vocab_size)

    def send_step(self, call: StepsCall, k: int, rows: memoryview, timeout_s: float) -> None:
        """Step `k` of an open session: its rows to the station (`step_answer` reads its answer); LinkError as
        `forward` (the session's connection closed after it)."""
        deadline = time.monotonic() + timeout_s
        conn, segment = call.conn, call.segment
        try:
            self._send(conn, segment, STEP, STEP_INDEX.pack(k), rows, deadline)
        except (LinkError, OSError, ValueError) as err:
            raise self._failed(conn, segment, err) from None
        self._wire.add("out", STEP_INDEX.size + rows.nbytes)

    def send_step_in_place(self, call: StepsCall, k: int, nbytes: int, timeout_s: float) -> None:
        """Step `k` of an open session whose `nbytes` of rows the step wrote into the session's segment already
        (`rows_space`): only the frame goes; LinkError as `send_step`."""
        seconds = max(1e-3, timeout_s)
        try:
            call.conn.sendall(frame(STEP_SHM, STEP_INDEX.pack(k), seconds=seconds, rows_length=nbytes))
        except OSError as err:
            raise self._failed(call.conn, call.segment, err) from None
        self._wire.add("out", STEP_INDEX.size + nbytes)

    def step_answer(self, call: StepsCall, timeout_s: float, meanwhile: Callable[[], object] | None = None
                    ) -> StepAnswer:
        """The answer to the step last sent in an open session (checked; `meanwhile()` runs first, while the
        station computes); LinkError as `forward`, WireError for an answer that does not check (the session's
        connection closed after either)."""
        deadline = time.monotonic() + timeout_s
        conn, segment = call.conn, call.segment
        try:
            if meanwhile is not None:
                meanwhile()
            body = self._expect_reply(conn, deadline, STEP_REPLY)
        except (LinkError, OSError, ValueError) as err:
            raise self._failed(conn, segment, err) from None
        self._wire.add("in", len(body))
        try:
            return unpack_step_answer(body, n_entries=call.n_entries, vocab_size=call.vocab_size)
        except ValueError:
            self._close(conn, segment)
            raise

    def abandon(self, announced: Announced | StepsCall) -> None:
        """The rows of an announced request, or a session's next step, will not come (this station's step failed):
        close its connection, so that the station drops the request."""
        self._close(announced.conn, announced.segment)

    def finish(self, call: StepsCall) -> None:
        """A session whose last answered step is its last: its connection back to the pool (the station ends the
        session at the connection's next frame)."""
        self._give_back(call.conn, call.segment)

    def _take(self, deadline: float) -> tuple[socket.socket, RowsSegment | None]:
        """An idle connection of the pool, or a new one."""
        with self._lock:
            conn, segment = self._idle.pop() if self._idle else (None, None)
        if conn is None:
            conn, segment = self._connect(deadline)
        conn.settimeout(max(1e-3, deadline - time.monotonic()))
        return conn, segment

    @staticmethod
    def _send(conn: socket.socket, segment: RowsSegment | None, kind: int, body: bytes, rows: memoryview | None,
              deadline: float) -> None:
        """Send a REQUEST, ROWS or STEP frame: its rows through the segment where they fit (REQUEST_SHM, ROWS_SHM,
        STEP_SHM; written there unless a step put them there already, `Announced.rows_space`), else in the stream."""
        seconds = max(1e-3, deadline - time.monotonic())
        if segment is not None and rows is not None and rows.nbytes <= segment.size:
            segment.write(rows)
            conn.sendall(frame(IN_SEGMENT_KIND[kind], body, seconds=seconds, rows_length=rows.nbytes))
        else:
            send_frame(conn, kind, body, rows=rows, seconds=seconds)

    def _answer(self, conn: socket.socket, segment: RowsSegment | None, deadline: float, sent_bytes: int
                ) -> pb.ForwardReply:
        """The station's answer to the request just sent; the connection back to the pool."""
        self._wire.add("out", sent_bytes)
        body = self._expect_reply(conn, deadline)
        self._wire.add("in", len(body))
        reply = pb.ForwardReply.FromString(body)
        self._give_back(conn, segment)
        return reply

    def _give_back(self, conn: socket.socket, segment: RowsSegment | None) -> None:
        """Keep a connection whose exchange is over for the next call (closed past `max_idle`)."""
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append((conn, segment))
                return
        self._close(conn, segment)

    def _close(self, conn: socket.socket, segment: RowsSegment | None) -> None:
        conn.close()
        if segment is not None:
            segment.close()

    def _failed(self, conn: socket.socket | None, segment: RowsSegment | None, err: Exception) -> LinkError:
        """Close a connection that cannot be trusted after `err` and say what the failure stands for."""
        if conn is not None:
            self._close(conn, segment)
        if isinstance(err, LinkError):
            return err
        if isinstance(err, TimeoutError):  # socket.timeout is TimeoutError
            return LinkError(grpc.StatusCode.DEADLINE_EXCEEDED, "relay link: no answer before the deadline")
        return LinkError(grpc.StatusCode.UNAVAILABLE, f"relay link: {type(err).__name__}: {err}")

    def close(self) -> None:
        """Close the idle connections (a call in progress closes its own when it ends)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn, segment in idle:
            self._close(conn, segment)
