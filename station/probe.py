"""The station's health answer, kept true by a probe row through the forward path.

A station that answers pings but cannot step (a forward that never ends, a broken
device) must read as unhealthy. Every `period_s` the probe takes the station lock
(waiting at most `hang_s`, longer than any healthy forward) and runs one throwaway
row through every layer. The standard gRPC health service then says SERVING when
that worked and NOT_SERVING when it did not or the lock stayed held: what the
orchestrator's health watch and Kubernetes probes read.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    """How often the forward path is proven, and how long a forward may hold the station."""

    period_s: float = 5.0  # seconds between two probe rows
    hang_s: float = 30.0  # a forward holding the station longer than this reads as hung (NOT_SERVING)

    def __post_init__(self) -> None:
        for name in ("period_s", "hang_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"probe {name}: must be a number > 0, got {value!r}")


class HealthProbe:
    """A daemon thread: every period, `probe(hang_s) -> bool`, then `set_serving(ok)` when the answer changes."""

    def __init__(self, probe: Callable[[float], bool], set_serving: Callable[[bool], None],
                 config: ProbeConfig) -> None:
        self._probe, self._set_serving, self.config = probe, set_serving, config
        self._stop = threading.Event()
        self._serving = True
        self._thread = threading.Thread(target=self._run, name="station-health-probe", daemon=True)

    def start(self) -> "HealthProbe":
        """Begin probing (the health answer starts as SERVING: the station has just loaded)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop probing; the health answer is left to the caller (shutdown sets NOT_SERVING)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.config.hang_s + 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.config.period_s):
            ok = self._probe(self.config.hang_s)
            if self._stop.is_set():
                return
            if ok != self._serving:
                log.warning("station health: %s", "SERVING again" if ok else "NOT_SERVING (the probe row did not pass)")
                self._serving = ok
                self._set_serving(ok)
