"""A server under a benchmark: started in its own session on a free loopback port, ready once /health answers.

Shared by bench/soak.py (`mesh up`) and bench/vs_llamacpp.py (`mesh up` and llama-server). No torch here.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], url: str, log: Path, name: str, timeout_s: float = 600.0) -> subprocess.Popen:
    """Start `cmd` from the repo root in its own session, output to `log`; returns once GET url/health is 200.

    Raises RuntimeError naming `name` (with the log's tail) when it exits first or is not healthy in time."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited early ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=10).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"{name} did not become healthy in {timeout_s:.0f} s; log {log}")


def stop_server(proc: subprocess.Popen, grace_s: float = 120.0) -> None:
    """SIGTERM the server (it drains and stops what it started); SIGKILL its whole session after `grace_s`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
