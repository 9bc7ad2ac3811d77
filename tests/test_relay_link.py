"""The relay link (station/relay_link.py): relayed hops travel station to station as framed protobuf over TCP with
the same tokens as gRPC relays; it checks the token and mTLS; a bad frame gets a clear error and the station goes
on serving; a late answer is a deadline, a gone station UNAVAILABLE."""
from __future__ import annotations

import gc
import os
import random
import socket
import struct
import threading
import time
import weakref

import grpc
import pytest
import torch

from mesh.core.config import StationSpec
from mesh.core.params import SamplingParams
from mesh.core.proto import station_pb2 as pb
from mesh.core.transport import StationTls
from mesh.core.wave import WaveEntry
from mesh.core.wire import entries_to_proto
from mesh.core.wire_tensor import tensor_to_proto
from station.interceptors import WireBytes
from station.link_frames import (ERROR, HEADER, HELLO, MAGIC, REPLY, REQUEST, VERSION, LinkError, RowsBuffer, read_frame,
                                 send_frame)
from station.link_shm import SHM_DIR
from station.relay_link_client import RelayLinkClient
from station.server import start_server
from station.step import Station

from test_relay import CHAINS, TOKEN, _run, pki_files, reference  # noqa: F401 - fixtures

LIMIT = 64 << 20
# where stations of one host can share rows through a segment (station/link_shm.py); elsewhere their links go by TCP
SHM_OK = os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) and hasattr(os, "posix_fallocate")


@pytest.fixture(scope="module")
def last_station(tiny_llama):
    """The second station of a 2-station chain, its relay link on, with the cluster token."""
    server = start_server(Station(tiny_llama, StationSpec(layers=CHAINS[2][1])), token=TOKEN)
    yield server
    server.stop(0)


def _request(seq_id: int, hidden_size: int, rows: int = 2) -> pb.ForwardRequest:
    """A valid wave for the last station: one entry of `rows` prompt rows that samples."""
    request = pb.ForwardRequest(wave_id=seq_id, entries=entries_to_proto((WaveEntry(seq_id, 0, rows, SamplingParams()),)))
    tensor_to_proto(torch.randn(rows, hidden_size), into=request.hidden)
    return request


def _frame(kind: int, body: bytes = b"", *, rows: bytes = b"", magic: bytes = MAGIC, version: int = VERSION,
           length: int | None = None, seconds: float = 30.0) -> bytes:
    return HEADER.pack(magic, version, kind, 0, len(body) if length is None else length, len(rows), seconds) + body + rows


def _read(sock: socket.socket) -> tuple[int, int, bytes]:
    """(kind, status, body) of the next frame; (0, 0, b"") once the station closed the connection."""
    head = b""
    while len(head) < HEADER.size:
        chunk = sock.recv(HEADER.size - len(head))
        if not chunk:
            return 0, 0, b""
        head += chunk
    magic, version, kind, status, length, rows, _ = HEADER.unpack(head)
    assert rows == 0  # a station's answers carry no rows beside them
    assert (magic, version) == (MAGIC, VERSION)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return kind, status, body


def _connect(server, hello: bytes | None = TOKEN.encode()) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.relay_link.port), timeout=10)
    if hello is not None:
        sock.sendall(_frame(HELLO, hello))
    return sock


def _closed(sock: socket.socket) -> bool:
    """True when the station closed the connection (a reset too: it hung up on bytes it did not read)."""
    try:
        return _read(sock)[0] == 0
    except ConnectionResetError:
        return True


def test_direct_hops_travel_on_the_link_with_grpc_relays_tokens(tiny_llama, reference):
    """Two and three stations: relayed over links (the default) and as gRPC calls, the tokens are one station's;
    the links carried every relayed hop, and the stations without links have none."""
    prompts, params, ref = reference
    for ranges in CHAINS.values():
        linked = [start_server(Station(tiny_llama, StationSpec(layers=r)), token=TOKEN) for r in ranges]
        plain = [start_server(Station(tiny_llama, StationSpec(layers=r)), token=TOKEN, relay_link=False)
                 for r in ranges]
        try:
            assert _run(tiny_llama, linked, "direct", prompts, params)[0] == ref
            assert _run(tiny_llama, plain, "direct", prompts, params)[0] == ref
            assert linked[0].relay_link.requests == 0  # the orchestrator's calls stay gRPC
            assert all(0 < s.relay_link.requests == s.relay_link.announced for s in linked[1:])  # each announced
            assert all(s.relay_link is None for s in plain)
        finally:
            for s in linked + plain:
                s.stop(0)


def test_a_chain_mixing_stations_with_and_without_links_relays_over_grpc_where_it_must(tiny_llama, reference):
    """A station whose successor offers no link (InfoReply.relay_port 0) relays to it as a gRPC call; a station
    started without links relays over gRPC even to one that has a link: same tokens, no link request anywhere."""
    prompts, params, ref = reference
    ranges = CHAINS[3]
    servers = [start_server(Station(tiny_llama, StationSpec(layers=r)), token=TOKEN, relay_link=(i != 1))
               for i, r in enumerate(ranges)]
    try:
        assert _run(tiny_llama, servers, "direct", prompts[:4], params[:4])[0] == ref[:4]
        assert servers[1].relay_link is None and servers[2].relay_link.requests == 0
        assert servers[1].servicer.wire_bytes["in"] > 0 and servers[2].servicer.wire_bytes["in"] > 0
    finally:
        for s in servers:
            s.stop(0)


def test_bad_frames_get_a_named_error_and_the_station_goes_on(tiny_llama, last_station):
    hidden = last_station.servicer.station.config.hidden_size
    station = last_station.servicer.station
    cases = [  # (what is sent after the connection opens, the status, words of the message)
        (_frame(HELLO, b"not-the-token"), grpc.StatusCode.UNAUTHENTICATED, "wrong cluster token"),
        (_frame(REQUEST, b"x"), grpc.StatusCode.UNAUTHENTICATED, "cluster token"),  # no HELLO first
        (_frame(HELLO, TOKEN.encode(), magic=b"HTTP"), grpc.StatusCode.INVALID_ARGUMENT, "not a relay-link frame"),
        (_frame(HELLO, TOKEN.encode(), version=9), grpc.StatusCode.INVALID_ARGUMENT, "frame version 9"),
    ]
    for data, code, words in cases:
        with _connect(last_station, hello=None) as sock:
            sock.sendall(data)
            kind, status, body = _read(sock)
            assert (kind, status) == (ERROR, code.value[0]) and words in body.decode(), body
            assert _closed(sock)
    with _connect(last_station) as sock:
        assert _read(sock)[:2] == (REPLY, 0)  # the token was accepted
        sock.sendall(_frame(REQUEST, length=LIMIT * 4))  # over the size limit: refused before it is read
        kind, status, body = _read(sock)
        assert (kind, status) == (ERROR, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]) and b"over the" in body
        assert _closed(sock)
    with _connect(last_station) as sock:
        assert _read(sock)[0] == REPLY
        sock.sendall(_frame(REQUEST, b"\xff\xff\xff"))  # not a protobuf message: refused, the connection goes on
        kind, status, body = _read(sock)
        assert (kind, status) == (ERROR, grpc.StatusCode.INVALID_ARGUMENT.value[0]) and b"not a valid protobuf" in body
        wrong = _request(901, hidden + 1)  # rows of the wrong width: the station's own validation answers
        sock.sendall(_frame(REQUEST, wrong.SerializeToString()))
        kind, status, body = _read(sock)
        assert (kind, status) == (ERROR, grpc.StatusCode.INVALID_ARGUMENT.value[0]) and b"hidden" in body, body
        sock.sendall(_frame(REQUEST, _request(902, hidden).SerializeToString()))
        kind, status, body = _read(sock)
        assert (kind, status) == (REPLY, 0) and len(pb.ForwardReply.FromString(body).samples.samples) == 1
        beside = _request(909, hidden)  # the rows' bytes after the message, its hidden holding dtype and shape
        rows, beside.hidden.data = beside.hidden.data, b""
        for request, extra, words in (
                (_request(910, hidden), rows, b"both in the message and beside it"),
                (beside, rows[:-4], b"bytes, but shape"),
                (pb.ForwardRequest(entries=beside.entries, token_ids=pb.TokenIds(ids=[1, 2])), rows, b"beside the message")):
            sock.sendall(_frame(REQUEST, request.SerializeToString(), rows=extra))
            kind, status, body = _read(sock)
            assert (kind, status) == (ERROR, grpc.StatusCode.INVALID_ARGUMENT.value[0]) and words in body, body
        sock.sendall(_frame(REQUEST, beside.SerializeToString(), rows=rows))
        kind, status, body = _read(sock)
        assert (kind, status) == (REPLY, 0) and len(pb.ForwardReply.FromString(body).samples.samples) == 1
    station.release([902, 909])
    rng = random.Random(23)
    for _ in range(24):  # random bytes after a good HELLO, then a hang-up: never a crash
        with _connect(last_station) as sock:
            _read(sock)
            sock.sendall(rng.randbytes(rng.randrange(1, 64)))
    client = RelayLinkClient("127.0.0.1", last_station.relay_link.port, token=TOKEN, tls=None,
                             max_message_bytes=LIMIT, wire=WireBytes())
    try:  # the station still answers, over the link and over gRPC
        assert len(client.forward(_request(903, hidden), 30).samples.samples) == 1
        assert station.kv.stats().sequences == 1
    finally:
        client.close()
        station.release([903])


def test_a_late_answer_is_a_deadline_and_a_stopped_station_unavailable(tiny_llama):
    server = start_server(Station(tiny_llama, StationSpec(layers=CHAINS[2][1])), token=TOKEN)
    hidden = server.servicer.station.config.hidden_size
    client = RelayLinkClient("127.0.0.1", server.relay_link.port, token=TOKEN, tls=None, max_message_bytes=LIMIT,
                             wire=WireBytes())
    try:
        with server.servicer.lock.hold():  # a station busy past the caller's deadline
            t0 = time.monotonic()
            with pytest.raises(LinkError, match="deadline") as late:
                client.forward(_request(904, hidden), 0.3)
            assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 5
        assert len(client.forward(_request(905, hidden), 30).samples.samples) == 1  # a new connection serves
        server.stop(0)
        with pytest.raises(LinkError) as gone:
            client.forward(_request(906, hidden), 5)
        assert gone.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        client.close()
        server.stop(0)


def test_a_stopped_link_frees_its_port_ends_its_accept_thread_and_is_let_go(tiny_llama):
    """A process that stops a station (a test run, an embedding program) gets back its port, its threads and the
    station's memory: nothing is left blocked in accept() holding the link, its servicer and the station's KV."""
    def accepting() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "relay-link-accept"}
    before = accepting()
    server = start_server(Station(tiny_llama, StationSpec(layers=CHAINS[2][1])), token=TOKEN)
    (thread,) = accepting() - before
    link, port = weakref.ref(server.relay_link), server.relay_link.port
    server.stop(0)
    del server
    thread.join(timeout=10)
    assert not thread.is_alive()
    with socket.create_server(("127.0.0.1", port)):  # the port is free again
        pass
    gc.collect()
    assert link() is None


def test_the_link_speaks_mutual_tls_only(tiny_llama, pki_files):
    """A station serving mTLS serves its link in mTLS: a client certificate of the cluster CA is answered; a
    certificate not made for clients, a rogue CA's, or no TLS at all gets nothing."""
    files = pki_files
    tls = lambda stem: StationTls.from_files(files[f"{stem}.crt"], files[f"{stem}.key"], files["ca.crt"])
    server = start_server(Station(tiny_llama, StationSpec(layers=CHAINS[2][1])), token=TOKEN, tls=tls("station"))
    hidden = server.servicer.station.config.hidden_size
    port = server.relay_link.port
    try:
        good = RelayLinkClient("127.0.0.1", port, token=TOKEN, tls=tls("orchestrator"), max_message_bytes=LIMIT,
                               wire=WireBytes(), shm_bytes=1 << 20)  # the offer and the rows' frames over TLS too
        request = _request(907, hidden)
        rows, request.hidden.data = request.hidden.data, b""
        assert len(good.forward(request, 30, rows=memoryview(rows)).samples.samples) == 1
        assert server.relay_link.shm_requests == SHM_OK
        good.close()
        for stem in ("station", "rogue"):
            bad = RelayLinkClient("127.0.0.1", port, token=TOKEN, tls=tls(stem), max_message_bytes=LIMIT,
                                  wire=WireBytes())
            with pytest.raises(LinkError) as refused:
                bad.forward(_request(908, hidden), 10)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            bad.close()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # plain TCP: no frame answered
            sock.sendall(_frame(HELLO, TOKEN.encode()))
            assert _closed(sock)
        assert server.servicer.station.kv.stats().sequences == 1  # only the good client's wave ran
    finally:
        server.servicer.station.release([907])
        server.stop(0)


def test_header_layout_is_fixed():
    """The frame header is 24 bytes, little-endian: what a station of another build must read the same way."""
    assert HEADER.size == 24
    assert HEADER.pack(MAGIC, VERSION, REQUEST, 0, 5, 7, 1.5) == b"WMRL\x01\x02\x00\x00" + struct.pack("<IId", 5, 7, 1.5)


def test_a_connection_reads_its_frames_rows_into_one_kept_buffer():
    """Rows of successive frames land in the connection's one buffer (each read intact), and a frame over the kept
    size gets a buffer of its own, leaving the kept one as it was."""
    a, b = socket.socketpair()
    rows_buffer = RowsBuffer(keep_bytes=1 << 16)
    payloads = [random.Random(n).randbytes(size) for n, size in enumerate((50_000, 1_000, 40_000, 100_000))]
    got = []
    try:
        for n, payload in enumerate(payloads):
            send_frame(a, REQUEST, f"body {n}".encode(), rows=memoryview(payload))
            kind, _, _, body, rows = read_frame(b, LIMIT, rows_into=rows_buffer)
            assert (kind, bytes(body), bytes(rows)) == (REQUEST, f"body {n}".encode(), payload)
            got.append(rows)
    finally:
        a.close()
        b.close()
    kept = got[0].obj
    assert got[1].obj is kept and got[2].obj is kept  # the first three share the kept buffer
    assert got[3].obj is not kept and len(got[3].obj) == 100_000  # over keep_bytes: a buffer of its own
    assert bytes(kept[:40_000]) == payloads[2]  # the oversized frame did not touch the kept buffer
