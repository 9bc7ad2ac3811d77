"""Stations placed across Ray nodes by their `resources` (issue 13 item 3), on a two-node Ray on this machine.

One Ray cluster for the module (`ray.cluster_utils.Cluster`, both nodes on 127.0.0.1, its own RAY_TMPDIR so no
other Ray on this machine finds it): the head advertises `wm_node_a`, the worker `wm_node_b`. `mesh up` joins it
(`ray: {address: ...}`) as a separate process, the way a user runs it on a cluster's head; Ray's actor table
(read through the cluster's GCS) says which node holds each station.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402 - after importorskip

from mesh.control.ray_connect import loopback_node  # noqa: E402
from test_cli_up import _wait_healthy  # noqa: E402 - one way to wait for `mesh up`

STATION_CLASS = "StationActor"


@pytest.fixture(scope="module")
def two_nodes():
    """A head node with 2 CPUs and `wm_node_a`, a worker node with 2 CPUs and `wm_node_b`, both on loopback."""
    tmp = f"/tmp/wmp-{os.getpid()}"  # short: Ray's socket paths must stay under 107 bytes
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_AUTH_MODE")}
    os.environ["RAY_TMPDIR"] = tmp  # the cluster's session and its `ray_current_cluster` file stay in here
    # as `mesh up` below runs: an earlier in-process ray.init turns token auth on in this process's environment
    # when ~/.ray/auth_token exists, and a cluster started so refuses the unauthenticated `mesh up`
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        with loopback_node():
            cluster = Cluster(initialize_head=True, head_node_args=dict(
                num_cpus=2, resources={"wm_node_a": 1}, node_ip_address="127.0.0.1", include_dashboard=False))
            try:
                worker = cluster.add_node(num_cpus=2, resources={"wm_node_b": 1}, node_ip_address="127.0.0.1")
            except BaseException:
                cluster.shutdown()
                raise
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        yield SimpleNamespace(cluster=cluster, address=cluster.address, tmp=tmp,
                              node_a=cluster.head_node.node_id, node_b=worker.node_id)
    finally:
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _mesh_up(nodes, tmp_path, port: int, model_dir, stations_yaml: str) -> tuple[subprocess.Popen, str]:
    """`mesh up` of `model_dir` joining the two-node cluster, with these `stations:` lines; (process, base URL)."""
    cfg = tmp_path / "placed.yaml"
    cfg.write_text(f"ray: {{address: '{nodes.address}'}}\nmodel: {{path: {model_dir}}}\n"
                   f"stations:\n{stations_yaml}scheduler: {{max_seqs: 4, max_wave_tokens: 32}}\n"
                   f"api: {{host: 127.0.0.1, port: {port}}}\ncluster: {{restart_timeout_s: 60}}\n")
    env = dict(os.environ, WAVEMESH_CACHE=str(tmp_path / "cache"), RAY_AUTH_MODE="disabled", RAY_TMPDIR=nodes.tmp,
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")  # this driver's node address is loopback, as the nodes'
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "mesh.control.cli", "up", str(cfg)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def _live_stations(nodes) -> dict[int, str]:
    """{pid: node id} of every station actor Ray holds ALIVE on this cluster."""
    table = nodes.cluster.global_state.actor_table(None)
    return {int(a["Pid"]): a["Address"]["NodeID"] for a in table.values()
            if a["State"] == "ALIVE" and a.get("ActorClassName", a.get("ClassName", "")).endswith(STATION_CLASS)}


def _get(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def test_each_station_runs_on_the_node_its_resources_name_and_dies_with_a_killed_mesh_up(two_nodes, tmp_path,
                                                                                          tiny_llama, free_port):
    stations = "  - {layers: [0, 3], resources: {wm_node_b: 1}}\n  - {layers: [3, 6], resources: {wm_node_a: 1}}\n"
    proc, url = _mesh_up(two_nodes, tmp_path, free_port(), tiny_llama, stations)
    try:
        _wait_healthy(url, timeout=240, proc=proc)
        status = _get(url + "/v1/status")
        by_layers = {tuple(s["layers"]): s for s in status["stations"]}
        live = _live_stations(two_nodes)
        assert live[by_layers[(0, 3)]["pid"]] == two_nodes.node_b, (live, status)  # Ray's record, not ours
        assert live[by_layers[(3, 6)]["pid"]] == two_nodes.node_a, (live, status)
        assert by_layers[(0, 3)]["node_id"] == two_nodes.node_b and by_layers[(3, 6)]["node_id"] == two_nodes.node_a
        body = json.dumps({"prompt": [1, 5, 9], "max_tokens": 8, "ignore_eos": True, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
        assert reply["usage"]["completion_tokens"] == 8
        proc.kill()  # SIGKILL: no drain, no cleanup code of ours runs
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _live_stations(two_nodes) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _live_stations(two_nodes) == {}, "station actors outlived the killed mesh up"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_a_resource_no_node_has_is_refused_before_any_station_starts(two_nodes, tmp_path, tiny_llama, free_port):
    before = len(two_nodes.cluster.global_state.actor_table(None))
    stations = "  - {layers: [0, 3], resources: {wm_node_a: 1}}\n  - {layers: [3, 6], resources: {wm_node_c: 1}}\n"
    proc, url = _mesh_up(two_nodes, tmp_path, free_port(), tiny_llama, stations)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 2, out[-3000:]
    assert "station [3, 6): resources.wm_node_c=1 but no node of this Ray cluster has that much wm_node_c" in out, out
    assert "wm_node_a, wm_node_b" in out and "loading" not in out, out[-3000:]
    assert len(two_nodes.cluster.global_state.actor_table(None)) == before  # no actor was ever created


def test_placement_needs_one_node_with_everything_a_station_asks_for():
    """No Ray: the check over node records. Each resource exists somewhere, but a station needs them on one node."""
    from mesh.control.placement import check_placement
    from mesh.core.config import ConfigError, StationSpec

    nodes = [{"Alive": True, "Resources": {"CPU": 4.0, "wm_node_a": 1.0}},
             {"Alive": True, "Resources": {"CPU": 4.0, "GPU": 1.0, "wm_node_b": 1.0}},
             {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0, "wm_node_a": 1.0}}]  # a dead node holds nothing
    check_placement((StationSpec((0, 3), num_gpus=1, resources=(("wm_node_b", 1.0),)),), nodes)
    with pytest.raises(ConfigError, match=r"station \[0, 3\): no single node of this Ray cluster has "
                                          r"num_gpus=1, num_cpus=1, resources.wm_node_a=1 at once"):
        check_placement((StationSpec((0, 3), num_gpus=1, resources=(("wm_node_a", 1.0),)),), nodes)
    with pytest.raises(ConfigError, match=r"station \[3, 6\): resources.wm_node_a=2 but no node .* \(largest: 1\); "
                                          r"custom resources on its nodes: wm_node_a, wm_node_b$"):
        check_placement((StationSpec((3, 6), resources=(("wm_node_a", 2.0),)),), nodes)
    with pytest.raises(ConfigError, match=r"station \[0, 6\): num_gpus=2 but no node .* GPU \(largest: 1\)$"):
        check_placement((StationSpec((0, 6), num_gpus=2),), nodes)
