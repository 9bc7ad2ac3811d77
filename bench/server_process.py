"""A server under a benchmark: started in its own session on a free loopback port, ready once /health answers.

Shared by bench/soak.py (`mesh up`) and bench/vs_llamacpp.py (`mesh up` and llama-server). No torch here.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


RAY_WORKER_PORTS_END = 20000  # Ray's worker processes take ports up to 19999 by default


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback TCP port free now, for a server started after this call (a `mesh up`'s API, llama-server).

    Not one found by binding port 0: that comes from the kernel's ephemeral range, from which every server a `mesh
    up` starts before its API (Ray's, the stations' gRPC servers and relay links) gets its own port, so one of them
    could take it first. These come from between Ray's worker ports and that range."""
    low, high = RAY_WORKER_PORTS_END, _ephemeral_low()
    if high - low < 1000:  # an unusual ephemeral range: any port the kernel gives out
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    pick = random.Random()
    for _ in range(200):
        port = pick.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: try another
                continue
            return port
    raise RuntimeError(f"no free TCP port on loopback in [{low}, {high})")


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
