"""Bringing a route back after one of its stations was lost: the Engine's recovery, kept apart from its wave loop.

A failed wave (StationDown) or a failed health check starts one recovery at a time (the RouteMachine's
RECOVERING state). It waits for the waves in flight to come back, then asks the cluster's `recover(links)` for a
rebuilt chain (a restarted station, or a fresh actor for the same layers) and swaps it in; the live sequences stay
live and are replayed on it. While the station does not come back, the requests that needed it end with an error
(once per recovery) and recovery keeps trying every `recover_retry_s` until the engine closes.
"""
from __future__ import annotations

import logging
import threading
import time

from orchestrator.pipeline import StationDown

log = logging.getLogger(__name__)


class RouteRecovery:
    """The Engine's recovery methods (a mixin: the engine's lock, route machine, pipeline, `_recover` callback and
    wave loop)."""

    def _wave_failed(self, plan, error: BaseException) -> None:
        """A wave failed (the wave loop, holding the lock): its sequences leave flight, then a station lost during a
        make-before-break switch forces the switch, one lost otherwise starts a recovery (its sequences stay live
        and are replayed), and any other failure ends the wave's requests with it."""
        if plan.wave_id not in self._sent:  # a pipeline's report on a wave that already landed: none to end
            log.error("wave %d failed after it landed (ignored): %s", plan.wave_id, error)
            return
        self._leave_flight(plan)  # before a recovery, which waits for every wave to be out of flight
        self.scheduler.abort_wave(plan)
        self._release(self.scheduler.take_releases())
        if isinstance(error, StationDown) and self._catchup is not None and self._catchup.error is None:
            self._catchup.force = True  # switch to the new route now; its sequences replay their residual there
            return
        if isinstance(error, StationDown) and self._recover is not None:
            self.recover_route()
            return
        for e in plan.entries:
            self._end(e.seq_id, "error", f"station failed: {error}")

    def recover_route(self) -> bool:
        """A station failed its health check: rebuild the route now (as after a failed call), when recovery is on.
        True when this call began a recovery (False: recovery is off, one already runs, or the engine closed)."""
        if self._recover is not None and self.route.begin_recovery():  # not when closed or already recovering
            threading.Thread(target=self._recovery, name="route-recovery", daemon=True).start()
            return True
        return False

    def _recovery(self) -> None:
        t0 = time.monotonic()
        with self._lock:
            self._lock.wait_for(lambda: self._in_flight == 0 or self.route.closed)
        while True:
            with self._lock:
                if self.route.closed:
                    break
                links = list(self.pipeline.links)
            try:
                self._swap(self._recover(links))
                break
            except Exception as e:  # noqa: BLE001 - the station is not back: end what needed it, keep trying
                with self._lock:
                    if self.route.fail_recovery(f"{type(e).__name__}: {e}"):
                        for seq_id in self.requests.seq_ids():
                            self._end(seq_id, "error", f"a station was lost and did not come back: {e}")
                    self._lock.wait_for(lambda: self.route.closed, self._recover_retry_s)
        with self._lock:
            self.route.end_recovery()
            self.recovery_seconds.append(time.monotonic() - t0)
        self._inbox.put(self._wake)
