"""A station's own Prometheus endpoint: the StationActor class run in-process (no Ray), driven over gRPC."""
from __future__ import annotations

import gc
import urllib.request

import pytest
import ray
import torch
from prometheus_client.parser import text_string_to_metric_families

from mesh.core.config import ModelConfig, SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from orchestrator.engine import Engine
from orchestrator.remote import RemoteLink
from station.actor import StationActor
from mesh.core.compute import on_compute_thread


def _samples(address: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "_created" not in text  # no creation-timestamp series beside the counters
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture
def actors(tiny_llama):
    threads = on_compute_thread(torch.get_num_threads)  # the actor pins the station threads; give them back
    made = []
    try:
        yield lambda spec: made.append(StationActor(str(tiny_llama), spec)) or made[-1]
    finally:
        for a in made:
            a.shutdown(0)
        on_compute_thread(torch.set_num_threads, threads)
        gc.unfreeze()  # a station process keeps what its start froze for life; this test process need not


def test_station_actor_serves_metrics_with_wire_bytes(tiny_llama, actors):
    cfg = ModelConfig.from_dir(tiny_llama)
    first, last = actors(StationSpec(layers=(0, 2), kv_bytes=16 * 2**20)), actors(StationSpec(layers=(2, 6)))
    for a in (first, last):
        assert a.metrics_address() and a.metrics_address() != a.address()
        info = a.info()
        assert info["metrics_address"] == a.metrics_address()
        assert info["node_id"] is None and not ray.is_initialized()  # in-process: asking placement starts no Ray
    links = [RemoteLink(first.address()), RemoteLink(last.address())]
    assert [link.describe()["metrics_address"] for link in links] == [first.metrics_address(), last.metrics_address()]
    before = _samples(first.metrics_address())
    lab0 = (("layers", "0-2"), ("station", "s0"))
    assert before[("wavemesh_station_wire_bytes_total", tuple(sorted(lab0 + (("direction", "in"),))))] == 0
    assert before[("wavemesh_station_kv_bytes_total", lab0)] == 16 * 2**20
    assert before[("wavemesh_station_load_seconds", lab0)] == pytest.approx(first.station.load_seconds)
    assert first.station.load_seconds > 0
    packed = {src: before[("wavemesh_station_packed_weights", tuple(sorted(lab0 + (("source", src),))))]
              for src in ("cache", "load")}
    assert packed == {"cache": 0, "load": len(first.station.packed_load.packed)}  # safetensors: no packed cache
    assert before[("wavemesh_station_graph_waves_total", lab0)] == 0  # a CPU station replays no CUDA graphs
    engine = Engine(links, cfg, SchedulerConfig(max_seqs=4, max_wave_tokens=64))
    try:
        out = engine.submit([1, 5, 9, 13], SamplingParams(max_tokens=5, ignore_eos=True)).result(timeout=60)[0]
        assert len(out.token_ids) == 5
    finally:
        engine.close()
        for link in links:
            link.close()
    for a, (start, end) in ((first, (0, 2)), (last, (2, 6))):
        lab = (("layers", f"{start}-{end}"), ("station", f"s{start}"))
        s = _samples(a.metrics_address())
        wire = {d: s[("wavemesh_station_wire_bytes_total", tuple(sorted(lab + (("direction", d),))))]
                for d in ("in", "out")}
        assert wire["in"] > 0 and wire["out"] > 0, wire
        assert a.server.servicer.wire_bytes == {k: int(v) for k, v in wire.items()}
        forward = sum(s[("wavemesh_station_forward_seconds_total", tuple(sorted(lab + (("phase", p),))))]
                      for p in ("prefill", "decode"))
        assert forward > 0 and s[("wavemesh_station_forwards_total", lab)] >= 5
    # a release sent while a call holds the station is queued for that call (station.station_lock), and counted
    assert before[("wavemesh_station_releases_queued_total", lab0)] == 0
    spare = RemoteLink(first.address())
    try:
        with first.server.servicer.lock.hold():
            spare.release((99,))  # the orchestrator's releases may queue: answered while the call holds the station
    finally:
        spare.close()
    assert first.server.servicer.lock.queued_releases >= 1
    # the first station sends hidden rows on: far more bytes out than the token ids it receives
    s0 = _samples(first.metrics_address())
    assert s0[("wavemesh_station_releases_queued_total", lab0)] == first.server.servicer.lock.queued_releases
    assert (s0[("wavemesh_station_wire_bytes_total", tuple(sorted(lab0 + (("direction", "out"),))))]
            > s0[("wavemesh_station_wire_bytes_total", tuple(sorted(lab0 + (("direction", "in"),))))])


def test_shutdown_stops_the_metrics_endpoint(tiny_llama):
    threads = on_compute_thread(torch.get_num_threads)
    try:
        actor = StationActor(str(tiny_llama), StationSpec(layers=(0, 6)))
        address = actor.metrics_address()
        assert _samples(address)
        actor.shutdown(0)
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{address}/metrics", timeout=5)
    finally:
        on_compute_thread(torch.set_num_threads, threads)
        gc.unfreeze()


def test_a_station_start_freezes_what_lives_as_long_as_the_process(tiny_llama, actors):
    """The imports and the loaded model leave the collector's generations (gc.freeze): a full collection during
    the load, or later while serving, does not walk them (each one took 90-130 ms of a station's start)."""
    gc.unfreeze()
    actor = actors(StationSpec(layers=(0, 6)))
    assert gc.get_freeze_count() > 0
    tracked = {id(o) for o in gc.get_objects()}  # the collector's generations; frozen objects are not in them
    assert id(actor.station.model) not in tracked and id(actor.station) not in tracked
    assert id(ModelConfig) not in tracked  # and what the imports made
