"""Station over gRPC (no Ray): parity with the in-process station, refusals by status code, health."""
from __future__ import annotations

import contextlib
import threading
from dataclasses import replace

import grpc
import pytest
import torch

from mesh.core.config import StationSpec
from mesh.core.params import SamplingParams
from mesh.core.proto import station_pb2 as pb
from mesh.core.proto import station_pb2_grpc
from mesh.core.wave import WaveEntry
from mesh.core.wire import encode_forward
from mesh.core.wire_tensor import WireError, tensor_to_proto
from station.client import LinkClosed, StationCallError, StationClient
from station.generate import generate_one
from station.server import ServerLimits, start_server
from station.step import Station

from test_decode_steps import whole_station_server

PROMPT = [1, 17, 300, 45, 99, 7, 250, 11, 64, 3]
STEPS = 16
GREEDY = SamplingParams(max_tokens=STEPS, ignore_eos=True)
HIDDEN = 64  # hidden_size of the tiny preset


@pytest.fixture(scope="module")
def full(tiny_llama):
    """A server over a whole-model station, and a client of it."""
    with whole_station_server(tiny_llama) as both:
        yield both


@pytest.fixture(scope="module")
def split(tiny_llama):
    """Two servers: layers [0, 2) and [2, 6), with a client each."""
    servers = [start_server(Station(tiny_llama, StationSpec(layers=r))) for r in ((0, 2), (2, 6))]
    clients = [StationClient(s.address, timeout_s=30, hidden_size=HIDDEN, vocab_size=512) for s in servers]
    try:
        yield servers, clients
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.stop(grace=0)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy tokens of an in-process whole-model station."""
    tokens, _ = generate_one(Station(tiny_llama, StationSpec(layers=(0, 6))), PROMPT, GREEDY)
    assert len(tokens) == STEPS
    return tokens


def _generate(clients: list[StationClient], prompt: list[int], seq_id: int, steps: int = STEPS) -> list[int]:
    """Greedy generation through a chain of clients: prefill, then one decode token per wave."""
    tokens, out, pos = list(prompt), [], 0
    try:
        for wave in range(steps):
            entry = WaveEntry(seq_id, pos, len(tokens) - pos, GREEDY)
            res = clients[0].forward(wave, (entry,), token_ids=tokens[pos:])
            for c in clients[1:]:
                res = c.forward(wave, (entry,), hidden=res.hidden)
            assert res.seconds > 0
            pos = len(tokens)
            tokens.append(res.samples[0].token_id)
            out.append(tokens[-1])
    finally:
        for c in clients:
            c.release([seq_id])
    return out


def _assert_good_request(client: StationClient, seq_id: int = 77) -> None:
    """A fresh prefill succeeds (the server kept serving), then its KV is released."""
    res = client.forward(0, (WaveEntry(seq_id, 0, 3, GREEDY),), token_ids=[1, 2, 3])
    assert res.samples[0] is not None
    assert client.release([seq_id]) == 1


def test_greedy_generation_matches_in_process(full, reference):
    _, client = full
    assert _generate([client], PROMPT, seq_id=1) == reference


def test_two_station_split_matches(split, reference):
    _, clients = split
    assert _generate(clients, PROMPT, seq_id=2) == reference
    assert [c.info().sequences for c in clients] == [0, 0]


def _raw_forward(address: str, request: pb.ForwardRequest) -> grpc.RpcError:
    """Send a hand-built request through the raw stub; returns the error it must raise."""
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
        station_pb2_grpc.StationStub(channel).Forward(request, timeout=30)
    return info.value


def test_bad_hidden_refused_with_invalid_argument(split):
    servers, clients = split
    entry = WaveEntry(10, 0, 4)
    good = torch.randn(4, HIDDEN)
    wrong_dtype = pb.ForwardRequest(entries=[pb.Entry(seq_id=10, start_pos=0, n_tokens=4)],
                                    hidden=tensor_to_proto(good.to(torch.float16)))
    short = encode_forward(0, (entry,), None, good)
    short.hidden.data = short.hidden.data[:-4]  # shape says 4 x 64 float32, bytes are one float short
    for request, field in ((wrong_dtype, "hidden.dtype"), (short, "hidden.data")):
        err = _raw_forward(servers[1].address, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith(field), err.details()
        assert clients[1].forward(0, (entry,), hidden=good).samples == [None]  # last station, no token asked
        assert clients[1].release([10]) == 1
    # token ids to a middle station: refused by the step, not the wire
    err = _raw_forward(servers[1].address, encode_forward(0, (entry,), [1, 2, 3, 4], None))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "token ids" in err.details()


def test_bad_positions_refused_with_invalid_argument(full):
    server, client = full
    unknown = encode_forward(0, (WaveEntry(999, 5, 1),), [4], None)
    err = _raw_forward(server.address, unknown)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown seq_id 999" in err.details()
    _assert_good_request(client)

    client.forward(0, (WaveEntry(5, 0, 4),), token_ids=[1, 2, 3, 4])
    try:
        skip = encode_forward(1, (WaveEntry(5, 6, 1),), [4], None)
        err = _raw_forward(server.address, skip)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "skips ahead" in err.details()
        _assert_good_request(client)
        with pytest.raises(StationCallError) as info:  # the client keeps the code too
            client.forward(2, (WaveEntry(5, 6, 1),), token_ids=[4])
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert client.forward(3, (WaveEntry(5, 4, 1, GREEDY),), token_ids=[4]).samples[0] is not None
    finally:
        client.release([5])


def test_kv_exhaustion_is_resource_exhausted(tiny_llama):
    # one block of 16 tokens over 6 layers: 2 * 6 layers * 2 kv heads * 16 dims * 4 bytes * 16 tokens
    block = 2 * 6 * 2 * 16 * 4 * 16
    server = start_server(Station(tiny_llama, StationSpec(layers=(0, 6), kv_bytes=4 * block)))
    try:
        with StationClient(server.address, timeout_s=30) as client:
            with pytest.raises(StationCallError) as info:
                client.forward(0, (WaveEntry(1, 0, 65),), token_ids=[3] * 65)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "KV budget exhausted" in info.value.details
            assert client.info().kv_blocks_used == 0  # nothing was held back
            _assert_good_request(client)
    finally:
        server.stop(grace=0)


def test_info_reports_layers_and_kv(split):
    _, clients = split
    clients[0].forward(0, (WaveEntry(20, 0, 20),), token_ids=list(range(20)))
    try:
        info = clients[0].info()
        assert (info.layer_start, info.layer_end, info.num_layers) == (0, 2, 6)
        assert (info.hidden_size, info.vocab_size, info.dtype, info.device) == (HIDDEN, 512, "float32", "cpu")
        assert info.sequences == 1 and info.kv_blocks_used == 2 and info.block_tokens == 16
        assert info.kv_bytes_used == 2 * (info.kv_bytes_total // info.kv_blocks_total)
        assert clients[1].info().layer_start == 2
    finally:
        assert clients[0].release([20, 21]) == 1
    assert clients[0].info().kv_bytes_used == 0


def test_replies_carry_the_kv_occupancy_and_the_newest_report_wins(split):
    _, clients = split
    info = clients[0].info()
    clients[0].forward(0, (WaveEntry(30, 0, 20),), token_ids=list(range(20)))
    try:
        after_forward = clients[0].kv_usage
        assert (after_forward.bytes_used, after_forward.blocks_used, after_forward.sequences) == (
            clients[0].info().kv_bytes_used, 2, 1)
        assert after_forward.bytes_used == 2 * (info.kv_bytes_total // info.kv_blocks_total)
    finally:
        assert clients[0].release([30]) == 1
    after_release = clients[0].kv_usage
    assert (after_release.bytes_used, after_release.sequences) == (0, 0)
    assert after_release.changes == after_forward.changes + 1
    late = pb.ForwardReply(kv=pb.KVUsage(bytes_used=after_forward.bytes_used, blocks_used=2, sequences=1,
                                         changes=after_forward.changes))
    clients[0]._note_kv(late)  # an older report arriving last (another thread's reply) does not win
    assert clients[0].kv_usage == after_release


def test_a_reply_with_impossible_kv_figures_is_malformed(full, monkeypatch):
    server, _ = full
    with StationClient(server.address, timeout_s=30) as probe:
        info = probe.info()
    client = StationClient(server.address, timeout_s=30, hidden_size=HIDDEN, vocab_size=512,
                           kv_blocks_total=info.kv_blocks_total, kv_bytes_total=info.kv_bytes_total)
    station = server.servicer.station
    real = station.kv_usage()
    try:
        monkeypatch.setattr(station, "kv_usage", lambda: replace(real, bytes_used=info.kv_bytes_total + 1))
        with pytest.raises(WireError, match=r"^kv\.bytes_used: "):
            client.forward(0, (WaveEntry(31, 0, 3, GREEDY),), token_ids=[1, 2, 3])
        monkeypatch.undo()
        assert client.release([31]) == 1  # the station applied the wave; the client refused the reply
        assert client.kv_usage.bytes_used == 0
    finally:
        client.close()


def test_health_is_serving_and_goes_down_on_stop(tiny_llama):
    server = start_server(Station(tiny_llama, StationSpec(layers=(2, 6))))
    client = StationClient(server.address, timeout_s=5)
    try:
        assert client.health() and client.health("wavemesh.v1.Station")
        assert not client.health("no.such.Service")
    finally:
        server.stop(grace=0)
    assert not client.health()
    with pytest.raises(StationCallError) as info:
        client.info()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    client.close()
    # a closed client (a link retired by a recovery while a status poll still holds it) fails like any call
    assert not client.health()
    with pytest.raises(StationCallError) as info:
        client.info()
    assert info.value.code == grpc.StatusCode.CANCELLED and isinstance(info.value, LinkClosed)


def test_a_release_on_a_closed_link_frees_nothing_and_raises_nothing(tiny_llama):
    """A recovery closes the link of the station it replaced, and the route switch then releases the replayed
    sequences through the old links: on the closed one there is nothing to free (that process and its KV are
    gone), so it is neither an error nor a warning. Any other failed release still raises."""
    from orchestrator.remote import RemoteLink

    server = start_server(Station(tiny_llama, StationSpec(layers=(0, 6))))
    link = RemoteLink(server.address, timeout_s=5)
    try:
        link.release((1, 2))  # nothing held: answered, 0 released
        server.stop(grace=0)
        with pytest.raises(StationCallError) as info:  # a station that is gone, on a link still open
            link.release((1,))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        link.close()
        link.release((1,))
    finally:
        server.stop(grace=0)


class GatedStation:
    """A station whose forward waits for a gate (and can be told to fail), to hold the server busy."""

    def __init__(self, station: Station) -> None:
        self._station = station
        self.entered, self.gate = threading.Event(), threading.Event()
        self.fail_with: Exception | None = None

    def __getattr__(self, name):
        return getattr(self._station, name)

    def forward(self, *args, **kwargs):
        """Signal entry, wait for the gate, then run (or raise `fail_with`)."""
        self.entered.set()
        assert self.gate.wait(30)
        if self.fail_with is not None:
            raise self.fail_with
        return self._station.forward(*args, **kwargs)


@contextlib.contextmanager
def _gated_server(tiny_llama, gate_open: bool = False):
    """A whole-model GatedStation served (4 workers, max_pending 2), a client and a results dict; stopped after."""
    slow = GatedStation(Station(tiny_llama, StationSpec(layers=(0, 6))))
    if gate_open:
        slow.gate.set()
    server = start_server(slow, limits=ServerLimits(max_workers=4, max_pending=2))
    client = StationClient(server.address, timeout_s=10)
    try:
        yield slow, server, client, {}
    finally:
        slow.gate.set()
        client.close()
        server.stop(grace=0)


def test_health_and_info_answer_during_a_forward(tiny_llama):
    with _gated_server(tiny_llama) as (slow, server, client, results):
        worker = threading.Thread(target=lambda: results.update(
            forward=client.forward(0, (WaveEntry(1, 0, 3, GREEDY),), token_ids=[1, 2, 3])))
        worker.start()
        assert slow.entered.wait(10)
        assert client.health()
        assert client.info().layer_end == 6
        # a second forward waits for the lock; a third is over max_pending (2) and refused at once
        second = threading.Thread(target=lambda: results.update(released=client.release([1])))
        second.start()
        second.join(0.5)
        assert second.is_alive()  # Release waits for the station lock
        with pytest.raises(StationCallError) as info:
            client.forward(1, (WaveEntry(2, 0, 1),), token_ids=[1])
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in info.value.details
        slow.gate.set()
        worker.join(10)
        second.join(10)
        assert results["forward"].samples[0] is not None and results["released"] == 1


def test_a_release_sent_during_a_forward_is_queued_and_applied_before_the_station_lets_go(tiny_llama):
    """Release with queue_if_busy while a forward holds the station: the reply comes at once (queued, no KV figures),
    the forward's own reply reports the KV after the release, and the sequence is gone for every later call; without
    queue_if_busy a release waits for the forward, as before."""
    with _gated_server(tiny_llama, gate_open=True) as (slow, server, client, results):
        worker = threading.Thread(target=lambda: results.update(
            forward=client.forward(1, (WaveEntry(2, 0, 3, GREEDY),), token_ids=[1, 2, 3])))
        client.forward(0, (WaveEntry(1, 0, 3, GREEDY),), token_ids=[4, 5, 6])  # sequence 1 holds KV
        assert client.kv_usage.sequences == 1
        slow.gate.clear()
        slow.entered.clear()
        worker.start()
        assert slow.entered.wait(10)  # sequence 2's forward holds the station
        assert client.release([1], queue_if_busy=True) == 0  # queued: answered while the forward still holds it
        assert worker.is_alive() and server.servicer.lock.queued_releases == 1
        assert client.kv_usage.sequences == 1  # a queued release reports no KV figures
        waiting = threading.Thread(target=lambda: results.update(waited=client.release([2])))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive()  # without queue_if_busy it waits for the station, as before
        slow.gate.set()
        worker.join(10)
        waiting.join(10)
        assert results["forward"].samples[0] is not None and results["waited"] == 1
        assert client.kv_usage.sequences == 0 and client.kv_usage.bytes_used == 0
        assert client.release([1]) == 0  # gone already: the queued release was applied
        assert client.release([7], queue_if_busy=True) == 0 and client.kv_usage.sequences == 0  # idle: at once
        assert server.servicer.lock.queued_releases == 1


def test_unexpected_error_is_internal_and_deadline_is_kept(tiny_llama):
    slow = GatedStation(Station(tiny_llama, StationSpec(layers=(0, 6))))
    server = start_server(slow)
    try:
        with StationClient(server.address, timeout_s=0.3) as client:
            with pytest.raises(StationCallError) as info:  # the gate is shut: the deadline passes
                client.forward(0, (WaveEntry(1, 0, 1),), token_ids=[1])
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            slow.fail_with = RuntimeError("boom")
            slow.gate.set()
            with pytest.raises(StationCallError) as info:
                client.forward(1, (WaveEntry(2, 0, 1),), token_ids=[1])
            assert info.value.code == grpc.StatusCode.INTERNAL and "RuntimeError: boom" in info.value.details
            slow.fail_with = None
            client.timeout_s = 30
            _assert_good_request(client)
    finally:
        server.stop(grace=0)
