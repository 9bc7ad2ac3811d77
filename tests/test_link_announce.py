"""Announced hops on a relay link (station/relay_link.py): a relaying station sends its successor the onward request
before its own step and the rows after it. Announced rows get a whole request's answer (that a chain's every relayed
hop is announced, with one station's tokens, test_relay_link.py and test_link_shm.py check); frames out of order are
refused by name and the station goes on; an announcement whose rows never come (the step failed, the caller hung
up) leaves the successor nothing; a station of an earlier build gets whole requests."""
from __future__ import annotations

import socket

import grpc
import pytest
import torch

from mesh.core.params import SamplingParams
from mesh.core.proto import station_pb2 as pb
from mesh.core.wave import WaveEntry
from mesh.core.wire_tensor import tensor_bytes, tensor_header
from orchestrator.remote import RemoteLink
from station.client import StationCallError
from station.interceptors import WireBytes
from station.link_frames import ANNOUNCE, ERROR, FEATURES, HELLO, REPLY, REQUEST, ROWS, ROWS_SHM, frame
from station.relay_link import RelayLinkServer
from station.relay_link_client import RelayLinkClient

from test_relay import TOKEN, chains  # noqa: F401 - fixtures
from test_relay_link import LIMIT, SHM_OK, _closed, _connect, _frame, _read, _request, last_station  # noqa: F401

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


def _split(request: pb.ForwardRequest) -> tuple[bytes, bytes, bytes]:
    """An announced request's three parts: the message without rows, the rows' dtype and shape, the rows' bytes."""
    header, rows = pb.Tensor(dtype=request.hidden.dtype, shape=request.hidden.shape), request.hidden.data
    request.ClearField("hidden")
    return request.SerializeToString(), header.SerializeToString(), rows


def _samples(body: bytes) -> list[int]:
    return [s.token_id for s in pb.ForwardReply.FromString(body).samples.samples]


def test_announced_rows_get_the_answer_of_a_whole_request(last_station):
    station = last_station.servicer.station
    hidden = station.config.hidden_size
    with _connect(last_station) as sock:
        kind, _, body = _read(sock)
        assert (kind, body) == (REPLY, FEATURES)  # the station says it takes announcements
        whole = _request(930, hidden)
        announced = pb.ForwardRequest()
        announced.CopyFrom(whole)
        announced.entries[0].seq_id = 931
        sock.sendall(_frame(REQUEST, whole.SerializeToString()))
        kind, _, answer = _read(sock)
        message, header, rows = _split(announced)
        before = last_station.relay_link.announced
        sock.sendall(_frame(ANNOUNCE, message))
        sock.sendall(_frame(ROWS, header, rows=rows))
        kind_a, _, answer_a = _read(sock)
        assert kind == kind_a == REPLY and _samples(answer) == _samples(answer_a)
        assert last_station.relay_link.announced == before + 1
    client = RelayLinkClient("127.0.0.1", last_station.relay_link.port, token=TOKEN, tls=None,
                             max_message_bytes=LIMIT, wire=WireBytes(), shm_bytes=1 << 20 if SHM_OK else 0)
    try:  # through the client: one announcement abandoned (its connection closed, never answered), one completed
        rows = torch.randn(2, hidden)
        dropped = client.announce(_request(937, hidden), 30)
        client.abandon(dropped)
        assert dropped.conn.fileno() == -1
        sent = client.announce(_request(938, hidden), 30)
        reply = client.complete(sent, tensor_header(rows), tensor_bytes(rows))
        assert len(reply.samples.samples) == 1 and last_station.relay_link.announced == before + 2
        assert station.kv.length(937) is None and station.kv.length(938) == 2
    finally:
        client.close()
        station.release([930, 931, 938])


def test_frames_out_of_order_are_refused_by_name_and_the_station_goes_on(last_station):
    station = last_station.servicer.station
    hidden = station.config.hidden_size
    message, header, rows = _split(_request(932, hidden))
    cases = [  # (frames after HELLO, words of the refusal); each closes the connection
        ([_frame(ROWS, header, rows=rows)], b"where a request was expected"),
        ([_frame(ANNOUNCE, message), _frame(REQUEST, message)], b"the announced request's rows were expected"),
        ([_frame(ANNOUNCE, message), _frame(ANNOUNCE, message)], b"the announced request's rows were expected"),
        ([_frame(ANNOUNCE, message, rows=rows)], b"carries no rows"),
    ]
    for frames, words in cases:
        with _connect(last_station) as sock:
            _read(sock)
            sock.sendall(b"".join(frames))
            kind, status, body = _read(sock)
            assert (kind, status) == (ERROR, INVALID) and words in body, body
            assert _closed(sock)
    with _connect(last_station) as sock:  # rows said to be in a segment the connection does not have
        _read(sock)
        sock.sendall(_frame(ANNOUNCE, message) + frame(ROWS_SHM, header, rows_length=len(rows)))
        kind, status, body = _read(sock)
        assert (kind, status) == (ERROR, INVALID) and b"has no segment" in body, body
        assert _closed(sock)
    with _connect(last_station) as sock:  # bodies that are wrong are answered after the rows; the connection goes on
        _read(sock)
        odd = pb.Tensor(dtype="int99", shape=[2, hidden]).SerializeToString()
        for announce, dtype, words in ((b"\xff\xff\xff", header, b"not a valid protobuf"),
                                       (pb.ForwardRequest(wave_id=1).SerializeToString(), header, b"at least one entry"),
                                       (message, odd, b"int99")):
            sock.sendall(_frame(ANNOUNCE, announce))
            sock.sendall(_frame(ROWS, dtype, rows=rows))
            kind, status, body = _read(sock)
            assert (kind, status) == (ERROR, INVALID) and words in body, body
        sock.sendall(_frame(ANNOUNCE, message) + _frame(ROWS, header, rows=rows))
        kind, _, body = _read(sock)
        assert kind == REPLY and len(_samples(body)) == 1
    with _connect(last_station) as sock:  # an announcement whose caller hangs up: dropped, nothing computed
        _read(sock)
        sock.sendall(_frame(ANNOUNCE, _split(_request(933, hidden))[0]))
    client = RelayLinkClient("127.0.0.1", last_station.relay_link.port, token=TOKEN, tls=None,
                             max_message_bytes=LIMIT, wire=WireBytes())
    try:
        assert len(client.forward(_request(934, hidden), 30).samples.samples) == 1
        assert station.kv.length(933) is None and station.kv.length(934) == 2
    finally:
        client.close()
        station.release([932, 934])


def test_a_step_failing_after_its_announcement_leaves_the_successor_nothing(tiny_llama, chains):
    """The first station announces the wave to its successor, then its own step fails (a position it does not
    hold): the call fails with the step's error, the successor answered nothing and holds nothing, and the chain
    serves the next wave over the same link."""
    first = RemoteLink(chains[2][0].address, timeout_s=10, token=TOKEN)
    successor = chains[2][1]
    last = RemoteLink(successor.address, timeout_s=10, token=TOKEN)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    try:
        answered = successor.relay_link.requests
        with pytest.raises(StationCallError, match="unknown seq_id 71") as failed:
            first.client.relay(1, (WaveEntry(71, 5, 3, params),), token_ids=[4, 5, 6], relay_to=[successor.address])
        assert failed.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert successor.relay_link.requests == answered and successor.servicer.station.kv.stats().sequences == 0
        announced = successor.relay_link.announced
        reply = first.client.relay(2, (WaveEntry(72, 0, 3, params),), token_ids=[4, 5, 6],
                                   relay_to=[successor.address])
        assert len(reply.output.samples) == 1 and successor.relay_link.announced == announced + 1
    finally:
        first.release((71, 72))
        last.release((72,))
        first.close()
        last.close()


def test_a_station_of_an_earlier_build_gets_whole_requests():
    """A link that takes no announcements (as an earlier build's) lists nothing in its REPLY to HELLO: a client never
    announces to it, and an ANNOUNCE sent anyway is refused as an unknown frame."""
    plain = RelayLinkServer("127.0.0.1", lambda *args: pb.ForwardReply(forward_seconds=0.5), token=TOKEN, tls=None,
                            max_message_bytes=LIMIT, wire=WireBytes())
    client = RelayLinkClient("127.0.0.1", plain.port, token=TOKEN, tls=None, max_message_bytes=LIMIT,
                             wire=WireBytes())
    rows = torch.randn(2, 8)
    request = _request(935, 8)
    tensor_header(rows, into=request.hidden)
    request.hidden.ClearField("data")
    try:
        assert client.announce(request, 10) is None  # not announced: the whole request goes later
        assert client.forward(request, 10, rows=tensor_bytes(rows)).forward_seconds == 0.5
        assert plain.requests == 1 and plain.announced == 0
        with socket.create_connection(("127.0.0.1", plain.port), timeout=10) as sock:
            sock.sendall(_frame(HELLO, TOKEN.encode()))
            assert _read(sock) == (REPLY, 0, b"")
            sock.sendall(_frame(ANNOUNCE, _split(_request(936, 8))[0]))
            kind, status, body = _read(sock)
            assert (kind, status) == (ERROR, INVALID) and b"frame kind 7 where a request was expected" in body
    finally:
        client.close()
        plain.stop()
