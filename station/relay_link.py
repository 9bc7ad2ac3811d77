"""The relay link: a relayed wave's hop from one station to the next as framed protobuf over a plain TCP
connection (TLS where the cluster has it), without gRPC's per-call machinery.

What a relayed hop carries is the same ForwardRequest / ForwardReply as a gRPC Forward call (station.proto,
tensors as raw bytes); only the carriage differs. On this project's 2-core machines a 1 MiB hop's median
latency in a chain of SIMULATED GPU stations falls from 2.4-4.0 ms as a gRPC call to 1.1-1.4 ms, and a relaying
station's CPU by about a third (`mesh bench scale --relay link|grpc`, alternated: bench/out/session23_ab.txt part 2),
which is what limits such a chain. gRPC stays for every call
from the orchestrator, for health and for a successor that offers no link (InfoReply.relay_port 0).

Its frames (HELLO with the token, REQUEST, REPLY, ERROR with a status code, SHM, REQUEST_SHM, ANNOUNCE, ROWS and
ROWS_SHM) are station.link_frames; the caller's side is station.relay_link_client. Where caller and station share a
host, a connection's rows go through a shared-memory segment the caller offers (station.link_shm), the messages
still over the socket. One connection carries one call at a time (a caller takes an idle connection of its pool or
opens one), so a reply always answers the connection's last request. A relaying station may announce its
successor's request before its own step and send the rows after it (ANNOUNCE, then ROWS): the successor decodes
the entries while the rows are computed, not in the moment when every station of a busy chain hands its wave on. A
several-step decode wave may open a steps session on a connection (STEPS, then STEP frames of rows alone, answered
STEP_REPLY: station.steps_session).
The station serves each connection on a thread of its own, at most `max_connections` at once. A frame that cannot
be trusted (bad magic or version, over the size limit, out of order) is answered with an ERROR and the connection
closed; a body that does not parse is answered with INVALID_ARGUMENT and the connection goes on; a wrong token gets
UNAUTHENTICATED and a close. Whatever a connection sends, the station goes on serving the others.
"""
from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from mesh.core.proto import station_pb2 as pb
from mesh.core.transport import StationTls, check_token
from station.interceptors import WireBytes
from station.link_frames import (ANNOUNCE, ANNOUNCES, ERROR, FEATURES, HANDSHAKE_TIMEOUT_S, HELLO, IN_SEGMENT, REPLY,
                                 REQUEST, REQUEST_SHM, ROWS, ROWS_SHM, SHM, STEP, STEP_INDEX, STEP_REPLY, STEP_SHM,
                                 STEPS, LinkError, RowsBuffer, frame, read_frame, send_frame, tls_context)
from station.link_shm import RowsSegment
from station.steps_session import OpenSteps, RefusedSession, Session

log = logging.getLogger(__name__)

# what the station answers a request with: its reply, or a status code and message (the request, the seconds left
# of its deadline, the bytes of its hidden rows where they came beside it, what `Prepare` made of an announced request)
Answer = Callable[[pb.ForwardRequest, Callable[[], float | None], bytearray | memoryview | None, object],
                  "pb.ForwardReply | tuple[grpc.StatusCode, str]"]
# what the station makes of an announced request before its rows come (its entries decoded; None: nothing, Answer
# then decodes it and names what is wrong)
Prepare = Callable[[pb.ForwardRequest], object]
STEP_KINDS = (STEP, STEP_SHM)


@dataclass(slots=True)
class _Announced:
    """An announced request waiting on its connection for its rows."""

    request: pb.ForwardRequest | None  # None: its body did not parse (answered INVALID_ARGUMENT after the rows)
    prepared: object
    body_bytes: int


class RelayLinkServer:
    """A station's relay-link listener: one thread accepting, one per open connection (at most
    `max_connections`), each answering REQUEST frames with `answer`."""

    def __init__(self, host: str, answer: Answer, *, token: str | None, tls: StationTls | None,
                 max_message_bytes: int, wire: WireBytes, max_connections: int = 32,
                 prepare: Prepare | None = None, open_steps: OpenSteps | None = None) -> None:
        """`answer(request, time_remaining, rows, prepared)`: the station's Forward; `prepare(request)`: its work on
        an announced request before the rows come (None: the station takes no announcements); `open_steps(request,
        seconds left)`: a steps session for a STEPS frame (station.steps_session; None, or no `prepare`: the station
        takes no sessions); `wire`: where request ("in") and reply ("out") bytes are counted, as the gRPC Forward
        counts them."""
        self._answer = answer
        self._prepare = prepare
        self._steps_opener = open_steps if prepare is not None else None
        self._token = check_token(token).encode() if token is not None else b""
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
        self.shm_requests = 0  # of them and of the session steps, those whose rows came through shared memory
        self.announced = 0  # of them, those announced before their rows (ANNOUNCE, then ROWS or ROWS_SHM)
        self.session_steps = 0  # steps answered inside steps sessions (STEP or STEP_SHM frames)
        threading.Thread(target=self._accept_loop, name="relay-link-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self._listener.accept()
            except OSError as err:
                if self._stopped:
                    return  # the listener was closed: stop()
                log.warning("relay link: accept failed (%s); retrying", err)  # e.g. out of file descriptors
                time.sleep(0.05)
                continue
            if not self._slots.acquire(blocking=False):
                self._refuse(conn, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"relay link: {self._max_connections} connections already open")
                continue
            threading.Thread(target=self._serve_connection, args=(conn,), name="relay-link", daemon=True).start()

    @staticmethod
    def _refuse(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
        try:
            conn.sendall(frame(ERROR, message.encode(), status=code.value[0]))
        except OSError:
            pass
        conn.close()

    def _serve_connection(self, raw: socket.socket) -> None:
        conn, segment, session = raw, None, None
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
            rows_buffer = RowsBuffer()  # one request at a time on a connection: its rows are done with by the next
            announced: _Announced | None = None  # an ANNOUNCE waiting for its rows (the only frame taken next)
            # `session`: the connection's steps session (Session), ended by a frame of another kind
            while not self._stopped:
                conn.settimeout(None)
                try:
                    got = read_frame(conn, self._max_body - (announced.body_bytes if announced else 0),
                                     rows_into=rows_buffer, segment=segment)
                except LinkError as err:
                    self._refuse(conn, err.code, str(err))
                    return
                if got is None:
                    return  # an announced request whose rows never came is dropped with its connection
                kind, _, seconds, body, rows = got
                if (problem := self._out_of_order(kind, rows, announced, session)) is not None:
                    self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, f"relay link: {problem}")
                    return
                if kind in STEP_KINDS:
                    with self._lock:
                        self.session_steps += 1
                        self.shm_requests += kind == STEP_SHM
                    session = self._step(conn, session, body, rows, seconds)
                    continue
                if session is not None:  # any other frame ends the session
                    session.close()
                    session = None
                if kind == STEPS:
                    self._wire.add("in", len(body))
                    session = self._session(body, seconds)
                elif kind == SHM:
                    segment = self._accept_segment(conn, body, segment)
                elif kind == ANNOUNCE:
                    announced = self._announce(body)  # parsed and prepared while its rows are computed
                else:
                    with self._lock:
                        self.requests += 1
                        self.shm_requests += kind in IN_SEGMENT
                        self.announced += announced is not None
                    self._reply(conn, body, rows, seconds, announced)
                    announced = None
        except (OSError, ValueError) as err:  # the peer went away, a TLS failure, a handshake timeout
            log.debug("relay link: connection ended: %s", err)
        except Exception:  # noqa: BLE001 - a bug costs this connection, never the station
            log.exception("relay link: connection failed unexpectedly")
        finally:
            with self._lock:
                self._open.discard(raw)
                self._open.discard(conn)
            if session is not None:
                session.close()
            if segment is not None:
                segment.close()
            conn.close()
            raw.close()
            self._slots.release()

    def _hello(self, conn: socket.socket) -> bool:
        """Read the HELLO frame and check its token; True when the connection may go on."""
        try:
            got = read_frame(conn, 4096, time.monotonic() + HANDSHAKE_TIMEOUT_S)
        except LinkError as err:
            self._refuse(conn, err.code, str(err))
            return False
        if got is None:
            return False
        kind, _, _, body, _ = got
        if kind != HELLO or not hmac.compare_digest(bytes(body), self._token):
            self._refuse(conn, grpc.StatusCode.UNAUTHENTICATED, "relay link: missing or wrong cluster token")
            return False
        features = FEATURES if self._steps_opener is not None else ANNOUNCES if self._prepare is not None else b""
        conn.sendall(frame(REPLY, features))
        return True

    def _accept_segment(self, conn: socket.socket, offer: bytearray, held: RowsSegment | None) -> RowsSegment | None:
        """Answer a client's shared-memory offer (station.link_shm): the segment mapped and REPLY, or the one held
        before and an ERROR naming why not (the connection goes on over TCP)."""
        try:
            if held is not None:
                raise ValueError("shared-memory offer: this connection already has a segment")
            segment = RowsSegment.attach(offer, self._max_body)
        except ValueError as err:
            conn.sendall(frame(ERROR, str(err).encode(errors="replace"),
                               status=grpc.StatusCode.FAILED_PRECONDITION.value[0]))
            return held
        conn.sendall(frame(REPLY))
        return segment

    def _out_of_order(self, kind: int, rows: bytearray | memoryview | None, announced: _Announced | None,
                      session: Session | None) -> str | None:
        """What is wrong with a frame of `kind` at this point of a connection (None: it may come now)."""
        if announced is not None:
            if kind not in (ROWS, ROWS_SHM):
                return f"frame kind {kind} where the announced request's rows were expected"
            return None
        if (kind == ANNOUNCE and self._prepare is not None) or (kind == STEPS and self._steps_opener is not None):
            return None if rows is None else f"a frame of kind {kind} carries no rows"
        if kind in STEP_KINDS:
            return None if session is not None else "a STEP frame outside a steps session"
        return None if kind in (SHM, REQUEST, REQUEST_SHM) else f"frame kind {kind} where a request was expected"

    def _session(self, body: bytearray, seconds: float) -> Session:
        """A STEPS frame's session (one that does not parse or check answers its first step with the error)."""
        try:
            request = pb.ForwardRequest.FromString(body)
        except DecodeError as err:
            return RefusedSession(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"steps: not a valid protobuf message: {type(err).__name__}: {err}")
        return self._steps_opener(request, seconds if seconds > 0 else None)

    def _step(self, conn: socket.socket, session: Session, body: bytearray, rows: bytearray | memoryview | None,
              seconds: float) -> Session | None:
        """Answer one STEP of `session`: STEP_REPLY (sent by the session, from the compute thread where the step
        answers at once), or an ERROR that ends the session (None then returned)."""
        self._wire.add("in", len(body) + (len(rows) if rows is not None else 0))
        deadline = time.monotonic() + seconds if seconds > 0 else None

        def send(answer: bytes) -> None:
            conn.sendall(frame(STEP_REPLY, answer))
            self._wire.add("out", len(answer))
        outcome = (session.step(STEP_INDEX.unpack(body)[0], rows,
                                lambda: None if deadline is None else deadline - time.monotonic(), send)
                   if len(body) == STEP_INDEX.size else
                   (grpc.StatusCode.INVALID_ARGUMENT, f"step: a {len(body)}-byte index, expected {STEP_INDEX.size}"))
        if outcome is not None:
            code, message = outcome
            conn.sendall(frame(ERROR, message.encode(errors="replace"), status=code.value[0]))
            session.close()
            return None
        session.ahead()
        return session

    def _announce(self, body: bytearray) -> _Announced:
        """An ANNOUNCE's request, parsed and prepared (a body that does not parse is answered once its rows come)."""
        try:
            request = pb.ForwardRequest.FromString(body)
        except DecodeError:
            return _Announced(None, None, len(body))
        return _Announced(request, self._prepare(request), len(body))

    def _reply(self, conn: socket.socket, body: bytearray, rows: bytearray | memoryview | None, seconds: float,
               announced: _Announced | None) -> None:
        """Answer one request on `conn`: a REQUEST (its body, the hidden rows' bytes where they came beside it), or
        the `announced` one whose rows came (the body their dtype and shape)."""
        self._wire.add("in", len(body) + (len(rows) if rows is not None else 0)
                       + (announced.body_bytes if announced else 0))
        try:
            if announced is None:
                request, prepared = pb.ForwardRequest.FromString(body), None
            elif announced.request is None:
                raise DecodeError("the announced request did not parse")
            else:
                request, prepared = announced.request, announced.prepared
                request.hidden.ParseFromString(body)  # the rows' dtype and shape, whatever the announcement held
        except DecodeError as err:
            conn.sendall(frame(ERROR, f"request: not a valid protobuf message: {type(err).__name__}: {err}".encode(),
                               status=grpc.StatusCode.INVALID_ARGUMENT.value[0]))
            return
        deadline = time.monotonic() + seconds if seconds > 0 else None
        outcome = self._answer(request, lambda: None if deadline is None else deadline - time.monotonic(), rows,
                               prepared)
        if isinstance(outcome, tuple):
            code, message = outcome
            conn.sendall(frame(ERROR, message.encode(errors="replace"), status=code.value[0]))
            return
        data = outcome.SerializeToString()
        self._wire.add("out", len(data))
        send_frame(conn, REPLY, data)

    def stop(self) -> None:
        """Close the listener and every open connection (callers see UNAVAILABLE)."""
        self._stopped = True
        try:  # a close alone leaves a thread blocked in accept() (Linux): it would hold this server, its station
            self._listener.shutdown(socket.SHUT_RDWR)  # and the station's KV for the life of the process
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for conn in list(self._open):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
