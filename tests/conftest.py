"""Shared fixtures: synthetic checkpoints written once per test session (no network), a local Ray per module,
and a 2-station `mesh up` per module."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from mesh.core.model.synthetic import init_model
from ports import free_port as free_port_now


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """{arch: tiny checkpoint dir} for llama (GQA + llama3 rope), mistral and qwen2 (bias + tied)."""
    root = tmp_path_factory.mktemp("models")
    return {arch: init_model(root / f"tiny-{arch}", "tiny", arch) for arch in ("llama", "mistral", "qwen2")}


@pytest.fixture(scope="session")
def tiny_llama(model_dirs):
    """The tiny llama checkpoint."""
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def tiny_llama_bf16(tmp_path_factory):
    """The tiny llama's weights rounded to bfloat16 and stored so, as most published checkpoints are."""
    return init_model(tmp_path_factory.mktemp("bf16") / "tiny-llama-bf16", "tiny", "llama", dtype="bfloat16")


@pytest.fixture(scope="session")
def sharded_llama(tmp_path_factory):
    """The tiny llama written as 3 shards with a model.safetensors.index.json."""
    return init_model(tmp_path_factory.mktemp("sharded") / "tiny-llama-3", "tiny", "llama", shards=3)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for one test module (loopback, no dashboard), shut down after it."""
    ray = pytest.importorskip("ray")
    for attempt in (1, 2):  # Ray's head processes now and then miss their start-up window on a 2-core box
        try:  # (seen twice in a dozen full runs: the raylet's 30 s, or the GCS never writing its port file)
            ray.init(num_cpus=16, include_dashboard=False, namespace="wavemesh-test", logging_level="ERROR",
                     log_to_driver=False)
            break
        except Exception:  # noqa: BLE001 - Ray raises bare Exception / RuntimeError for these; a real fault fails twice
            ray.shutdown()
            if attempt == 2:
                raise
            time.sleep(5)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def free_port():
    """A function returning a TCP port free on loopback right now (for servers a test starts)."""
    return free_port_now


@pytest.fixture(scope="module")
def mesh_up(tmp_path_factory, tiny_llama):
    """`mesh up` of a 2-station tiny llama with an API key and a targets file, for one test module; stopped by
    SIGTERM. Yields url, key, targets (the file_sd path), client (an httpx.Client sending the key) and pid."""
    tmp = tmp_path_factory.mktemp("mesh-up")
    port, key = free_port_now(), "page-key"
    targets = tmp / "prom" / "targets.json"
    cfg = tmp / "two.yaml"
    cfg.write_text(f"model: {{path: {tiny_llama}}}\nstations:\n  - {{layers: [0, 3]}}\n  - {{layers: [3, 6]}}\n"
                   f"scheduler: {{max_seqs: 16, max_wave_tokens: 64}}\n"
                   f"api: {{host: 127.0.0.1, port: {port}, api_key: {key}}}\n"
                   f"cluster: {{targets_file: {targets}}}\n")
    env = dict(os.environ, WAVEMESH_CACHE=str(tmp / "cache"), RAY_AUTH_MODE="disabled")
    log = open(tmp / "mesh-up.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mesh.control.cli", "up", str(cfg)], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp / "mesh-up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mesh up never became healthy"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        yield SimpleNamespace(url=url, key=key, targets=targets, client=client, pid=proc.pid)
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
    assert proc.returncode == 0, (tmp / "mesh-up.log").read_text()[-3000:]
@contextlib.contextmanager
def _serve_http(app):
    """uvicorn on a free port of 127.0.0.1 in a background thread; yields the base URL, stops it after."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (server.started and server.servers):
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def serve_http():
    """`with serve_http(app) as url:` serves an ASGI app over HTTP on loopback for the block."""
    return _serve_http


@pytest.fixture(scope="session")
def bench_script():
    """Load a bench/ script as a module from its file (bench/ is not a package): bench_script("cpu_split")."""
    def load(name: str):
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", f"{name}.py")
        spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # a dataclass of the script looks its module up there
        spec.loader.exec_module(module)
        return module
    return load
