"""Rows through shared memory on a relay link (station/link_shm.py): between stations of one host every relayed hop's
rows go through its connection's segment, with the tokens of TCP and of one station, and nothing stays in /dev/shm;
a bad offer is declined by name and the connection goes on by TCP; rows in shared memory without a segment are
refused; rows over the segment go by TCP; a station on another host, or one that hangs up on the offer, gets the
client's calls by TCP from then on."""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from mesh.core.config import StationSpec
from mesh.core.params import SamplingParams
from mesh.core.proto import station_pb2 as pb
from mesh.core.wave import WaveEntry
from mesh.core.wire_tensor import tensor_bytes, tensor_header
from station.interceptors import WireBytes
from station.link_frames import ERROR, REPLY, REQUEST, REQUEST_SHM, SHM, LinkError, frame, read_frame, send_frame
from station.link_shm import NAME, OFFER, SHM_DIR, RowsSegment
from station.relay_link_client import RelayLinkClient
from station.server import start_server
from station.step import Station

from test_relay import CHAINS, TOKEN, _run, reference  # noqa: F401 - fixtures
from test_relay_link import (LIMIT, SHM_OK, _closed, _connect, _frame, _read, _request,  # noqa: F401 - fixtures
                             last_station)

pytestmark = pytest.mark.skipif(not SHM_OK, reason=f"no writable {SHM_DIR} here: relay links go by TCP")

FAILED = grpc.StatusCode.FAILED_PRECONDITION.value[0]
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


def _segments_left() -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if NAME.fullmatch(n)]


def _beside(seq_id: int, hidden: int, rows: int = 2) -> tuple[pb.ForwardRequest, bytes]:
    """A wave for the last station whose rows' bytes travel apart from the message."""
    request = _request(seq_id, hidden, rows)
    data, request.hidden.data = request.hidden.data, b""
    return request, data


def _samples(body: bytes) -> list[int]:
    return [s.token_id for s in pb.ForwardReply.FromString(body).samples.samples]


def test_a_chain_on_one_host_relays_its_rows_through_shared_memory(tiny_llama, reference, monkeypatch):
    """Three stations on this host: with shared memory (the default) every relayed hop's rows went through it, put
    there by the relaying station's step itself (never copied in after), whole requests' and steps sessions' alike;
    by TCP none did; the tokens are one station's both ways, and no segment's name is left behind."""
    prompts, params, ref = reference
    held: list[bool] = []  # for each hop's rows sent through a segment: were they there already
    holds_at = RowsSegment.holds_at
    monkeypatch.setattr(RowsSegment, "holds_at",
                        lambda self, address, nbytes: held.append(holds_at(self, address, nbytes)) or held[-1])
    for shm in (True, False):
        servers = [start_server(Station(tiny_llama, StationSpec(layers=r)), token=TOKEN, relay_shm=shm)
                   for r in CHAINS[3]]
        try:
            assert _run(tiny_llama, servers, "direct", prompts, params)[0] == ref
            links = [s.relay_link for s in servers[1:]]
            assert all(link.requests > 0 and link.announced == link.requests for link in links)  # test_link_announce
            assert all(link.session_steps > 0 for link in links)  # the decode steps went in sessions
            hops = [link.requests + link.session_steps for link in links]
            assert [link.shm_requests for link in links] == [n if shm else 0 for n in hops]
            assert len(held) == (sum(hops) if shm else 0) and all(held)
            held.clear()
            assert _segments_left() == []
        finally:
            for s in servers:
                s.stop(0)


def test_bad_offers_are_declined_by_name_and_the_connection_goes_on(last_station):
    station = last_station.servicer.station
    hidden = station.config.hidden_size
    segment, offer, path = RowsSegment.create(1 << 16)
    nonce, size = OFFER.unpack_from(offer)
    name = offer[OFFER.size:]
    cases = [  # (offer, words of the refusal)
        (b"short", "too short"),
        (OFFER.pack(nonce, size) + b"../../etc/passwd", "not a segment name"),
        (OFFER.pack(nonce, size) + b"wavemesh-rows-" + b"0" * 32, "cannot open"),
        (OFFER.pack(nonce, size + 1) + name, f"not a {size + 1}-byte file"),
        (OFFER.pack(bytes(16), size) + name, "nonce"),
        (OFFER.pack(nonce, LIMIT * 4) + name, "outside"),
    ]
    try:
        with _connect(last_station) as sock:
            assert _read(sock)[:2] == (REPLY, 0)
            for body, words in cases:
                sock.sendall(_frame(SHM, body))
                kind, status, got = _read(sock)
                assert (kind, status) == (ERROR, FAILED) and words in got.decode(), got
            request, rows = _beside(911, hidden)  # after every refusal the connection still serves, by TCP
            sock.sendall(_frame(REQUEST, request.SerializeToString(), rows=rows))
            kind, status, by_tcp = _read(sock)
            assert (kind, status) == (REPLY, 0)
            request.entries[0].seq_id = 912  # rows said to be in shared memory without a segment: refused, closed
            sock.sendall(frame(REQUEST_SHM, request.SerializeToString(), seconds=30.0, rows_length=len(rows)))
            kind, status, got = _read(sock)
            assert (kind, status) == (ERROR, INVALID) and b"has no segment" in got
            assert _closed(sock)
        with _connect(last_station) as sock:  # the good offer is taken, a second declined; the rows read from it
            _read(sock)
            sock.sendall(_frame(SHM, offer))
            assert _read(sock)[:2] == (REPLY, 0)
            sock.sendall(_frame(SHM, offer))
            kind, status, got = _read(sock)
            assert (kind, status) == (ERROR, FAILED) and b"already has a segment" in got
            before = last_station.relay_link.shm_requests
            request.entries[0].seq_id = 913
            segment.write(memoryview(rows))
            sock.sendall(frame(REQUEST_SHM, request.SerializeToString(), seconds=30.0, rows_length=len(rows)))
            kind, status, by_shm = _read(sock)
            assert (kind, status) == (REPLY, 0) and _samples(by_shm) == _samples(by_tcp)
            assert last_station.relay_link.shm_requests == before + 1
            request.entries[0].seq_id = 914  # more rows than the segment holds: refused, closed
            sock.sendall(frame(REQUEST_SHM, request.SerializeToString(), seconds=30.0, rows_length=size + 1))
            kind, status, got = _read(sock)
            assert (kind, status) == (ERROR, INVALID) and f"{size}-byte segment".encode() in got
            assert _closed(sock)
    finally:
        segment.close()
        os.unlink(path)
        station.release([911, 913])
    assert station.kv.stats().sequences == 0


def test_a_client_sends_rows_that_fit_through_its_segment_and_the_rest_by_tcp(last_station):
    station = last_station.servicer.station
    hidden = station.config.hidden_size
    small = torch.randn(2, hidden)  # [2, d]
    wire = WireBytes()
    client = RelayLinkClient("127.0.0.1", last_station.relay_link.port, token=TOKEN, tls=None,
                             max_message_bytes=LIMIT, wire=wire, shm_bytes=small.numel() * 4)
    shm, tcp = last_station.relay_link.shm_requests, last_station.relay_link.requests
    try:
        answers = []
        for seq_id, rows in ((915, small), (916, small), (917, torch.randn(3, hidden))):
            request = _request(seq_id, hidden, rows.shape[0])
            tensor_header(rows, into=request.hidden)
            request.hidden.ClearField("data")
            answers.append(client.forward(request, 30, rows=tensor_bytes(rows)).samples.samples[0].token_id)
        assert answers[0] == answers[1]  # the same rows the same way: the same greedy token
        assert last_station.relay_link.shm_requests == shm + 2  # the two that fit; the third by TCP
        assert last_station.relay_link.requests == tcp + 3
        assert wire.totals()["out"] > (2 + 2 + 3) * hidden * 4  # the rows count as the hop's bytes either way
        assert _segments_left() == []
    finally:
        client.close()
        station.release([915, 916, 917])


def test_a_late_calls_rows_stay_as_sent_while_the_station_reads_them(tiny_llama, last_station):
    """The station reads rows where they lie in the segment, so a client writes a segment again only after its
    answer: a call past its deadline closes its connection and segment, and the next call, sent while the busy
    station still holds the late one, goes on a new connection. The late request is computed from its own rows
    (the logits after it are those of its rows alone), not the next call's."""
    station = last_station.servicer.station
    hidden = station.config.hidden_size
    client = RelayLinkClient("127.0.0.1", last_station.relay_link.port, token=TOKEN, tls=None,
                             max_message_bytes=LIMIT, wire=WireBytes(), shm_bytes=1 << 16)
    late_rows, next_rows = torch.randn(2, hidden), torch.randn(2, hidden)  # [2, d] each

    def call(seq_id: int, rows: torch.Tensor, timeout: float) -> pb.ForwardReply:
        request = _request(seq_id, hidden)
        tensor_header(rows, into=request.hidden)
        request.hidden.ClearField("data")
        return client.forward(request, timeout, rows=tensor_bytes(rows))

    def wait_for(done) -> None:
        deadline = time.monotonic() + 20
        while not done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done()

    shm = last_station.relay_link.shm_requests
    following = ThreadPoolExecutor(1)
    try:
        with last_station.servicer.lock.hold():  # busy past the first call's deadline
            with pytest.raises(LinkError) as late:
                call(931, late_rows, 0.3)
            assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and client._idle == []
            follow = following.submit(call, 932, next_rows, 30)
            wait_for(lambda: last_station.relay_link.shm_requests == shm + 2)  # both wait on the station now
        assert len(follow.result(30).samples.samples) == 1
        wait_for(lambda: station.kv.length(931) == 2)  # the late one was computed too, its answer unread
        row, step = torch.randn(1, hidden), (WaveEntry(931, 2, 1, SamplingParams()),)
        (got, _) = last_station.servicer.lock.run(lambda: station.forward(step, hidden=row, want_logits=True))
        alone = Station(tiny_llama, StationSpec(layers=CHAINS[2][1]))
        alone.forward((WaveEntry(931, 0, 2, SamplingParams()),), hidden=late_rows)
        assert torch.equal(got.logits, alone.forward(step, hidden=row, want_logits=True).logits)
    finally:
        following.shutdown()
        client.close()
        station.release([931, 932])


def test_a_station_on_another_host_gets_rows_by_tcp_and_no_more_offers(last_station, tmp_path, monkeypatch):
    """A segment the station cannot find (made where it does not look: as from another host) is declined; the
    call goes by TCP and the client offers no segment again."""
    station = last_station.servicer.station
    made = RowsSegment.create
    monkeypatch.setattr(RowsSegment, "create", classmethod(lambda cls, size: made(size, str(tmp_path))))
    client = RelayLinkClient("127.0.0.1", last_station.relay_link.port, token=TOKEN, tls=None,
                             max_message_bytes=LIMIT, wire=WireBytes(), max_idle=0, shm_bytes=1 << 20)
    shm = last_station.relay_link.shm_requests
    try:
        for seq_id in (918, 919):  # max_idle 0: each call opens a connection
            request, rows = _beside(seq_id, station.config.hidden_size)
            assert len(client.forward(request, 30, rows=memoryview(rows)).samples.samples) == 1
        assert last_station.relay_link.shm_requests == shm and client._shm_bytes == 0
        assert os.listdir(tmp_path) == []  # the declined segment's name was removed too
    finally:
        client.close()
        station.release([918, 919])


def _earlier_build_station(listener: socket.socket, reply: bytes, seen: list[int]) -> None:
    """A link that knows no SHM frame (ERROR and a hang-up, as a station of an earlier build answers it) and
    answers a REQUEST with `reply`; `seen` gets every frame kind it reads."""
    for _ in range(2):
        conn, _ = listener.accept()
        with conn:
            while (got := read_frame(conn, LIMIT)) is not None:
                seen.append(got[0])
                if got[0] == SHM:
                    conn.sendall(frame(ERROR, b"frame kind 5 where a request was expected", status=INVALID))
                    break
                send_frame(conn, REPLY, b"" if got[0] != REQUEST else reply)


def test_a_station_that_hangs_up_on_the_offer_is_called_again_without_one():
    listener = socket.create_server(("127.0.0.1", 0))
    reply = pb.ForwardReply(samples=pb.Samples(samples=[pb.Sample(token_id=7)])).SerializeToString()
    seen: list[int] = []
    server = threading.Thread(target=_earlier_build_station, args=(listener, reply, seen), daemon=True)
    server.start()
    client = RelayLinkClient("127.0.0.1", listener.getsockname()[1], token=TOKEN, tls=None,
                             max_message_bytes=LIMIT, wire=WireBytes(), shm_bytes=1 << 20)
    try:
        request, rows = _beside(920, 8)
        assert client.forward(request, 10, rows=memoryview(rows)).samples.samples[0].token_id == 7
    finally:
        client.close()  # the fake station's second connection ends
        server.join(10)
        listener.close()
    assert seen.count(SHM) == 1 and seen.count(REQUEST) == 1 and client._shm_bytes == 0
    assert _segments_left() == []


@pytest.mark.parametrize("size", [64, 1 << 20])
def test_a_segment_carries_rows_intact(size, tmp_path):
    assert RowsSegment.create(size, str(tmp_path / "missing")) is None  # no such place: the link goes by TCP
    segment, offer, path = RowsSegment.create(size)
    try:
        attached = RowsSegment.attach(offer, size)
        data = os.urandom(size)
        segment.write(memoryview(data))
        rows = attached.rows(size)
        assert bytes(rows) == data and segment.holds(segment.rows(size)) and segment.holds(segment.rows(1))
        assert not segment.holds(memoryview(data)) and not segment.holds(segment.rows(size)[1:])
        view = torch.frombuffer(rows, dtype=torch.uint8)  # the station's tensor over the rows, in place
        attached.close()  # while it lives the mapping stays
        assert bytes(view.numpy()) == data
        del rows, view
    finally:
        segment.close()
        os.unlink(path)


def test_the_hop_bench_measures_both_carriages(capsys):
    """`python bench/link_hop.py` alternates shared memory and TCP over one station process, and checks that each
    mode's rows really went the way it names (else it fails)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import link_hop

    assert link_hop.main(["--mib", "0.05", "--hops", "5", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count(" shm: round trip") == 2 and out.count(" tcp: round trip") == 2
    assert "| shm |" in out and "| tcp |" in out
    assert _segments_left() == []
