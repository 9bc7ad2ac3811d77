"""Ports for the servers a test starts (the API of a `mesh up`, a metrics endpoint).

A port found by binding port 0 comes from the kernel's ephemeral range, the same range from which every server a
`mesh up` starts before its API (Ray's gRPC servers, the stations' gRPC servers and relay links) gets its own port,
so one of them could take it first: the test then talks HTTP to a gRPC server. These ports come from below that
range, above Ray's worker ports (10002-19999 by default)."""
from __future__ import annotations

import random
import socket

RAY_WORKER_PORTS_END = 20000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on loopback now, outside the ranges from which other servers get theirs."""
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
