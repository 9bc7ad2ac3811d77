"""The mesh: station actors behind gRPC, pipelined waves, and growth while serving (local Ray)."""
from __future__ import annotations

import pytest

from mesh.control.mesh_config import MeshConfig, ModelSource
from mesh.core.config import SchedulerConfig, StationSpec
from mesh.control.cluster import Cluster
from mesh.core.params import SamplingParams
from reference import reference_tokens

ray = pytest.importorskip("ray")


def _jobs(n, max_tokens=12):
    prompts = [[1] + [(29 * i + 13 * j) % 500 + 5 for j in range(2 + (11 * i) % 30)] for i in range(n)]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.8,
                             seed=300 + i) for i in range(n)]
    return prompts, params


def _cluster(model_dir, ranges, hidden_path="direct", decode_steps=4):
    cfg = MeshConfig(model=ModelSource(path=str(model_dir)),
                     stations=tuple(StationSpec(layers=r) for r in ranges),
                     scheduler=SchedulerConfig(max_seqs=16, max_wave_tokens=64, hidden_path=hidden_path,
                                               decode_steps=decode_steps))
    cluster = Cluster(cfg, model_dir, progress=lambda msg: None)
    cluster.start()
    return cluster


@pytest.mark.parametrize("ranges", [((0, 6),), ((0, 2), (2, 6)), ((0, 1), (1, 4), (4, 6))])
def test_stations_over_grpc_match_in_process(local_ray, tiny_llama, ranges):
    prompts, params = _jobs(8)
    reference = reference_tokens(tiny_llama, prompts, params)
    cluster = _cluster(tiny_llama, ranges)
    try:
        streams = [cluster.engine.submit(p, sp) for p, sp in zip(prompts, params)]
        assert [s.result(timeout=120)[0].token_ids for s in streams] == reference
        status = cluster.status()
        assert [s["layers"] for s in status["stations"]] == [list(r) for r in ranges]
        assert all(s["healthy"] for s in status["stations"])
        from station.client import StationCallError, StationClient
        with StationClient(status["stations"][0]["address"], timeout_s=10) as stranger:  # no cluster token
            with pytest.raises(StationCallError, match="UNAUTHENTICATED"):
                stranger.info()
        assert cluster.engine.quiesce(30) and cluster.engine.stats().kv_bytes_used == 0
    finally:
        cluster.stop()


@pytest.mark.parametrize("hidden_path", ["direct", "hub"])
def test_scale_while_serving_keeps_every_token(local_ray, tiny_llama, hidden_path):
    """1 -> 3 -> 1 -> 2 stations while 8 requests stream: every token equals the never-changed reference, with
    hidden rows station to station (direct) or through the orchestrator (hub)."""
    prompts, params = _jobs(8, max_tokens=960)  # the most the context (1024) holds: each switch while they stream
    reference = reference_tokens(tiny_llama, prompts, params)
    # one decode step per call, so the one-station phases go no faster than the switches need (several steps per
    # call through route switches: tests/test_route_catchup.py's 1 -> 2 -> 3 -> 1)
    cluster = _cluster(tiny_llama, ((0, 6),), hidden_path, decode_steps=1)
    try:
        first = list(cluster._actors.values())
        # every plan's stations are loaded beside the route before the requests start, so each switch
        # happens while they stream whatever the machine's speed (the full-model station of step 2 is a
        # new spec, with a smaller KV budget, since the first one is retired at step 1)
        small = 64 * 2**20
        three = cluster.prepare(tuple(StationSpec(layers=r) for r in ((0, 2), (2, 4), (4, 6))))
        one = cluster.prepare((StationSpec(layers=(0, 6), kv_bytes=small),))
        cluster.prepare(tuple(StationSpec(layers=r, kv_bytes=small) for r in ((0, 4), (4, 6))))
        streams = [cluster.engine.submit(p, sp) for p, sp in zip(prompts, params)]
        steps = ((3, lambda: cluster.reroute(three)), (1, lambda: cluster.reroute(one)),
                 (2, lambda: cluster.add_station((4, 6))))
        for target, grow in steps:
            assert not any(s.done for s in streams), "requests ended before the route changed"
            specs = grow()
            assert len(specs) == target
            assert cluster.engine.pipeline.hidden_path == (hidden_path if target > 1 else "hub")
            assert [s["layers"] for s in cluster.status()["stations"]] == [list(s.layers) for s in specs]
        assert [list(s.layers) for s in cluster.specs] == [[0, 4], [4, 6]]
        switches, serving = len(cluster.engine.switch_reports), cluster.specs
        assert cluster.reroute(serving) == serving and len(cluster.engine.switch_reports) == switches  # a no-op
        outs = [s.result(timeout=300)[0] for s in streams]
        first_diff = [next((j for j, (a, b) in enumerate(zip(o.token_ids, r)) if a != b), None)
                      for o, r in zip(outs, reference)]
        assert first_diff == [None] * len(outs), (first_diff, cluster.engine.stats())
        assert all(o.finish_reason == "length" for o in outs)
        assert cluster.engine.quiesce(30) and cluster.engine.stats().kv_bytes_used == 0
        assert len(cluster._actors) == 2 and all(spec in cluster._actors for spec in cluster.specs)
        for handle in first:  # the first full-model station was retired and its actor ended
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(handle.pid.remote(), timeout=30)
    finally:
        cluster.stop()


def test_impossible_placement_is_refused_at_once_and_starts_nothing(local_ray, tiny_llama):
    """add-station asking for a GPU on a CPU-only Ray, or for an infinite number of them, is refused before
    any actor starts, naming the resource; the route keeps serving (issue 17 items 2 and 3)."""
    from mesh.core.config import ConfigError

    def alive() -> float:  # CPUs held by actors (every station holds one): an actor started would show here
        return ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0.0)

    cluster = _cluster(tiny_llama, ((0, 6),))
    try:
        before = alive()
        with pytest.raises(ConfigError, match=r"num_gpus=1 but no node of this Ray cluster has that much GPU"):
            cluster.add_station(num_gpus=1)
        with pytest.raises(ConfigError, match=r"num_gpus: expected a finite number >= 0, got inf"):
            cluster.add_station(num_gpus=float("inf"))
        assert alive() == before and len(cluster._actors) == 1
        prompts, params = _jobs(2)
        assert [o.token_ids for s in [cluster.engine.submit(p, sp) for p, sp in zip(prompts, params)]
                for o in s.result(timeout=120)] == reference_tokens(tiny_llama, prompts, params)
    finally:
        cluster.stop()
