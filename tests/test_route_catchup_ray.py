"""Make before break with station processes (issue 14): SIGKILL a station of the new route, or of the old one,
while the new route catches up; every stream completes with the tokens of a cluster that never changed."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from mesh.core.config import SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from orchestrator.route_switch import CatchUpFailed
from station.generate import generate_one
from station.step import Station

ray = pytest.importorskip("ray")


def _jobs(n=16, prompt=300, max_tokens=400):
    prompts = [[1] + [(29 * i + 13 * j) % 500 + 5 for j in range(prompt - 1)] for i in range(n)]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.9,
                             seed=700 + i) for i in range(n)]
    return prompts, params


def _cluster(model_dir):
    from mesh.control.cluster import Cluster
    from mesh.control.cluster_yaml import ClusterConfig, MeshConfig, ModelSource

    cfg = MeshConfig(model=ModelSource(path=str(model_dir)), stations=(StationSpec(layers=(0, 6)),),
                     scheduler=SchedulerConfig(max_seqs=16, max_wave_tokens=64, catchup_wave_tokens=16),
                     cluster=ClusterConfig(call_timeout_s=5, restart_timeout_s=60))
    cluster = Cluster(cfg, model_dir, progress=lambda msg: None)
    cluster.start()
    return cluster


def _pid(cluster, spec):
    return ray.get(cluster._actors[spec].pid.remote(), timeout=30)


@pytest.mark.parametrize("victim", ["new", "old"])
def test_sigkill_during_catchup_keeps_every_token(local_ray, tiny_llama, victim):
    """A new-route station SIGKILLed mid catch-up: the re-plan is abandoned with the reason and the old route
    serves on. An old-route station SIGKILLed mid catch-up: the route switches at once to the new stations, which
    replay what they lacked. Either way every stream's tokens equal a cluster that never changed."""
    prompts, params = _jobs()
    one = Station(tiny_llama, StationSpec(layers=(0, 6)))
    ref = [generate_one(one, p, sp)[0] for p, sp in zip(prompts, params)]
    cluster = _cluster(tiny_llama)
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
