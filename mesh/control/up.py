"""`mesh up`: a cluster from a MeshConfig, served over HTTP until SIGINT/SIGTERM.

The API process is the orchestrator: it owns the Cluster (Ray actors + engine)
and serves the OpenAI routes, `/v1/status`, `/metrics`, and the admin routes
that grow the mesh while it serves (`POST /admin/scale`, `POST /admin/add-station`).
With `cluster.targets_file` set it keeps a Prometheus file_sd targets file naming the
orchestrator and every station's metrics endpoint, rewritten after each growth.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import tempfile
import time
import urllib.request
from pathlib import Path

from fastapi import Request

from mesh.control.cluster import Cluster
from mesh.control.mesh_config import MeshConfig
from mesh.control.targets import claim_targets, clean_stale_targets, release_targets
from mesh.core.config import ConfigError, is_int
from mesh.core.long_lived import freeze_long_lived
from mesh.core.model.gguf_convert import SMOLLM2, SMOLLM2_DIR
from mesh.core.transport import host_port
from mesh.core.model.tokenizer_files import chat_template, load_tokenizer
from orchestrator.api import create_app
from orchestrator.http_body import read_json_object
from orchestrator.metrics import MetricsRegistry
from orchestrator.route_switch import CatchUpFailed
from orchestrator.openai_schema import ApiError, bad


def _advertised(host: str) -> str:
    """A host others can reach: the node's IP when `host` is a wildcard interface."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no Ray here: the host name is the best guess
        return socket.gethostname()


def file_sd_targets(config: MeshConfig, status: dict) -> list[dict]:
    """Prometheus file_sd groups: the orchestrator's /metrics and every station's metrics endpoint."""
    host = _advertised(config.api.host)
    groups = [{"targets": [host_port(host, config.api.port)], "labels": {"job": "wavemesh-orchestrator"}}]
    for st in status.get("stations", []):
        if st.get("metrics_address"):
            a, b = st["layers"]
            groups.append({"targets": [st["metrics_address"]], "labels": {
                "job": "wavemesh-station", "station_index": str(st["index"]), "layers": f"{a}-{b}"}})
    return groups


def write_targets(cluster, config: MeshConfig) -> None:
    """Rewrite `cluster.targets_file` (if set) atomically: a temp file in its folder, then a rename."""
    if config.cluster.targets_file is None:
        return
    path = Path(config.cluster.targets_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(file_sd_targets(config, cluster.status()), indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; Prometheus may run as another user
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _control(call, fields: tuple[str, ...], after):
    """`call`, then `after()`, with call's ConfigError turned into a 400 naming the first of `fields` it names."""

    def checked(*args):
        try:
            out = call(*args)
        except ConfigError as e:
            raise ApiError(400, str(e), next((f for f in fields if f in str(e)), None), "invalid_value") from None
        except CatchUpFailed as e:  # the old route serves on; say why the new one was given up
            raise ApiError(503, str(e), None, "route_not_switched") from None
        after()
        return out

    return checked


def served_model_name(config: MeshConfig, model_dir: Path) -> str:
    """The model id the API serves: api.model_name, else the embedded default's name (whose station reads the
    packaged GGUF file), else the checkpoint's directory or file name."""
    return config.api.model_name or (SMOLLM2_DIR if config.model.preset == SMOLLM2 else model_dir.name)


def build_app(cluster, config: MeshConfig):
    """The API over a started cluster, with the admin routes that scale it (and rewrite the targets file).
    Their bodies are read as the API's are: the same size limit (413) and errors that name the field."""
    name = served_model_name(config, cluster.model_dir)
    metrics = MetricsRegistry(cluster.engine.stats)
    cluster.engine.on_wave = metrics.observe_wave
    app = create_app(cluster.engine, cluster.engine.tokenizer, chat_template(cluster.model_dir), name, config.api,
                     status_provider=cluster.status, metrics=metrics)
    write_targets(cluster, config)
    claim_targets(config.cluster.targets_file)

    def refresh_targets() -> None:
        try:
            write_targets(cluster, config)
        except OSError as e:  # the route changed all the same: say so rather than fail the call
            print(f"wavemesh: cannot rewrite {config.cluster.targets_file}: {e}", file=sys.stderr, flush=True)

    cluster.on_restart = refresh_targets  # a restarted station listens on new ports

    def _specs(specs) -> dict:
        return {"stations": [{"layers": list(s.layers), "device": s.device, "num_gpus": s.num_gpus} for s in specs]}

    @app.post("/admin/scale")
    async def scale(request: Request) -> dict:
        """Re-plan the model over `stations` stations and move serving onto them."""
        body = await read_json_object(request, ("stations",))
        count = body.get("stations")
        if not is_int(count):
            raise bad("stations", f"expected an integer, got {type(count).__name__}")
        return _specs(await asyncio.to_thread(_control(cluster.scale, ("stations",), refresh_targets), count))

    @app.post("/admin/add-station")
    async def add_station(request: Request) -> dict:
        """Add a station on `layers` [A, B] (or split the largest), with `num_gpus`."""
        body = await read_json_object(request, ("layers", "num_gpus"))
        layers, gpus = body.get("layers"), body.get("num_gpus")
        if layers is not None and not (isinstance(layers, list) and len(layers) == 2 and all(is_int(x) for x in layers)):
            raise bad("layers", "expected [start, end] integers")
        if gpus is not None and not (isinstance(gpus, (int, float)) and not isinstance(gpus, bool)
                                     and math.isfinite(gpus) and gpus >= 0):
            raise bad("num_gpus", "expected a finite number >= 0")
        add = _control(cluster.add_station, ("layers", "num_gpus"), refresh_targets)
        return _specs(await asyncio.to_thread(add, tuple(layers) if layers else None, gpus))

    return app


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """On the first SIGINT/SIGTERM: refuse new requests with 503, let admitted ones finish (up to
        `drain_s`), then stop; a second signal stops at once. Either way `run()` then returns normally."""

        def __init__(self, config, engine, drain_s: float) -> None:
            super().__init__(config)
            self.engine, self.drain_s, self._draining = engine, drain_s, False

        @contextlib.contextmanager
        def capture_signals(self):
            """SIGINT/SIGTERM go to handle_exit while serving; the previous handlers come back afterwards.

            uvicorn's own version raises each caught signal again once the server has stopped, which turns
            a drained Ctrl-C into a KeyboardInterrupt traceback (and SIGTERM into Ray's SystemExit): the
            signal has been handled by the drain, so here it is not raised again.
            """
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            if self._draining:
                super().handle_exit(sig, frame)
                return
            self._draining = True
            self.engine.stop_admitting()
            print(f"wavemesh draining: new requests get 503, running ones have {self.drain_s:.0f}s",
                  file=sys.stderr, flush=True)
            threading.Thread(target=self._drain_then_exit, args=(sig, frame), daemon=True).start()

        def _drain_then_exit(self, sig, frame) -> None:
            self.engine.wait_idle(self.drain_s)  # woken when the last admitted request ends
            super().handle_exit(sig, frame)

    return DrainingServer


def serve(config: MeshConfig, model_dir: Path) -> int:
    """Start the cluster, serve until SIGINT/SIGTERM, then stop every actor."""
    import uvicorn

    DrainingServer = _draining_server_class()
    if clean_stale_targets(config.cluster.targets_file):
        print(f"wavemesh: {config.cluster.targets_file} listed a cluster that is gone: emptied",
              file=sys.stderr, flush=True)
    cluster = Cluster(config, model_dir)
    cluster.start(load_tokenizer(model_dir))
    try:
        app = build_app(cluster, config)
        server = DrainingServer(uvicorn.Config(app, host=config.api.host, port=config.api.port, log_level="warning",
                                               timeout_graceful_shutdown=config.cluster.shutdown_timeout_s),
                                cluster.engine, config.cluster.shutdown_timeout_s)
        freeze_long_lived()  # the start-up's objects out of every full collection while serving
        print(f"wavemesh serving {served_model_name(config, model_dir)} on "
              f"http://{host_port(config.api.host, config.api.port)} with {len(cluster.specs)} station(s)",
              file=sys.stderr, flush=True)
        server.run()  # returns after SIGINT/SIGTERM and the drain (a failed start raises SystemExit(1))
    finally:
        cluster.stop()
        release_targets(config.cluster.targets_file)
        print("wavemesh stopped: every station actor ended", file=sys.stderr, flush=True)
    return 0


def state_file(cache: Path) -> Path:
    """Where a detached `mesh up` records its pid and URL."""
    return cache / "mesh-up.json"


def detach(argv: list[str], url: str, cache: Path, timeout_s: float = 300.0, targets_file: str | None = None) -> int:
    """Start `mesh up` again in the background (its own session), wait for /health, record its pid."""
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / "mesh-up.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mesh.control.cli", "up", *argv], stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    state_file(cache).write_text(json.dumps({"pid": proc.pid, "url": url, "log": str(log), "targets_file": targets_file}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(f"mesh up exited with {proc.returncode}; see {log}", file=sys.stderr)
            return 1
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    print(f"wavemesh up at {url} (pid {proc.pid}, log {log})")
                    return 0
        except OSError:
            pass
        time.sleep(0.5)
    print(f"mesh up did not become healthy within {timeout_s}s; see {log}", file=sys.stderr)
    return 1


def down(cache: Path, timeout_s: float = 60.0) -> int:
    """Stop a detached `mesh up` (SIGTERM, then wait for it to drain and exit)."""
    p = state_file(cache)
    if not p.is_file():
        print("mesh down: no detached cluster recorded", file=sys.stderr)
        return 1
    state = json.loads(p.read_text())
    pid = state["pid"]
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        p.unlink()
        cleaned = clean_stale_targets(state.get("targets_file"))
        print(f"mesh down: process {pid} was not running" + ("; its targets file emptied" if cleaned else ""))
        return 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            p.unlink()
            print(f"mesh down: stopped {pid}")
            return 0
        time.sleep(0.2)
    print(f"mesh down: {pid} still running after {timeout_s}s", file=sys.stderr)
    return 1
