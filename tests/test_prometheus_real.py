"""A real Prometheus (Debian's `prometheus`, installed by `make deps`) scrapes a 2-station `mesh up` through the
file_sd targets file, with deploy/prometheus.yml's scrape job; after traffic, every expression of the shipped
Grafana dashboard, evaluated through Prometheus' HTTP API, returns data (issue 17 item 11). Prometheus asks for
OpenMetrics first, so this checks the names Prometheus stores, not the names our own exposition prints."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
RATE_WINDOW = "2m"  # stands in for Grafana's $__rate_interval: longer than the test waits after its traffic
STATIONS = {"s0", "s3"}  # the mesh_up fixture's stations: layers [0, 3) and [3, 6)

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not found (Debian's `prometheus`: make deps)")


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return [t["expr"].replace("$__rate_interval", RATE_WINDOW) for p in dashboard["panels"] for t in p["targets"]]


def _config(targets: Path) -> dict:
    """deploy/prometheus.yml as shipped, with a 1 s scrape and the fixture's targets file."""
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    prom["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    for job in prom["scrape_configs"]:
        for sd in job["file_sd_configs"]:
            sd.update(files=[str(targets)], refresh_interval="1s")
    return prom


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def prometheus(mesh_up, tmp_path_factory, free_port):
    """Prometheus on loopback scraping `mesh_up` every second; yields a client of its /api/v1 once every target
    of the targets file (the orchestrator and both stations) has been scraped and is up."""
    tmp = tmp_path_factory.mktemp("prometheus")
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(_config(mesh_up.targets)))
    port = free_port()
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=10)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, ("targets never all up", (tmp / "prometheus.log").read_text()[-3000:])
            try:
                active = api.get("/targets").json()["data"]["activeTargets"]
            except (httpx.HTTPError, ValueError, KeyError):
                active = []
            if len(active) == 3 and all(t["health"] == "up" for t in active):
                break
            time.sleep(0.5)
        yield api
    finally:
        api.close()
        _stop(proc)
        log.close()


def _query(api: httpx.Client, expr: str) -> list[dict]:
    """The instant vector `expr` evaluates to now (an error is a failure)."""
    body = api.get("/query", params={"query": expr}).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _missing(api: httpx.Client, exprs: list[str]) -> dict[str, list]:
    """{expression: the series it returns} of those that return no number yet (no series, or only NaN), or
    miss a station they group by."""
    missing = {}
    for expr in exprs:
        result = _query(api, expr)
        numbers = [r for r in result if not math.isnan(float(r["value"][1]))]
        stations = {r["metric"].get("station") for r in numbers}
        if not numbers or ("by (station" in expr and stations != STATIONS):
            missing[expr] = [(r["metric"], r["value"][1]) for r in result]
    return missing


def _traffic(mesh_up) -> None:
    """Requests that move every panel: completions (tokens, latencies, waves, station work) and one refusal."""
    for i in range(6):
        r = mesh_up.client.post("/v1/completions", json={"prompt": [1, 5 + i, 9], "max_tokens": 8,
                                                         "ignore_eos": True})
        assert r.status_code == 200, r.text
    assert mesh_up.client.post("/v1/completions", json={"prompt": [1], "max_tokens": -1}).status_code == 400


def test_every_dashboard_expression_returns_data_from_a_real_prometheus(mesh_up, prometheus):
    exprs = _dashboard_exprs()
    assert len(exprs) >= 18
    _traffic(mesh_up)
    deadline = time.monotonic() + 60  # a few scrapes after the traffic
    for _ in range(120):
        missing = _missing(prometheus, exprs)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, "\n".join(f"{e} -> {r}" for e, r in missing.items())
    stored = {r["metric"]["__name__"] for r in _query(prometheus, '{__name__=~"wavemesh.*"}')}
    assert not [n for n in stored if ":" in n], sorted(stored)  # one spelling of every name, whatever the format


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not found (Debian's `prometheus`: make deps)")
def test_shipped_prometheus_config_loads():
    """deploy/prometheus.yml as written (its scrape_timeout within its scrape_interval), checked by promtool."""
    r = subprocess.run([PROMTOOL, "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
