"""What an operator sees of a running `mesh up`: the status page (in headless Chromium), the Prometheus
endpoints of the orchestrator and of every station, and the file_sd targets file kept across growth."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from mesh.core.config import ApiConfig, ModelConfig, SchedulerConfig, StationSpec
from orchestrator.api import create_app
from orchestrator.engine import Engine
from orchestrator.pipeline import LocalLink
from station.step import Station

KEY = "page-key"
DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


# ---- the route and its key, in-process -----------------------------------------------------------

@pytest.mark.parametrize("api_key", [None, KEY])
def test_page_route_and_query_key(tiny_llama, api_key):
    cfg = ModelConfig.from_dir(tiny_llama)
    engine = Engine([LocalLink(Station(tiny_llama, StationSpec(layers=(0, 6), kv_bytes=8 * 2**20)))], cfg,
                    SchedulerConfig(max_seqs=4, max_wave_tokens=64))
    try:
        app = create_app(engine, Tokenizer.from_file(str(tiny_llama / "tokenizer.json")), "", "tiny",
                         ApiConfig(api_key=api_key), status_provider=lambda: {"stations": []})
        with TestClient(app) as client:
            bearer = {"Authorization": f"Bearer {KEY}"}
            page = client.get("/", params={"key": KEY} if api_key else None)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            for hook in ('id="busy-lanes"', 'id="queue-depth"', 'id="waves-in-flight"', 'id="tokens-per-s"',
                         'id="peak-tokens-per-s"', 'id="route"', 'id="prefix-hit-rate"', 'id="replan"', "v1/status"):
                assert hook in page.text, hook
            assert not re.search(r"<(script|link)[^>]+(src|href)=\"(https?:)?//", page.text), "no CDN"
            if api_key:
                assert client.get("/").status_code == 401
                assert client.get("/", params={"key": "wrong"}).status_code == 401
                assert client.get("/", headers=bearer).status_code == 200
                # the query key opens the page only: the API still wants the header
                assert client.get("/v1/status", params={"key": KEY}).status_code == 401
                assert client.get("/v1/status", headers=bearer).status_code == 200
    finally:
        engine.close()


# ---- a 2-station `mesh up` (tests/conftest.py's mesh_up) ---------------------------------------------

def _families(text: str) -> dict[str, list]:
    """{sample name: [samples]} of a Prometheus text exposition (it must parse)."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _complete(mesh_up, n: int = 4, max_tokens: int = 8) -> None:
    for i in range(n):
        r = mesh_up.client.post("/v1/completions", json={"prompt": [1, 5 + i, 9], "max_tokens": max_tokens,
                                                        "ignore_eos": True})
        assert r.status_code == 200, r.text


def test_metrics_of_orchestrator_and_every_station_parse(mesh_up):
    _complete(mesh_up)
    orch = _families(httpx.get(mesh_up.url + "/metrics", timeout=30).text)
    assert orch["wavemesh_generation_tokens_total"][0].value >= 32
    assert orch["wavemesh_time_to_first_token_seconds_count"][0].value >= 4
    status = mesh_up.client.get("/v1/status").json()
    assert [s["layers"] for s in status["stations"]] == [[0, 3], [3, 6]]
    exported = set(orch)
    for st in status["stations"]:
        assert re.fullmatch(r"127\.0\.0\.1:\d+", st["metrics_address"]), st
        fams = _families(httpx.get(f"http://{st['metrics_address']}/metrics", timeout=30).text)
        exported |= set(fams)
        a, b = st["layers"]
        labels = {"station": f"s{a}", "layers": f"{a}-{b}"}
        mine = lambda name: [s for s in fams[name] if all(s.labels[k] == v for k, v in labels.items())]  # noqa: E731
        assert sum(s.value for s in mine("wavemesh_station_forward_seconds_total")) > 0
        wire = {s.labels["direction"]: s.value for s in mine("wavemesh_station_wire_bytes_total")}
        assert wire["in"] > 0 and wire["out"] > 0, wire
        assert mine("wavemesh_station_kv_bytes_total")[0].value > 0
        assert mine("wavemesh_station_kv_bytes_total")[0].value == st["kv_bytes_total"]
        assert "wavemesh_station_kv_bytes_used" in fams and "wavemesh_station_sequences" in fams
    # every series the Grafana dashboard queries is exported by these live processes
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    wanted = {n for p in dashboard["panels"] for t in p["targets"]
              for n in re.findall(r"wavemesh_[A-Za-z0-9_]+", t["expr"])}
    assert wanted and wanted <= exported, sorted(wanted - exported)


class _Dom(HTMLParser):
    """The rendered page's numbers and stations, read from Chromium's --dump-dom."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.stations: list[dict[str, str]] = []
        self._capture: str | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if "station" in classes:
            self.stations.append({"index": a.get("data-index"), "layers": a.get("data-layers"), "text": ""})
        if a.get("id"):
            self._capture = a["id"]
            self.values.setdefault(a["id"], "")
        elif "layers" in classes and self.stations:
            self._capture = "station-layers"

    def handle_endtag(self, tag):
        self._capture = None

    def handle_data(self, data):
        if self._capture == "station-layers":
            self.stations[-1]["text"] += data
        elif self._capture:
            self.values[self._capture] += data


def _render(url: str, budget_ms: int = 4000) -> _Dom:
    """The status page as headless Chromium renders it after `budget_ms` of (virtual) time."""
    with tempfile.TemporaryDirectory(prefix="wavemesh-chromium-") as profile:
        cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
               "--dump-dom", url]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0 and "busy-lanes" in r.stdout, r.stderr[-2000:]
    return _Dom(r.stdout)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not found (install Debian's `chromium`: make deps)")
def test_page_in_chromium_shows_the_route_and_busy_lanes(mesh_up):
    page_url = f"{mesh_up.url}/?key={mesh_up.key}"
    idle = _render(page_url)
    assert idle.values["error"] == "", idle.values["error"]
    assert [(s["index"], s["layers"]) for s in idle.stations] == [("0", "0-3"), ("1", "3-6")]
    assert [s["text"] for s in idle.stations] == ["layers 0-3", "layers 3-6"]
    assert idle.values["busy-lanes"] == "0" and idle.values["queue-depth"] == "0"
    assert idle.values["route-generation"] == "0" and idle.values["replan"] == "none"

    stop, streams = threading.Event(), []

    def stream(i: int) -> None:
        body = {"prompt": [1, 7 + i, 30 + i], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with mesh_up.client.stream("POST", "/v1/completions", json=body, timeout=120) as r:
            streams.append(r.status_code)
            for _ in r.iter_lines():
                if stop.is_set():
                    return  # leaving closes the connection: the server cancels the request

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while mesh_up.client.get("/v1/status").json()["engine"]["running"] < 4:
            assert time.monotonic() < deadline, "the requests never started running"
            time.sleep(0.1)
        busy = _render(page_url, budget_ms=3000)
        assert mesh_up.client.get("/v1/status").json()["engine"]["running"] > 0, "requests ended during the render"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert streams == [200] * 8
    assert int(busy.values["busy-lanes"]) > int(idle.values["busy-lanes"]), busy.values
    assert float(busy.values["peak-tokens-per-s"]) >= float(busy.values["tokens-per-s"]) > 0
    assert int(busy.values["waves-in-flight"]) >= 0 and len(busy.stations) == 2
    assert "% of" in busy.values["prefix-hit-rate"], busy.values["prefix-hit-rate"]  # prompts were looked up
    deadline = time.monotonic() + 60  # the closed streams were cancelled: their lanes free up
    while mesh_up.client.get("/v1/status").json()["engine"]["running"]:
        assert time.monotonic() < deadline, "cancelled streams kept running"
        time.sleep(0.2)


def test_no_process_of_mesh_up_listens_beyond_loopback(mesh_up):
    """Issue 17 item 4: the local Ray that `mesh up` starts (no ray address configured) binds loopback: its GCS,
    raylet, agents and workers, the stations and the API listen on 127.0.0.1 (or ::1) only."""
    import ipaddress

    import psutil

    root = psutil.Process(mesh_up.pid)
    processes = [root] + root.children(recursive=True)
    listening, beyond = 0, []
    for proc in processes:
        try:
            sockets = proc.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue  # a worker that ended while we looked listens nowhere
        for sock in sockets:
            if sock.status != psutil.CONN_LISTEN:
                continue
            listening += 1
            ip = ipaddress.ip_address(sock.laddr.ip)
            if not (getattr(ip, "ipv4_mapped", None) or ip).is_loopback:
                beyond.append(f"{proc.pid} {' '.join(proc.cmdline())[:80]} on {sock.laddr.ip}:{sock.laddr.port}")
    assert any("gcs_server" in " ".join(p.cmdline()) for p in processes if p.is_running()), "no Ray under mesh up"
    assert listening > 0 and beyond == [], "\n".join(beyond)


def _station_groups(targets: Path) -> list[dict]:
    groups = json.loads(targets.read_text())
    assert all(set(g) == {"targets", "labels"} for g in groups)
    return [g for g in groups if g["labels"]["job"] == "wavemesh-station"]


def test_targets_file_follows_the_route(mesh_up):
    """Written at start, rewritten (atomically: no temp file left) after /admin/scale; this test runs last."""
    groups = json.loads(mesh_up.targets.read_text())
    port = mesh_up.url.rsplit(":", 1)[1]
    assert groups[0] == {"targets": [f"127.0.0.1:{port}"], "labels": {"job": "wavemesh-orchestrator"}}

    def expected():
        return [{"targets": [s["metrics_address"]], "labels": {
            "job": "wavemesh-station", "station_index": str(s["index"]), "layers": "%d-%d" % tuple(s["layers"])}}
            for s in mesh_up.client.get("/v1/status").json()["stations"]]

    assert _station_groups(mesh_up.targets) == expected() and len(expected()) == 2
    r = mesh_up.client.post("/admin/scale", json={"stations": 3}, timeout=300)
    assert r.status_code == 200, r.text
    after = _station_groups(mesh_up.targets)
    assert after == expected() and len(after) == 3
    bounds = [tuple(map(int, g["labels"]["layers"].split("-"))) for g in after]
    assert bounds[0][0] == 0 and bounds[-1][1] == 6 and all(x[1] == y[0] for x, y in zip(bounds, bounds[1:]))
    # no temp file left; beside the targets only the owner record (mesh/control/targets.py)
    assert sorted(os.listdir(mesh_up.targets.parent)) == ["targets.json", "targets.json.owner"]
    for g in after:  # every listed endpoint answers
        assert httpx.get(f"http://{g['targets'][0]}/metrics", timeout=30).status_code == 200
