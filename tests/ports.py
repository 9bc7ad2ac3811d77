"""Ports for the servers a test starts (the API of a `mesh up`, a metrics endpoint): bench/server_process.free_port,
the benchmarks' own, which keeps clear of the ports the servers a `mesh up` starts before its API are given."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from server_process import free_port  # noqa: E402

__all__ = ["free_port"]
