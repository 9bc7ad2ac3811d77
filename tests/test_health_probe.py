"""Station health runs the forward path: a probe row every period, NOT_SERVING when a forward hangs
or the forward path breaks, SERVING again once it passes; probes leave no KV and no counters."""
from __future__ import annotations

import time

import pytest
import torch

from mesh.core.config import StationSpec
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.client import StationClient
from station.probe import ProbeConfig
from station.server import start_server
from station.step import Station

PERIOD, HANG = 0.2, 0.5


def _wait_health(client: StationClient, want: bool, within: float) -> float:
    """Seconds until client.health() == want (fails after `within`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if client.health() == want:
            return time.monotonic() - t0
        time.sleep(0.05)
    pytest.fail(f"health did not become {'SERVING' if want else 'NOT_SERVING'} within {within}s")


@pytest.fixture
def served(tiny_llama):
    station = Station(tiny_llama, StationSpec(layers=(0, 6)))
    server = start_server(station, probe=ProbeConfig(period_s=PERIOD, hang_s=HANG))
    client = StationClient(server.address, timeout_s=5)
    try:
        yield station, server, client
    finally:
        client.close()
        server.stop(0)


def test_a_forward_that_never_ends_reads_as_not_serving(served):
    station, server, client = served
    assert client.health()
    with server.servicer.lock.hold():  # a forward holding the station and never returning
        took = _wait_health(client, False, within=10)
        assert took <= HANG + 2 * PERIOD + 1.0  # detected within hang + period (+ scheduling slack)
    _wait_health(client, True, within=10)


def test_a_broken_forward_path_reads_as_not_serving(served, monkeypatch):
    station, server, client = served

    def broken() -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(station, "probe", broken)
    _wait_health(client, False, within=10)
    monkeypatch.undo()
    _wait_health(client, True, within=10)


def test_probes_leave_no_kv_and_no_counters_and_do_not_disturb_a_sequence(served, tiny_llama):
    station, server, client = served
    prompt = [1, 40, 41, 42, 300, 7]
    entry = (WaveEntry(5, 0, len(prompt), SamplingParams(max_tokens=4)),)
    ref = Station(tiny_llama, StationSpec(layers=(0, 6))).forward(entry, token_ids=torch.tensor(prompt),
                                                                  want_logits=True).logits
    forwards = station.stats().forwards
    time.sleep(6 * PERIOD)  # several probes run
    stats = station.stats()
    assert (stats.forwards, stats.kv.sequences, stats.kv.bytes_used) == (forwards, 0, 0)
    got = station.forward(entry, token_ids=torch.tensor(prompt), want_logits=True).logits
    assert torch.equal(got, ref)
    station.release([5])


def test_probe_config_is_validated():
    with pytest.raises(ValueError, match="hang_s"):
        ProbeConfig(hang_s=0)
    with pytest.raises(ValueError, match="period_s"):
        ProbeConfig(period_s="often")


def test_probe_runs_on_a_full_kv_and_takes_nothing_from_it(tiny_llama):
    station = Station(tiny_llama, StationSpec(layers=(0, 6), kv_bytes=2 * 2**20))
    blocks = station.kv.num_blocks
    per_seq = 32  # blocks of one 512-token sequence
    seqs = [(i, min(per_seq, blocks - i * per_seq)) for i in range(-(-blocks // per_seq))]  # every block
    for seq_id, n in seqs:
        prompt = [(7 * i + seq_id) % 400 + 3 for i in range(n * station.kv.block_tokens)]
        station.forward((WaveEntry(seq_id, 0, len(prompt)),), token_ids=torch.tensor(prompt))
    assert station.kv.free_blocks() == 0
    before = station.stats()
    station.probe()
    assert station.stats() == before
    station.release([seq_id for seq_id, _ in seqs])
    assert station.stats().kv.sequences == 0 and station.kv.free_blocks() == blocks
