"""Direct transfer (issue 13 item 2): hidden rows go station to station, only token ids leave the orchestrator and
only samples come back; tokens equal the hub path's and one station's; every hop carries the token and mTLS; a
station that cannot reach its successor fails the wave as a dead station does."""
from __future__ import annotations

import grpc
import pytest
import torch

from mesh.core.config import ConfigError, ModelConfig, SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from mesh.core.proto import station_pb2 as pb
from mesh.core.transport import StationTls
from mesh.core.wave import WaveEntry
from mesh.core.wire import WireError, decode_relay, encode_forward
from orchestrator.engine import Engine
from orchestrator.pipeline import StationDown
from orchestrator.relay import RelayPipeline
from orchestrator.remote import RemoteLink
from station.client import StationCallError, StationClient
from station.generate import generate_one
from station.relay import onward_request
from station.server import start_server
from station.step import Station

from test_station_auth import _pki

TOKEN = "relay-token"
CHAINS = {2: ((0, 2), (2, 6)), 3: ((0, 1), (1, 4), (4, 6))}


def _jobs(n=8, max_tokens=10):
    prompts = [[1] + [(37 * i + 11 * j) % 500 + 5 for j in range(2 + (7 * i) % 20)] for i in range(n)]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.9,
                             seed=700 + i) for i in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy and seeded requests, each alone on one full-model station."""
    prompts, params = _jobs()
    st = Station(tiny_llama, StationSpec(layers=(0, 6)))
    return prompts, params, [generate_one(st, p, sp)[0] for p, sp in zip(prompts, params)]


@pytest.fixture(scope="module")
def pki_files(tmp_path_factory):
    """The CA, station (serving) and orchestrator (client) certificates of test_station_auth."""
    return _pki(tmp_path_factory.mktemp("relay-pki"))


@pytest.fixture(scope="module")
def chains(tiny_llama):
    """gRPC stations with the cluster token for the 2- and 3-station chains (shared by the tests of this file)."""
    servers = {n: [start_server(Station(tiny_llama, StationSpec(layers=r)), token=TOKEN) for r in ranges]
               for n, ranges in CHAINS.items()}
    yield servers
    for chain in servers.values():
        for server in chain:
            server.stop(0)


def _run(model_dir, servers, hidden_path, prompts, params, tls=None, decode_steps=4, waves=None, reply_steps=0):
    """Every request at once through an engine over `servers`; (tokens, pipeline, Forward bytes per link).
    `waves`, a list, gets the number of wave calls made."""
    links = [RemoteLink(s.address, timeout_s=30, token=TOKEN, tls=tls) for s in servers]
    engine = Engine(links, ModelConfig.from_dir(model_dir),
                    SchedulerConfig(max_seqs=8, max_wave_tokens=64, hidden_path=hidden_path,
                                    decode_steps=decode_steps, reply_steps=reply_steps))
    try:
        streams = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        outs = [s.result(timeout=120)[0] for s in streams]
        assert not any(o.error for o in outs), [o.error for o in outs if o.error]  # names a failed wave's cause
        tokens = [o.token_ids for o in outs]
        assert engine.quiesce(30) and engine.stats().kv_bytes_used == 0
        assert all(s.servicer.station.kv.stats().blocks_used == 0 for s in servers)
        if waves is not None:
            waves.append(engine.stats().waves)
        return tokens, engine.pipeline, [list(link.client.forward_bytes) for link in links]
    finally:
        engine.close()
        for link in links:
            link.close()


@pytest.mark.parametrize("n", sorted(CHAINS))
def test_direct_equals_hub_and_one_station(tiny_llama, reference, chains, n):
    prompts, params, ref = reference
    sent_before = chains[n][0].servicer.wire_bytes["out"]
    direct, pipeline, direct_bytes = _run(tiny_llama, chains[n], "direct", prompts, params)
    relayed = chains[n][0].servicer.wire_bytes["out"] - sent_before  # the station's /metrics count its relays
    hub, hub_pipeline, hub_bytes = _run(tiny_llama, chains[n], "hub", prompts, params)
    assert isinstance(pipeline, RelayPipeline) and hub_pipeline.hidden_path == "hub"
    assert direct == hub == ref
    # direct: the orchestrator called the first station only, and no hidden row came back to it
    assert direct_bytes[1:] == [[0, 0]] * (n - 1) and hub_bytes[1][0] > 0
    hidden_row = ModelConfig.from_dir(tiny_llama).hidden_size * 4
    rows = sum(len(p) + sp.max_tokens - 1 for p, sp in zip(prompts, params))
    assert direct_bytes[0][1] < rows * hidden_row / 4 < sum(b[0] for b in hub_bytes)
    assert relayed > rows * hidden_row
    assert all(len(h) > 0 for h in pipeline.hop_seconds)  # every station's hop was reported back


@pytest.mark.parametrize("n", sorted(CHAINS))
def test_direct_chains_run_several_decode_steps_per_call(tiny_llama, reference, chains, n):
    """On the direct path the first station runs a decode-only wave's steps itself, relaying each and feeding the
    samples back: the tokens of one step per call and of one station, in fewer wave calls."""
    prompts, params, ref = reference
    waves: list[int] = []
    several, _, _ = _run(tiny_llama, chains[n], "direct", prompts, params, decode_steps=4, waves=waves)
    single, _, _ = _run(tiny_llama, chains[n], "direct", prompts, params, decode_steps=1, waves=waves)
    assert several == single == ref
    assert waves[0] < waves[1], waves


@pytest.mark.parametrize("n", sorted(CHAINS))
def test_direct_chains_stream_the_samples_of_several_steps(tiny_llama, reference, chains, n, monkeypatch):
    """7 decode steps a call whose samples stream back every 3 steps (the first station's ForwardSteps): the tokens
    of one station, each part's hop reports kept."""
    prompts, params, ref = reference
    parts: list[int] = []
    real = StationClient.forward_steps

    def counted(self, *args, **kw):
        for reply in real(self, *args, **kw):
            parts.append(len(reply.output.samples))
            assert len(reply.hops) == n - 1
            yield reply

    monkeypatch.setattr(StationClient, "forward_steps", counted)
    got, pipeline, _ = _run(tiny_llama, chains[n], "direct", prompts, params, decode_steps=7, reply_steps=3)
    assert got == ref
    assert len(parts) >= 2 and all(len(h) > 0 for h in pipeline.hop_seconds), parts


@pytest.mark.parametrize("n", sorted(CHAINS))
def test_a_direct_chain_streams_long_calls_by_default(tiny_llama, reference, chains, n, monkeypatch):
    """At the default decode_steps (0: by route, SchedulerConfig.call_steps) a direct chain's decode-only calls run
    more steps than a lone station's 4 (up to 16) with their samples streamed every 4: one station's tokens."""
    prompts, params, ref = reference
    calls: list[tuple[int, int]] = []
    real = StationClient.forward_steps

    def recorded(self, wave_id, entries, token_ids, steps, reply_steps, **kw):
        calls.append((steps, reply_steps))
        yield from real(self, wave_id, entries, token_ids, steps, reply_steps, **kw)

    monkeypatch.setattr(StationClient, "forward_steps", recorded)
    got, _, _ = _run(tiny_llama, chains[n], "direct", prompts, params, decode_steps=0)
    assert got == ref
    assert calls and {r for _, r in calls} == {4} and max(s for s, _ in calls) > 4, calls


def test_a_relayed_streamed_call_ends_early_with_every_station_agreeing(tiny_llama, reference, chains):
    """EndSteps at the first station of a 3-station chain during a 20-step streamed call: its stream ends OK after
    the step under way, and a plain relayed call from the steps that came goes on at every station (a station
    whose KV held a step the orchestrator never saw would refuse it); the tokens are the request's alone."""
    first, *rest = [RemoteLink(s.address, timeout_s=30, token=TOKEN) for s in chains[3]]
    prompts, params, ref = reference
    prompt, sp = prompts[1], params[1]
    try:
        ids = [first.relay(1, (WaveEntry(63, 0, len(prompt), sp),), prompt, rest).output.samples[0].token_id]
        replies = first.relay_steps(2, (WaveEntry(63, len(prompt), 1, sp),), [ids[-1]], 20, 1, rest)
        ids += [t.token_id for t in next(replies).output.samples]
        assert first.end_steps(2) is True
        ids += [t.token_id for r in replies for t in r.output.samples]
        assert len(ids) - 1 < 20
        while len(ids) < sp.max_tokens:
            out = first.relay(3, (WaveEntry(63, len(prompt) + len(ids) - 1, 1, sp),), [ids[-1]], rest).output
            ids.append(out.samples[0].token_id)
        assert ids == ref[1]
    finally:
        for link in (first, *rest):
            link.release((63,))
            link.close()


def _mortal(model_dir, fails: int):
    """A last station [2, 6) with the cluster token whose forward call number `fails` raises; (server, calls)."""
    mortal = start_server(Station(model_dir, StationSpec(layers=(2, 6))), token=TOKEN)
    station, calls = mortal.servicer.station, []
    forward = station.forward

    def forward_then_fail(*args, **kw):
        calls.append(1)
        if len(calls) == fails:
            raise RuntimeError("the device fell off the bus")
        return forward(*args, **kw)

    station.forward = forward_then_fail
    return mortal, calls


def test_streamed_parts_stand_when_a_later_step_fails(tiny_llama, chains):
    """A streamed 4-step call in parts of 2 whose successor fails the third step: the first part comes back, then
    StationDown with the successor's failure."""
    first = RemoteLink(chains[2][0].address, timeout_s=10, token=TOKEN)
    mortal, calls = _mortal(tiny_llama, fails=4)  # the prefill, then two steps: the third fails
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    try:
        token = first.relay(1, (WaveEntry(62, 0, 3, params),), [4, 5, 6], [_Addr(mortal.address)]).output.samples[0]
        replies = first.relay_steps(2, (WaveEntry(62, 3, 1, params),), [token.token_id], 4, 2, [_Addr(mortal.address)])
        assert len(next(replies).output.samples) == 2
        with pytest.raises(StationDown, match=f"relay to {mortal.address}.*device fell off"):
            next(replies)
        assert len(calls) == 4
    finally:
        first.release((62,))
        first.close()
        mortal.stop(0)


def test_relayed_steps_equal_single_relayed_steps(tiny_llama, chains):
    """A 3-step relayed call gives, bit for bit, the samples (and logprobs) of three one-step relayed calls, with one
    report per relayed station summing the steps; a prompt chunk, or steps sent to a station after the first, is
    refused as a bad wave with the KV as before."""
    first, *rest = [RemoteLink(s.address, timeout_s=30, token=TOKEN) for s in chains[3]]
    prompt = [1, 40, 41, 42, 43]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=11, logprobs=2, ignore_eos=True)
    got = {}
    try:
        for seq, steps in ((51, 3), (52, 1)):
            reply = first.relay(1, (WaveEntry(seq, 0, len(prompt), params),), prompt, rest)
            ids = [reply.output.samples[0].token_id]
            logprobs = []
            for _ in range(3 // steps):
                pos = len(prompt) + len(ids) - 1
                reply = first.relay(2, (WaveEntry(seq, pos, 1, params),), [ids[-1]], rest, steps=steps)
                assert len(reply.output.samples) == steps and len(reply.hops) == 2
                assert all(h.forward_seconds > 0 and h.call_seconds >= h.served_seconds for h in reply.hops)
                ids += [t.token_id for t in reply.output.samples]
                logprobs += [(t.logprob, t.top_logprobs) for t in reply.output.samples]
            got[steps] = (ids, logprobs)
        assert got[3] == got[1]
        held = chains[3][0].servicer.station.kv.stats().blocks_used
        with pytest.raises(StationCallError, match="1-token entries") as refused:
            first.client.relay(3, (WaveEntry(51, 8, 2, params),), token_ids=[4, 5],
                               relay_to=[r.address for r in rest], steps=2)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(StationCallError, match="start at its first station") as refused:
            rest[0].client.relay(4, (WaveEntry(51, 8, 1, params),), hidden=_rows(1),
                                 relay_to=[rest[1].address], steps=2)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert chains[3][0].servicer.station.kv.stats().blocks_used == held
    finally:
        first.release((51, 52))
        for link in rest:
            link.release((51, 52))
            link.close()
        first.close()


def test_a_successor_failing_a_later_step_fails_the_call(tiny_llama, chains):
    """Several relayed steps whose successor fails the second: the whole call fails with the successor's status
    (StationDown: recovery replays the route), never with part of the steps' samples."""
    first = RemoteLink(chains[2][0].address, timeout_s=10, token=TOKEN)
    mortal, calls = _mortal(tiny_llama, fails=3)  # the prefill, then the first step: the second step fails
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    try:
        reply = first.relay(1, (WaveEntry(61, 0, 3, params),), [4, 5, 6], [_Addr(mortal.address)])
        token = reply.output.samples[0].token_id
        with pytest.raises(StationDown, match=f"relay to {mortal.address}.*device fell off") as down:
            first.relay(2, (WaveEntry(61, 3, 1, params),), [token], [_Addr(mortal.address)], steps=3)
        assert down.value.__cause__.code == grpc.StatusCode.INTERNAL and len(calls) == 3
    finally:
        first.release((61,))
        first.close()
        mortal.stop(0)


def test_every_hop_carries_the_token_and_mtls(tiny_llama, reference, pki_files):
    """Stations with mTLS (station certs for serving, the orchestrator's client cert for relaying) and the token:
    tokens as one station's; a relay without the client certificate is refused, not sent in the clear."""
    prompts, params, ref = reference
    serve = StationTls.from_files(pki_files["station.crt"], pki_files["station.key"], pki_files["ca.crt"])
    client = StationTls.from_files(pki_files["orchestrator.crt"], pki_files["orchestrator.key"], pki_files["ca.crt"])
    servers = [start_server(Station(tiny_llama, StationSpec(layers=r)), token=TOKEN, tls=serve, relay_tls=client)
               for r in CHAINS[2]]
    try:
        tokens, pipeline, _ = _run(tiny_llama, servers, "direct", prompts[:2], params[:2], tls=client)
        assert isinstance(pipeline, RelayPipeline) and tokens == ref[:2]
    finally:
        for s in servers:
            s.stop(0)
    servers = [start_server(Station(tiny_llama, StationSpec(layers=r)), token=TOKEN, tls=serve)  # relays as a server
               for r in CHAINS[2]]
    link = RemoteLink(servers[0].address, timeout_s=10, token=TOKEN, tls=client)
    try:
        with pytest.raises(StationDown, match="relay to"):
            link.relay(1, (WaveEntry(1, 0, 2, SamplingParams()),), [4, 5], [_Addr(servers[1].address)])
    finally:
        link.close()
        for s in servers:
            s.stop(0)


class _Addr:
    """A successor known by its address only (what relay() reads of it), without a connection of its own."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.client = self

    def note_kv(self, kv) -> None:
        """Nothing to keep."""


def test_unreachable_successor_fails_the_wave_as_a_dead_station(tiny_llama, chains):
    """The first station answers, its successor is gone: the call fails with UNAVAILABLE (StationDown, replayed by
    recovery); a relay list naming nobody valid, or asked of the last station, is refused as a bad wave."""
    first = RemoteLink(chains[2][0].address, timeout_s=10, token=TOKEN)
    dead = start_server(Station(tiny_llama, StationSpec(layers=(2, 6))), token=TOKEN)
    dead_address = dead.address
    dead.stop(0)
    entry = WaveEntry(42, 0, 3, SamplingParams())
    try:
        with pytest.raises(StationDown, match=f"relay to {dead_address}") as down:
            first.relay(1, (entry,), [4, 5, 6], [_Addr(dead_address)])
        assert down.value.__cause__.code == grpc.StatusCode.UNAVAILABLE
        first.release((42,))
        last = RemoteLink(chains[2][1].address, timeout_s=10, token=TOKEN)
        with pytest.raises(StationCallError, match="cannot relay") as refused:
            last.client.relay(2, (entry,), hidden=_rows(3), relay_to=[chains[2][0].address])
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        last.close()
        with pytest.raises(StationCallError, match=r"relay_to\[0\]: 'nowhere'") as refused:
            first.client.relay(3, (entry,), token_ids=[4, 5, 6], relay_to=["nowhere"])
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert chains[2][0].servicer.station.kv.stats().blocks_used == 0  # refused before the step
    finally:
        first.close()


def _rows(n):
    import torch

    return torch.zeros(n, 64)


def test_relay_list_and_config_are_validated():
    with pytest.raises(WireError, match=r"relay_to\[1\]"):
        decode_relay(pb.ForwardRequest(relay_to=["127.0.0.1:5", "host:port"]))
    with pytest.raises(WireError, match="relay_to: 65 stations"):
        decode_relay(pb.ForwardRequest(relay_to=["h:1"] * 65))
    assert decode_relay(pb.ForwardRequest(relay_to=["[::1]:7", "a.b:8"])) == ("[::1]:7", "a.b:8")
    with pytest.raises(ConfigError, match="scheduler.hidden_path must be one of"):
        SchedulerConfig(hidden_path="sideways")


def test_onward_request_drops_this_station_and_the_payload() -> None:
    entries = (WaveEntry(3, 7, 1, SamplingParams(max_tokens=1)), WaveEntry(4, 2, 2))
    request = encode_forward(9, entries, None, torch.ones(3, 4), relay_to=["b:2", "c:3", "d:4"])
    request.reply_steps = 1
    onward = onward_request(request)
    assert onward.wave_id == 9 and list(onward.relay_to) == ["c:3", "d:4"] and onward.entries == request.entries
    assert onward.WhichOneof("payload") is None and onward.steps == 0 and onward.reply_steps == 0
    assert list(request.relay_to) == ["b:2", "c:3", "d:4"] and request.HasField("hidden")  # the request untouched
    assert onward == pb.ForwardRequest(wave_id=9, entries=request.entries, relay_to=["c:3", "d:4"])
