"""deploy/: the Dockerfile, the KubeRay manifest, the Prometheus config and the Grafana dashboard agree
with the code (config schema, exported metric names, targets file), and `mesh up` writes that file."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from mesh.control.cluster_yaml import mesh_config_from_dict
from mesh.control.mesh_config import ClusterConfig, MeshConfig, ModelSource
from mesh.core.config import ApiConfig, StationSpec
from mesh.control.targets import claim_targets, clean_stale_targets, release_targets
from mesh.control.up import down, file_sd_targets, state_file, write_targets
from orchestrator.engine import EngineStats
from orchestrator.metrics import MetricsRegistry, RequestRecord
from station.metrics import StationMetrics
from station.step import Station

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
NAME = re.compile(r"wavemesh_[A-Za-z0-9_]+")


def _dashboard() -> dict:
    return json.loads((DEPLOY / "grafana-dashboard.json").read_text())


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def _expositions(model_dir) -> tuple[str, str]:
    """The text of the orchestrator's registry and of a station's endpoint (after one request)."""
    stats = EngineStats(running=1, waiting=0, waves_in_flight=1, waves=3, wave_occupancy_last=0.5,
                        wave_occupancy_mean=0.5, wave_occupancy_max=0.5, prefill_tokens=4, decode_tokens=2,
                        prefill_tokens_per_s=1.0, decode_tokens_per_s=1.0, kv_bytes_used=1, kv_bytes_total=2,
                        preemptions=0, refusals={"queue_full": 1})
    registry = MetricsRegistry(lambda: stats)
    registry.observe_request(RequestRecord(4, 2, ("length",), 0.1, 0.2, 0.01, (0.05,)))
    registry.observe_wave(4, 0.5, 0.01)
    registry.observe_rejection("invalid")
    station = StationMetrics(Station(model_dir, StationSpec(layers=(0, 6))), wire=lambda: {"in": 1, "out": 2})
    return registry.render().decode(), station.render().decode()


def _exported_names(model_dir) -> set[str]:
    """Every sample name the orchestrator's registry and a station's endpoint expose (after one request)."""
    return {s.name for text in _expositions(model_dir)
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# every sample name /metrics of the orchestrator and of a station exposes: the names dashboards and alerts use
EXPORTED = {f"wavemesh_{n}" for n in (
    *(f"{h}_{part}" for h in ("e2e_request_latency_seconds", "inter_token_latency_seconds",
                              "request_queue_time_seconds", "time_to_first_token_seconds", "wave_duration_seconds",
                              "wave_occupancy", "wave_tokens", "route_switch_pause_seconds", "recovery_seconds")
      for part in ("bucket", "count", "sum")),
    "route_switches_total", "recoveries_total", "waves_ended_early_total", "route_catchup_tokens_total",
    "route_replayed_sequences_total",
    "route_catchup_in_progress", "route_catchup_tokens_behind",
    "generation_tokens_total", "prompt_tokens_total", "request_success_total", "requests_rejected_total",
    "num_preemptions_total", "client_disconnects_total", "waves_total", "wave_prefill_rows_total",
    "wave_decode_rows_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
    "prefix_cache_blocks", "prefix_cache_bytes", "prefix_cache_enabled",
    "kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "num_waves_in_flight",
    "station_forward_seconds_total", "station_forwards_total", "station_rows_total", "station_wire_bytes_total",
    "station_kv_bytes_total", "station_kv_bytes_used", "station_sequences", "station_load_seconds",
    "station_packed_weights", "station_graph_waves_total", "station_graph_captures_total",
    "station_releases_queued_total")}


def test_no_created_series_and_every_name_kept(tiny_llama):
    """Neither /metrics has a `_created` series (prometheus_client's per-Counter/Histogram timestamp); the rest stays."""
    orchestrator, station = _expositions(tiny_llama)
    for text in (orchestrator, station):
        assert [line for line in text.splitlines() if "_created" in line] == []
    assert _exported_names(tiny_llama) == EXPORTED


def test_dashboard_queries_only_exported_metrics(tiny_llama):
    dashboard = _dashboard()
    exported = _exported_names(tiny_llama)
    wanted = {n for e in _exprs(dashboard) for n in NAME.findall(e)}
    assert wanted <= exported, sorted(wanted - exported)
    for p in dashboard["panels"]:
        assert p["title"] and p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    assert any(v["type"] == "datasource" and v["name"] == "datasource" for v in dashboard["templating"]["list"])


def test_dashboard_has_the_panels_operators_need():
    exprs = "\n".join(_exprs(_dashboard()))
    for q in ("0.5", "0.99"):
        for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
            assert re.search(rf"histogram_quantile\({q}, sum by \(le\) \(rate\(wavemesh_{hist}_bucket\[", exprs), (q, hist)
    for needle in ("rate(wavemesh_generation_tokens_total[", "wavemesh_num_requests_running",
                   "wavemesh_num_requests_waiting", "wavemesh_wave_occupancy_", "wavemesh_station_kv_bytes_used",
                   "wavemesh_station_kv_bytes_total", "wavemesh_station_forward_seconds_total"):
        assert needle in exprs, needle
    assert "by (station, layers" in exprs  # per-station panels keep the station apart


def _kuberay() -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "kuberay-raycluster.yaml").read_text()))


def test_kuberay_manifest_runs_mesh_up_from_a_valid_cluster_yaml():
    docs = {d["kind"] + "/" + d["metadata"]["name"]: d for d in _kuberay()}
    cfg = mesh_config_from_dict(yaml.safe_load(docs["ConfigMap/wavemesh-cluster"]["data"]["cluster.yaml"]),
                                "kuberay:cluster.yaml", check_paths=False)
    assert cfg.ray.address == "auto" and cfg.api.host == "0.0.0.0" and cfg.cluster.station_host == "0.0.0.0"
    ray = docs["RayCluster/wavemesh"]
    assert ray["apiVersion"] == "ray.io/v1"
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]
    main = head["containers"][0]
    assert "exec mesh up /etc/wavemesh/cluster.yaml" in main["args"][0]
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    volumes = {v["name"]: v for v in head["volumes"]}
    assert mounts["cluster-config"] == "/etc/wavemesh"
    assert volumes["cluster-config"]["configMap"]["name"] == "wavemesh-cluster"
    assert Path(cfg.cluster.targets_file).parent == Path(mounts["targets"])  # shared with the sidecar
    assert any(p["containerPort"] == cfg.api.port for p in main["ports"])
    workers = ray["spec"]["workerGroupSpecs"]
    assert any(c["resources"]["limits"].get("nvidia.com/gpu") for w in workers
               for c in w["template"]["spec"]["containers"])
    # the sidecar's Prometheus config is deploy/prometheus.yml, reading the same targets file
    embedded = yaml.safe_load(docs["ConfigMap/wavemesh-prometheus"]["data"]["prometheus.yml"])
    assert embedded == yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert cfg.cluster.targets_file in _file_sd_files(embedded)


def _file_sd_files(prom: dict) -> set[str]:
    return {f for job in prom["scrape_configs"] for sd in job.get("file_sd_configs", []) for f in sd["files"]}


def test_prometheus_config_reads_the_targets_file():
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert prom["scrape_configs"] and all("file_sd_configs" in job for job in prom["scrape_configs"])
    multi = mesh_config_from_dict(yaml.safe_load((DEPLOY / "multi-node.yaml").read_text()), check_paths=False)
    assert multi.cluster.targets_file in _file_sd_files(prom)


@pytest.mark.parametrize("path", sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kuberay-raycluster.yaml"))
def test_cluster_examples_validate(path):
    mesh_config_from_dict(yaml.safe_load((DEPLOY / path).read_text()), path, check_paths=False)


def test_dockerfile_pins_torch_first_and_runs_mesh_up():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines()]
    assert lines[[i for i, ln in enumerate(lines) if ln and not ln.startswith("#")][0]] == "FROM python:3.11-slim"
    assert any(ln.startswith("ARG TORCH_SPEC=") for ln in lines)
    torch_at = next(i for i, ln in enumerate(lines) if ln.startswith("RUN pip install") and "TORCH_SPEC" in ln)
    project_at = next(i for i, ln in enumerate(lines) if ln.startswith("RUN pip install ."))
    assert torch_at < project_at
    assert 'ENTRYPOINT ["mesh", "up", "/etc/wavemesh/cluster.yaml"]' in lines
    default = re.search(r"COPY <<'YAML' /etc/wavemesh/cluster.yaml\n(.*?)\nYAML\n", text, re.S)
    cfg = mesh_config_from_dict(yaml.safe_load(default.group(1)), "Dockerfile:cluster.yaml", check_paths=False)
    assert cfg.api.host == "0.0.0.0"
    # a plain (non-editable) install must carry the status page that GET / serves
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "status_page.html" in data["orchestrator"]


class _FakeCluster:
    def __init__(self, stations):
        self.stations = stations

    def status(self):
        return {"model": "m", "num_layers": 6, "route_generation": 0, "stations": self.stations}


def _cfg(targets_file) -> MeshConfig:
    return MeshConfig(model=ModelSource(preset="tiny"), station_count=2,
                      api=ApiConfig(host="127.0.0.1", port=8123), cluster=ClusterConfig(targets_file=targets_file))


def test_write_targets_file_sd(tmp_path):
    stations = [{"index": 0, "layers": [0, 3], "metrics_address": "10.0.0.1:9100"},
                {"index": 1, "layers": [3, 6], "metrics_address": "10.0.0.2:9101"},
                {"index": 2, "layers": [6, 8], "healthy": False}]  # a station that does not answer has none
    path = tmp_path / "sd" / "targets.json"
    write_targets(_FakeCluster(stations), _cfg(str(path)))
    assert json.loads(path.read_text()) == [
        {"targets": ["127.0.0.1:8123"], "labels": {"job": "wavemesh-orchestrator"}},
        {"targets": ["10.0.0.1:9100"], "labels": {"job": "wavemesh-station", "station_index": "0", "layers": "0-3"}},
        {"targets": ["10.0.0.2:9101"], "labels": {"job": "wavemesh-station", "station_index": "1", "layers": "3-6"}}]
    inode = path.stat().st_ino
    write_targets(_FakeCluster(stations[:1]), _cfg(str(path)))  # replaced by a rename, never edited in place
    assert len(json.loads(path.read_text())) == 2 and path.stat().st_ino != inode
    assert [p.name for p in path.parent.iterdir()] == ["targets.json"]
    assert path.stat().st_mode & 0o444 == 0o444  # readable by a Prometheus running as another user
    write_targets(_FakeCluster(stations), _cfg(None))  # no targets_file: nothing written anywhere
    assert file_sd_targets(_cfg(None), {"stations": []}) == [
        {"targets": ["127.0.0.1:8123"], "labels": {"job": "wavemesh-orchestrator"}}]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_targets_of_a_dead_cluster_are_emptied(tmp_path):
    """A `mesh up` killed by SIGKILL leaves its targets behind; the next `mesh up` (or `mesh down`) empties them,
    while a live owner's file is left as it is (issue 17 item 4)."""
    path = tmp_path / "targets.json"
    stations = [{"index": 0, "layers": [0, 6], "metrics_address": "127.0.0.1:9100"}]
    write_targets(_FakeCluster(stations), _cfg(str(path)))
    claim_targets(str(path))  # this process: alive
    assert not clean_stale_targets(str(path)) and len(json.loads(path.read_text())) == 2
    owner = path.with_name("targets.json.owner")
    owner.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    assert clean_stale_targets(str(path))
    assert json.loads(path.read_text()) == [] and not owner.exists()
    assert not clean_stale_targets(str(path))  # nothing left to clean
    # `mesh down` of a detached cluster that died: the state file names its targets file
    write_targets(_FakeCluster(stations), _cfg(str(path)))
    owner.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    cache = tmp_path / "cache"
    cache.mkdir()
    state_file(cache).write_text(json.dumps({"pid": _dead_pid(), "url": "http://127.0.0.1:1", "log": "x",
                                             "targets_file": str(path)}))
    assert down(cache) == 0
    assert json.loads(path.read_text()) == [] and not state_file(cache).exists()
    release_targets(str(path))  # a clean stop empties it as well
    assert json.loads(path.read_text()) == []
