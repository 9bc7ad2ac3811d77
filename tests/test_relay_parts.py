"""A large relayed wave cut into parts (station/relay_parts.py): where it is cut, the same tokens as whole waves and
one station on 2- and 3-station chains, one merged reply, and a part that fails failing the call."""
from __future__ import annotations

import time

import grpc
import pytest
import torch

from mesh.core import config
from mesh.core.config import StationSpec
from mesh.core.params import SamplingParams
from mesh.core.proto import station_pb2 as pb
from mesh.core.wave import WaveEntry
from orchestrator.remote import RemoteLink
from station import relay_parts
from station.client import StationCallError
from station.relay_parts import merge_part_replies, part_bounds
from station.server import start_server
from station.server_limits import ServerLimits
from station.step import Station

from test_relay import CHAINS, TOKEN, _run, chains, reference  # noqa: F401 - fixtures

P = SamplingParams(max_tokens=4, ignore_eos=True)


def _wave(*rows: int) -> tuple[WaveEntry, ...]:
    return tuple(WaveEntry(i, 0, n, P) for i, n in enumerate(rows))


def test_only_large_waves_are_cut_at_entry_boundaries_into_near_equal_parts():
    cpu = StationSpec(layers=(0, 2)).part_rows
    assert cpu == 48 and StationSpec(layers=(0, 2), device="cuda").part_rows == 0
    assert StationSpec(layers=(0, 2), relay_part_rows=0).part_rows == 0
    assert part_bounds(_wave(*[1] * 64), cpu) == [(0, 64)]  # a decode wave: whole
    assert part_bounds(_wave(255), cpu) == [(0, 1)]  # one entry: whole
    assert part_bounds(_wave(*[32] * 8), cpu) == [(0, 2), (2, 4), (4, 6), (6, 8)]  # 256 rows: at most four parts
    assert part_bounds(_wave(*[32] * 8), 128) == [(0, 4), (4, 8)]
    assert part_bounds(_wave(*[32] * 7), 128) == [(0, 7)]  # 224 rows: under two parts' worth
    assert part_bounds(_wave(*[32] * 8), 0) == [(0, 8)]  # 0: never cut
    assert part_bounds(_wave(200, 10, 50), cpu) == [(0, 1), (1, 3)]
    assert part_bounds(_wave(*[10] * 12), 20, max_parts=3) == [(0, 4), (4, 8), (8, 12)]


def test_merged_reply_keeps_entry_order_the_newest_kv_and_summed_seconds():
    def part(tokens, changes, hop_changes):
        reply = pb.ForwardReply(forward_seconds=0.5, kv=pb.KVUsage(changes=changes, sequences=changes))
        reply.samples.samples.extend(pb.Sample(present=True, token_id=t) for t in tokens)
        reply.relayed.add(address="b", kv=pb.KVUsage(changes=hop_changes), forward_seconds=0.25, call_seconds=1.0)
        return reply
    merged = merge_part_replies([part([3, 4], 7, 9), part([5], 6, 8)])
    assert [s.token_id for s in merged.samples.samples] == [3, 4, 5]
    assert merged.forward_seconds == 1.0 and merged.kv.changes == 7
    assert len(merged.relayed) == 1 and merged.relayed[0].kv.changes == 9
    assert (merged.relayed[0].forward_seconds, merged.relayed[0].call_seconds) == (0.5, 2.0)


@pytest.mark.parametrize("n", sorted(CHAINS))
def test_waves_relayed_in_parts_give_one_stations_tokens(tiny_llama, reference, chains, n, monkeypatch):
    """Prompt waves cut into parts of 4 rows or more, up to 3 (a CPU station's default: 48): the
    tokens of whole waves and of one station; the successors answered more relays than waves were sent."""
    prompts, params, ref = reference
    monkeypatch.setattr(config, "CPU_PART_ROWS", 4)
    monkeypatch.setattr(relay_parts, "MAX_PARTS", 3)
    link = chains[n][1].relay_link
    before = link.requests + link.session_steps
    waves: list[int] = []
    assert _run(tiny_llama, chains[n], "direct", prompts, params, waves=waves)[0] == ref
    assert link.requests + link.session_steps - before > waves[0]


def test_a_part_that_fails_fails_the_call_and_the_chain_goes_on(tiny_llama, chains, monkeypatch):
    monkeypatch.setattr(config, "CPU_PART_ROWS", 2)
    first = RemoteLink(chains[2][0].address, timeout_s=10, token=TOKEN)
    relay_to = [chains[2][1].address]
    try:
        with pytest.raises(StationCallError, match="unknown seq_id 81") as failed:  # the second part's entry
            first.client.relay(1, (WaveEntry(80, 0, 3, P), WaveEntry(81, 5, 3, P)), token_ids=[4, 5, 6, 7, 8, 9],
                               relay_to=relay_to)
        assert failed.value.code == grpc.StatusCode.INVALID_ARGUMENT
        reply = first.client.relay(2, (WaveEntry(82, 0, 3, P), WaveEntry(83, 0, 3, P)), token_ids=[4, 5, 6, 7, 8, 9],
                                   relay_to=relay_to)
        assert len(reply.output.samples) == 2 and len(reply.hops) == 1
    finally:
        for s in chains[2]:
            s.servicer.station.release([80, 81, 82, 83])
        first.close()


@pytest.mark.parametrize("over_link", [True, False], ids=["link", "grpc"])
def test_parts_wait_their_turn_at_a_slow_successor_that_takes_one_call(tiny_llama, monkeypatch, over_link):
    """A successor that lets one call hold or wait for it (`max_pending` 1) and steps slowly: over its relay link
    the three parts of a wave wait their turn there (the link's connections bound them); over gRPC, where each would
    hold a worker, the wave goes whole. Either way the call succeeds, with one station's tokens."""
    monkeypatch.setattr(config, "CPU_PART_ROWS", 2)
    slow = Station(tiny_llama, StationSpec(layers=(2, 6)))
    step, stepped = slow.forward, []

    def slow_step(entries, **kwargs):
        stepped.append(len(entries))
        time.sleep(0.2)  # under the station lock: the next part arrives while this one holds it
        return step(entries, **kwargs)
    monkeypatch.setattr(slow, "forward", slow_step)
    servers = [start_server(Station(tiny_llama, StationSpec(layers=(0, 2))), token=TOKEN, relay_link=over_link),
               start_server(slow, limits=ServerLimits(max_pending=1), token=TOKEN, relay_link=over_link)]
    first = RemoteLink(servers[0].address, timeout_s=30, token=TOKEN)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    entries, ids = tuple(WaveEntry(90 + i, 0, 3, greedy) for i in range(3)), list(range(4, 13))
    try:
        reply = first.client.relay(1, entries, token_ids=ids, relay_to=[servers[1].address])
        alone = Station(tiny_llama, StationSpec(layers=(0, 6))).forward(entries, token_ids=torch.tensor(ids))
        assert [s.token_id for s in reply.output.samples] == [s.token_id for s in alone.samples]
        assert stepped == ([1, 1, 1] if over_link else [3])  # three parts of one entry each, or the wave whole
    finally:
        first.close()
        for server in servers:
            server.stop(0)
