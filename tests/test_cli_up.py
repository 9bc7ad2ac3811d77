"""`mesh up` as a user runs it: a YAML cluster served over HTTP, scaled by `mesh scale`, stopped by SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from mesh.core.config import StationSpec
from mesh.core.params import SamplingParams
from station.generate import generate_one
from station.step import Station
from ports import free_port


def _mesh(*args, env, timeout=120):
    return subprocess.run([sys.executable, "-m", "mesh.control.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _post(url, body, timeout=300):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _long_request_in_background(url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    """Start a greedy completion of exactly `max_tokens` tokens in a thread: (the thread, the dict its reply fills)."""
    reply: dict = {}
    worker = threading.Thread(target=lambda: reply.update(_post(url + "/v1/completions", {
        "prompt": [1, 5, 9], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})))
    worker.start()
    return worker, reply


def _finished_then_exited(proc: subprocess.Popen, requests: list[tuple[threading.Thread, dict]],
                          max_tokens: int) -> str:
    """Every background completion ran to its full length, then `mesh up` exited: its output."""
    for worker, reply in requests:
        worker.join(timeout=300)
        assert reply["choices"][0]["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == max_tokens
    return proc.communicate(timeout=120)[0]


def _wait_healthy(url: str, timeout: float = 180.0, proc: subprocess.Popen | None = None) -> None:
    """Wait until `url`/health answers 200; fail at `timeout`, or at once with its output when `proc` has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else proc.returncode
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail("mesh up never became healthy")


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ, WAVEMESH_CACHE=str(tmp_path / "cache"), RAY_AUTH_MODE="disabled")
    return e


def test_yaml_mistakes_start_nothing(tmp_path, env, tiny_llama):
    cases = {
        "overlap.yaml": (f"model: {{path: {tiny_llama}}}\nstations:\n  - {{layers: [0, 4]}}\n  - {{layers: [3, 6]}}\n",
                         "overlap"),
        "gap.yaml": (f"model: {{path: {tiny_llama}}}\nstations:\n  - {{layers: [0, 2]}}\n  - {{layers: [3, 6]}}\n",
                     "not covered"),
        "unknown.yaml": (f"model: {{path: {tiny_llama}}}\nschedular: {{max_seqs: 4}}\n", "schedular"),
        "type.yaml": (f"model: {{path: {tiny_llama}}}\nscheduler: {{max_seqs: many}}\n", "max_seqs"),
        "nomodel.yaml": ("model: {path: /no/such/model}\n", "does not exist"),
    }
    for name, (text, problem) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        t0 = time.monotonic()
        r = _mesh("up", str(path), "--port", str(free_port()), env=env, timeout=60)
        assert r.returncode == 2, (name, r.stderr)
        assert name in r.stderr and problem in r.stderr, (name, r.stderr)
        assert "loading" not in r.stderr and time.monotonic() - t0 < 30


def test_mesh_up_serves_and_scales_mid_stream(tmp_path, env, tiny_llama):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = tmp_path / "three.yaml"
    cfg.write_text(f"model: {{path: {tiny_llama}}}\nstations:\n  - {{layers: [0, 1]}}\n  - {{layers: [1, 4]}}\n"
                   f"  - {{layers: [4, 6]}}\nscheduler: {{max_seqs: 16, max_wave_tokens: 64}}\n"
                   f"api: {{host: 127.0.0.1, port: {port}}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "mesh.control.cli", "up", str(cfg)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(url)
        status = json.loads(_mesh("status", "--url", url, "--json", env=env).stdout)
        assert [s["layers"] for s in status["stations"]] == [[0, 1], [1, 4], [4, 6]]
        prompts = [[1, 7 + i, 30 + 3 * i, 99] for i in range(6)]
        params = [SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.7 * (i % 2), seed=i) for i in range(6)]
        one = Station(tiny_llama, StationSpec(layers=(0, 6)))
        reference = [generate_one(one, p, sp)[0] for p, sp in zip(prompts, params)]
        results = [None] * len(prompts)

        def run(i):
            body = {"prompt": prompts[i], "max_tokens": 300, "ignore_eos": True, "temperature": params[i].temperature,
                    "seed": i, "return_token_ids": True}
            results[i] = _post(url + "/v1/completions", body)["choices"][0]["token_ids"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        time.sleep(0.5)
        for n in (1, 3):
            r = _mesh("scale", "--stations", str(n), "--url", url, env=env, timeout=300)
            assert r.returncode == 0, r.stderr
            assert len(json.loads(r.stdout)["stations"]) == n
            # the new stations started while the old ones held cores; once those retired, the new ones took them
            _wait_pinned(url, env, min(n, len(os.sched_getaffinity(0))))
        for t in threads:
            t.join(timeout=300)
        assert results == reference
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:]


def _wait_pinned(url: str, env, want: int) -> None:
    """Within a bounded wait, `want` of the route's stations run pinned to cores of their own."""
    stations: list = []
    for _ in range(20):  # the stations claim in the background after the switch
        stations = json.loads(_mesh("status", "--url", url, "--json", env=env).stdout)["stations"]
        if sum(bool(s["cpu_pinned"]) for s in stations) == want:
            return
        time.sleep(0.5)
    pytest.fail(f"expected {want} pinned station(s): {stations}")


def _mesh_up(tmp_path, env, model_dir, extra_yaml: str) -> tuple[subprocess.Popen, str]:
    """`mesh up` on a one-model YAML (plus `extra_yaml`) in a subprocess, once healthy: (process, API URL)."""
    port = free_port()
    cfg = tmp_path / "up.yaml"
    cfg.write_text(f"model: {{path: {model_dir}}}\napi: {{host: 127.0.0.1, port: {port}}}\n" + extra_yaml)
    proc = subprocess.Popen([sys.executable, "-m", "mesh.control.cli", "up", str(cfg)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def _station_pids(url: str, env) -> list[int]:
    return [s["pid"] for s in json.loads(_mesh("status", "--url", url, "--json", env=env).stdout)["stations"]]


def _refused_while_draining(url: str, within_s: float = 30.0) -> int:
    """The status code a new request gets once `mesh up` has taken its stop signal (polled: one that arrives before
    the signal is served, and the next one tried; a server already gone fails the test)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            _post(url + "/v1/completions", {"prompt": "late", "max_tokens": 4}, timeout=30)
        except urllib.error.HTTPError as refused:
            return refused.code
        time.sleep(0.1)
    pytest.fail(f"new requests were still served {within_s} s after SIGTERM")


def test_sigterm_drains_then_stops_every_station(tmp_path, env, tiny_llama):
    """SIGTERM: new requests get 503 while the admitted ones (running and queued) run to their end; then every
    actor stops."""
    # one sequence at a time, so the queued requests keep the drain going however fast the machine decodes
    proc, url = _mesh_up(tmp_path, env, tiny_llama, "cluster: {shutdown_timeout_s: 120}\nscheduler: {max_seqs: 1}\n")
    try:
        station_pids = _station_pids(url, env)
        requests = [_long_request_in_background(url, 900) for _ in range(4)]
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert _refused_while_draining(url) == 503
        out = _finished_then_exited(proc, requests, 900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:]
    assert "Traceback" not in out, out[-4000:]
    # no orphan station process: Ray ends the killed actors' processes a moment after `mesh up` returns
    assert _still_running(station_pids, within_s=30) == [], "station processes outlived `mesh up`"


def test_ctrl_c_drains_then_exits_0_without_a_traceback(tmp_path, env, tiny_llama):
    """SIGINT (Ctrl-C) ends `mesh up` as SIGTERM does: the admitted request finishes, exit code 0, no traceback."""
    proc, url = _mesh_up(tmp_path, env, tiny_llama, "cluster: {shutdown_timeout_s: 120}\n")
    try:
        worker, long = _long_request_in_background(url, 300)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out = _finished_then_exited(proc, [(worker, long)], 300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "wavemesh draining" in out and "wavemesh stopped" in out, out[-4000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]


def test_sigkill_of_the_orchestrator_leaves_no_station_running(tmp_path, env, tiny_llama):
    """`mesh up` killed outright (no drain, no cleanup code runs): its station actors die with it."""
    proc, url = _mesh_up(tmp_path, env, tiny_llama, "stations: {count: 2}\n")
    try:
        station_pids = _station_pids(url, env)
        assert len(station_pids) == 2 and all(station_pids)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _still_running(station_pids, within_s=60) == [], "station processes outlived the killed orchestrator"


def _still_running(pids: list[int], within_s: float) -> list[int]:
    """Those of `pids` still running (not zombies) after waiting up to within_s for them all to end."""
    deadline = time.monotonic() + within_s
    alive = [pid for pid in pids if _running(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [pid for pid in alive if _running(pid)]
    return alive


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
