"""A station as a Ray actor: launched over the tiny checkpoint, driven over its gRPC address, restarted."""
from __future__ import annotations

import os
import signal

import pytest

from mesh.core.config import StationSpec
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.client import StationClient
from station.generate import generate_one
from station.step import Station

ray = pytest.importorskip("ray")
from station.actor import launch_station, station_address, stop_station  # after importorskip: needs ray

PROMPT = [1, 17, 300, 45, 99, 7]
STEPS = 8
GREEDY = SamplingParams(max_tokens=STEPS, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_local():
    """A local, loopback-only Ray with 2 CPUs and no dashboard, shut down after the module."""
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", object_store_memory=80 * 2**20,
             log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def _generate(address: str, seq_id: int) -> list[int]:
    """Greedy generation through one whole-model station at `address`."""
    tokens, pos = list(PROMPT), 0
    with StationClient(address, timeout_s=60) as client:
        for wave in range(STEPS):
            entry = WaveEntry(seq_id, pos, len(tokens) - pos, GREEDY)
            res = client.forward(wave, (entry,), token_ids=tokens[pos:])
            pos = len(tokens)
            tokens.append(res.samples[0].token_id)
        assert client.release([seq_id]) == 1
    return tokens[len(PROMPT):]


def test_actor_serves_generation_and_restarts_after_a_crash(ray_local, tiny_llama):
    expected, _ = generate_one(Station(tiny_llama, StationSpec(layers=(0, 6))), PROMPT, GREEDY)
    spec = StationSpec(layers=(0, 6), num_cpus=1)
    handle, address = launch_station(tiny_llama, spec, name="station-0", max_restarts=1)
    try:
        assert ray.get(handle.ready.remote())
        assert _generate(address, seq_id=1) == expected
        info = ray.get(handle.info.remote())
        assert (info["layer_start"], info["layer_end"], info["num_layers"]) == (0, 6, 6)
        assert info["address"] == address and info["sequences"] == 0 and info["kv_bytes_total"] > 0
        assert ray.get_actor("station-0") is not None

        pid = ray.get(handle.pid.remote())
        os.kill(pid, signal.SIGKILL)  # the station crashes; Ray restarts the actor
        new_address = station_address(handle, timeout_s=120)
        assert ray.get(handle.pid.remote()) != pid
        # a restarted station binds a fresh free port (the old one is not reserved for it): always re-read
        assert _generate(new_address, seq_id=2) == expected
    finally:
        stop_station(handle)


def test_two_one_core_stations_own_disjoint_cores_and_take_theirs_back_after_a_restart(ray_local, tiny_llama):
    """Two 1-core stations on this Ray node: each is pinned to its own core (where the machine has two) and runs
    one torch thread; a station that crashes and restarts claims a core the other does not hold."""
    spec = StationSpec(layers=(0, 6), num_cpus=1)
    (a, _), (b, _) = (launch_station(tiny_llama, spec, max_restarts=1) for _ in range(2))
    try:
        pa, pb = ray.get([a.placement.remote(), b.placement.remote()])
        assert pa["torch_threads"] == 1 and pb["torch_threads"] == 1
        if len(os.sched_getaffinity(0)) < 2:  # one core: nothing to share out, and each says why
            assert not pa["cpu_pinned"] and "not pinned" in pb["cpu_pinning_note"]
            return
        assert pa["cpu_pinned"] and pb["cpu_pinned"], (pa, pb)
        assert len(pa["cpu_affinity"]) == 1 and len(pb["cpu_affinity"]) == 1
        assert set(pa["cpu_affinity"]).isdisjoint(pb["cpu_affinity"]), (pa, pb)
        info = ray.get(a.info.remote())  # the same placement, beside the station's Info
        assert info["cpu_affinity"] == pa["cpu_affinity"] and info["torch_threads"] == 1

        os.kill(pb["pid"], signal.SIGKILL)  # its core's claim ends with its process
        station_address(b, timeout_s=120)
        again = ray.get(b.placement.remote())
        assert again["pid"] != pb["pid"] and again["cpu_pinned"], again
        assert set(again["cpu_affinity"]).isdisjoint(pa["cpu_affinity"]), (pa, again)
    finally:
        stop_station(a)
        stop_station(b)
