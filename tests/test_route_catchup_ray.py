"""Make before break with station processes (issue 14): SIGKILL a station of the new route, or of the old one,
while the new route catches up (by KV copy, or recompute); every stream completes with the tokens of a cluster
that never changed."""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

import pytest

from mesh.core.config import SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from orchestrator.route_switch import CatchUpFailed
from reference import reference_tokens

ray = pytest.importorskip("ray")


def _jobs(n=16, prompt=300, max_tokens=400):
    prompts = [[1] + [(29 * i + 13 * j) % 500 + 5 for j in range(prompt - 1)] for i in range(n)]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.9,
                             seed=700 + i) for i in range(n)]
    return prompts, params


def _cluster(model_dir, catchup_wave_tokens=16, max_wave_tokens=64, catchup_slowdown=1.75, catchup_kv="copy"):
    from mesh.control.cluster import Cluster
    from mesh.control.mesh_config import ClusterConfig, MeshConfig, ModelSource

    cfg = MeshConfig(model=ModelSource(path=str(model_dir)), stations=(StationSpec(layers=(0, 6)),),
                     scheduler=SchedulerConfig(max_seqs=16, max_wave_tokens=max_wave_tokens,
                                               catchup_wave_tokens=catchup_wave_tokens,
                                               catchup_copy_tokens=catchup_wave_tokens,
                                               catchup_slowdown=catchup_slowdown, catchup_kv=catchup_kv),
                     cluster=ClusterConfig(call_timeout_s=5, restart_timeout_s=60))
    cluster = Cluster(cfg, model_dir, progress=lambda msg: None)
    cluster.start()
    return cluster


def _pid(cluster, spec):
    return ray.get(cluster._actors[spec].pid.remote(), timeout=30)


@pytest.mark.parametrize("victim, source", [("new", "copy"), ("old", "copy"), ("new", "recompute")])
def test_sigkill_of_a_station_during_catchup_keeps_every_token(local_ray, tiny_llama, victim, source):
    """A new-route station SIGKILLed mid catch-up: the re-plan is abandoned with the reason and the old route
    serves on. An old-route station SIGKILLed mid catch-up: the route switches at once to the new stations,
    which recompute what the copy had not brought. Either way every stream's tokens equal a cluster that never
    changed."""
    prompts, params = _jobs()
    ref = reference_tokens(tiny_llama, prompts, params)
    cluster = _cluster(tiny_llama, catchup_kv=source)
    try:
        old_specs = cluster.specs
        new_specs = cluster.prepare(tuple(StationSpec(layers=r) for r in ((0, 3), (3, 6))))  # loaded beside
        streams = [cluster.engine.submit(p, sp) for p, sp in zip(prompts, params)]
        deadline = time.monotonic() + 120
        while cluster.engine.stats().decode_tokens < 16 * 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        outcome = {}

        def reroute():
            try:
                outcome["specs"] = cluster.reroute(new_specs)
            except Exception as e:  # noqa: BLE001 - inspected below
                outcome["error"] = e

        switch = threading.Thread(target=reroute)
        switch.start()
        while switch.is_alive() and time.monotonic() < deadline:
            cu = cluster.engine.stats().route_catchup
            if cu is not None and cu.waves >= 4 and cu.tokens_behind > 16 * 16:
                break
            time.sleep(0.005)
        assert switch.is_alive() and cu is not None and cu.tokens_behind > 0, "the catch-up ended before the kill"
        os.kill(_pid(cluster, new_specs[1] if victim == "new" else old_specs[0]), signal.SIGKILL)
        switch.join(240)
        assert not switch.is_alive()
        if victim == "new":
            assert isinstance(outcome.get("error"), CatchUpFailed), outcome
            assert "new-route station failed" in str(outcome["error"]) and cluster.specs == old_specs
        else:
            assert outcome.get("specs") == new_specs and cluster.specs == new_specs, outcome
            assert cluster.engine.switch_reports[-1].mode == "catchup"
        outs = [s.result(timeout=300)[0] for s in streams]
        assert [o.token_ids for o in outs] == ref
        assert cluster.engine.stats().route_catchup is None
        after = cluster.engine.submit(prompts[0], params[0]).result(timeout=120)[0]  # serves afterwards
        assert after.token_ids == ref[0]
    finally:
        cluster.stop()


def test_reroute_1_2_3_1_over_station_processes_moves_every_stream_by_catch_up(local_ray, tiny_llama):
    """1 -> 2 -> 3 -> 1 over station processes (the path `mesh scale` takes, with every plan's stations loaded
    beside the route first, so each switch happens mid-stream whatever the machine's speed) while 8 greedy and 8
    seeded streams decode: each switch is made before the break (the old route committed tokens of every stream
    during the catch-up, and each had a short chunk left at the switch), and every stream's tokens equal a
    cluster that never changed."""
    prompts, params = _jobs(prompt=120, max_tokens=880)
    ref = reference_tokens(tiny_llama, prompts, params)
    cluster = _cluster(tiny_llama, catchup_wave_tokens=256, max_wave_tokens=256, catchup_slowdown=0)  # unpaced
    try:
        plans = [cluster.prepare(tuple(StationSpec(layers=r) for r in ranges))
                 for ranges in (((0, 3), (3, 6)), ((0, 2), (2, 4), (4, 6)))]
        plans.append(cluster.prepare((StationSpec(layers=(0, 6), kv_bytes=64 * 2**20),)))  # a new full station
        streams = [cluster.engine.submit(p, sp) for p, sp in zip(prompts, params)]
        for specs in plans:
            before = cluster.engine.stats().decode_tokens
            deadline = time.monotonic() + 120
            while cluster.engine.stats().decode_tokens < before + 16 * 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert cluster.reroute(specs) == specs
            report = cluster.engine.switch_reports[-1]
            print(f"\nto {len(specs)} station(s): catch-up {report.catchup_seconds:.2f} s, {report.catchup_tokens} "
                  f"tokens, pause {report.pause_seconds * 1e3:.1f} ms, residual max {max(report.residual.values())}")
            assert report.mode == "catchup" and len(report.residual) == 16 and not report.replayed
            assert all(report.decoded_during_catchup.get(s, 0) >= 1 for s in report.residual)
            assert sum(report.residual.values()) <= 256  # one wave's worth (max_wave_tokens)
        outs = [s.result(timeout=300)[0] for s in streams]
        assert [o.token_ids for o in outs] == ref
        print(f"engine pauses (longest wait of a stream): {cluster.engine.stats().route_switch_pauses}")
    finally:
        cluster.stop()


def test_add_station_with_layers_loads_fresh_copies_of_kept_stations_and_catches_up(local_ray, tiny_llama):
    """`mesh add-station --layers 1-3` on [0, 3) + [3, 6) keeps [3, 6) in the new plan: it is loaded again as a
    fresh copy beside the serving one, so the switch is made before the break (a KV copy, not a pause); the old
    copy is retired after it, and every stream's tokens equal a cluster that never changed."""
    prompts, params = _jobs(n=8, prompt=120, max_tokens=600)
    ref = reference_tokens(tiny_llama, prompts, params)
    cluster = _cluster(tiny_llama, catchup_wave_tokens=256, max_wave_tokens=256)
    try:
        two = cluster.reroute(tuple(StationSpec(layers=r) for r in ((0, 3), (3, 6))))
        # the plan add-station makes, loaded first (so the switch happens mid-stream whatever the machine's speed)
        cluster.prepare((StationSpec(layers=(0, 1)), StationSpec(layers=(1, 3)), replace(two[1], copy=1)))
        streams = [cluster.engine.submit(p, sp) for p, sp in zip(prompts, params)]
        deadline = time.monotonic() + 120
        while cluster.engine.stats().decode_tokens < 8 * 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        specs = cluster.add_station(layers=(1, 3))
        assert [s.layers for s in specs] == [(0, 1), (1, 3), (3, 6)]
        assert specs[2].copy == two[1].copy + 1 and two[1] not in cluster._actors  # a fresh copy; the old one retired
        report = cluster.engine.switch_reports[-1]
        assert report.mode == "catchup" and report.kv_source == "copy" and set(report.residual.values()) == {1}
        outs = [s.result(timeout=300)[0] for s in streams]
        assert [o.token_ids for o in outs] == ref
    finally:
        cluster.stop()
