"""Moving a live engine onto a new chain of stations: make before break, or pause and re-prefill.

The Engine's route switches, kept apart from its wave loop. `switch_route` takes the catch-up path
(orchestrator/catchup.py) where it is exact and possible: the new stations are all new (a station in both
routes would hold two copies of a sequence under one id) and every station of both routes is chunk-invariant.
Otherwise, or with `scheduler.route_switch: pause`, planning stops, the pipeline empties and every live
sequence is prefilled again on the new route (its counter-based sampling keeps its tokens unchanged).

Faults: a new-route station failing during the catch-up abandons it (the old route carries on, the call raises);
an old-route station failing during the catch-up switches at once (the new route replays the residual tokens).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from orchestrator.catchup import CatchUp, SwitchReport
from orchestrator.pipeline import StationLink
from orchestrator.relay import make_pipeline
from orchestrator.route import IllegalTransition, RouteState, route_limits
from orchestrator.scheduler_types import KVLimits, WavePlan

log = logging.getLogger(__name__)
PROGRESS_PERIOD_S = 1.0  # how often a catch-up reports its progress


class CatchUpFailed(RuntimeError):
    """A make-before-break switch was abandoned; the old route still serves every stream."""


class RouteSwitching:
    """The Engine's route-switch methods (a mixin: the engine's lock, scheduler, pipeline and wave loop)."""

    def switch_route(self, links: list[StationLink], timeout: float = 120.0,
                     progress: Callable[[str], None] | None = None) -> SwitchReport:
        """Move serving onto a new chain of stations; streams never lose or change a token. With catch-up the
        old route keeps decoding until the new one holds every live sequence's KV, then switches with a short
        chunk each; else a pause and re-prefill. Raises CatchUpFailed (old route kept) when the catch-up fails
        or misses `timeout`, TimeoutError when the pause cannot begin, IllegalTransition when a switch runs."""
        if self.route.closed:
            raise IllegalTransition(RouteState.CLOSED, RouteState.SWITCHING)
        if not self._switch_lock.acquire(blocking=False):
            raise IllegalTransition(RouteState.SWITCHING, RouteState.SWITCHING)
        try:
            limits = route_limits(links, self.model.max_position_embeddings)
            reason = self._pause_reason(links, limits)
            if reason is None:
                report = self._catchup_switch(links, limits, timeout, progress or (lambda _: None))
            else:
                if self.config.route_switch == "catchup":
                    log.warning("route switch: pause and re-prefill every live sequence: %s", reason)
                report = self._pause_switch(links, limits, timeout, reason)
            self.switch_reports.append(report)
            return report
        finally:
            self._switch_lock.release()

    def _pause_reason(self, links: list[StationLink], limits: KVLimits) -> str | None:
        """Why this switch cannot be made before break (None: it can)."""
        with self._lock:
            old, old_limits, state = list(self.pipeline.links), self.scheduler.limits, self.route.state
        if self.config.route_switch == "pause":
            return "scheduler.route_switch is pause"
        if state not in (RouteState.SERVING, RouteState.DRAINING):
            return f"the route is {state.value}"
        shared = [link.address for link in links if any(link is o for o in old)]
        if shared:
            return f"station(s) {shared} serve both routes (a catch-up needs new stations)"
        if not (old_limits.prefill_chunk_invariant and limits.prefill_chunk_invariant):
            return "a station's KV depends on how a sequence is cut into entries (not the float32 CPU kernels)"
        return None

    def _pause_switch(self, links: list[StationLink], limits: KVLimits, timeout: float, reason: str) -> SwitchReport:
        """Planning stops, the waves in flight finish, every live sequence is re-prefilled on `links`."""
        self.route.begin_switch()  # raises IllegalTransition when closed
        try:
            t0 = time.monotonic()
            if not self._wait_idle(timeout):
                raise TimeoutError(f"waves still in flight after {timeout}s; route not switched")
            with self._lock:
                moved = tuple(s.seq_id for s in self.scheduler.running())
                self.replayed_sequences += len(moved)
            self._swap(links, limits)
            with self._lock:  # from here every live stream waits for a token of the new route
                self.switch_pauses.begin()
            return SwitchReport("pause", reason, 0.0, 0, 0, {}, {}, moved, time.monotonic() - t0)
        finally:
            self.route.end_switch()
            self._inbox.put(self._wake)

    def _swap(self, links: list[StationLink], limits: KVLimits | None = None) -> None:
        """With no wave in flight and planning paused: requeue every live sequence for re-prefill on `links`."""
        limits = limits or route_limits(links, self.model.max_position_embeddings)
        with self._lock:
            old = self.pipeline
            released = self.scheduler.rebase(limits)
            self.pipeline = make_pipeline(links, self._on_wave_done, self.config.hidden_path)
        old.release(released)  # reused stations drop the old KV before the new pipeline sends a wave
        old.barrier()
        old.close()

    def _catchup_switch(self, links: list[StationLink], limits: KVLimits, timeout: float,
                        progress: Callable[[str], None]) -> SwitchReport:
        t0 = time.monotonic()
        deadline = t0 + timeout
        pipeline = make_pipeline(links, self._on_wave_done, self.config.hidden_path)
        with self._lock:
            old_depth = self.pipeline.depth + self.config.extra_waves
            recent = sorted(self._wave_seconds)
            baseline = recent[len(recent) // 2] if recent and self.scheduler.running() else None
            cu = CatchUp(self.scheduler.new_ledger(limits), self.config.catchup_wave_tokens, self.config.max_seqs,
                         old_depth + pipeline.depth, self.scheduler.new_wave_id, t0, baseline,
                         self.config.max_wave_tokens, old_depth, self.config.catchup_slowdown)
            self._catchup, self._catchup_pipeline = cu, pipeline
        self._inbox.put(self._wake)
        switching = False
        try:
            with self._lock:
                said = t0
                while not (cu.force or cu.error or self.route.closed or cu.ready(self.scheduler.running())):
                    now = time.monotonic()
                    if now >= deadline:
                        cu.error = f"the new route did not catch up within {timeout:.0f} s"
                        break
                    if now - said >= PROGRESS_PERIOD_S:
                        p, said = cu.progress(self.scheduler.running(), now), now
                        progress(f"catching up: {p.tokens_done} tokens of {p.sequences} sequence(s) on the new "
                                 f"route, {p.tokens_behind} behind ({p.waves} waves, {p.seconds:.1f} s)")
                    self._lock.wait(min(deadline - now, 0.25))
                cu.closing = True  # no more catch-up waves; the old route decodes on while the last ones finish
                self._lock.wait_for(lambda: cu.in_flight == 0 or cu.error or cu.force or self.route.closed,
                                    max(1.0, deadline - time.monotonic()))
                if cu.error is None and not self.route.closed:
                    self.route.begin_switch()  # the old route plans no more waves
                    switching = True
                    t_pause = time.monotonic()
                    drained = self._lock.wait_for(
                        lambda: (self._in_flight == 0 and cu.in_flight == 0) or cu.error or self.route.closed,
                        max(1.0, deadline - t_pause))
                    if not drained:
                        cu.error = f"waves still in flight {timeout:.0f} s into the switch"
                if cu.error is not None or self.route.closed:
                    raise CatchUpFailed(f"route not switched, the old route serves on: {cu.error or 'engine closed'}")
                released, residual = self.scheduler.adopt(limits, cu.ledger, cu.shadows, cu.no_room)
                old, self.pipeline = self.pipeline, pipeline
                self._catchup = None
                self.switch_pauses.begin()
                self.replayed_sequences += len(cu.no_room)
                report = SwitchReport("catchup", "", t_pause - t0, cu.waves, cu.tokens, dict(cu.decoded), residual,
                                      tuple(sorted(cu.no_room)), time.monotonic() - t_pause)
                self.route.end_switch()  # plan on the new route now; the old stations let go below, meanwhile
                switching = False
                self._inbox.put(self._wake)
            if cu.no_room:
                log.warning("route switch: %d sequence(s) did not fit the new stations' KV beside the others and "
                            "are prefilled again there", len(cu.no_room))
            progress(f"caught up: {cu.tokens} tokens in {cu.waves} waves over {report.catchup_seconds:.1f} s; "
                     f"switched with at most {max(residual.values(), default=0)} token(s) left per sequence")
            old.release(released)
            old.barrier()
            old.close()
            return report
        except BaseException:
            with self._lock:
                self._catchup = None
            pipeline.close()
            raise
        finally:
            if switching:
                self.route.end_switch()
            self._inbox.put(self._wake)

    # ---- the wave loop's side of a catch-up (called under the engine's lock) ----------------------------------
    def _fill_catchup(self) -> None:
        """Keep one catch-up wave per new station in flight."""
        cu = self._catchup
        if cu is None:
            return
        while cu.in_flight < self._catchup_pipeline.depth:
            plan = cu.plan(self.scheduler.running())
            if released := cu.take_releases():
                self._catchup_pipeline.release(released)
            if plan is None:
                return
            self._catchup_waves.add(plan.wave_id)
            self._catchup_pipeline.submit(plan)

    def _catchup_wave_done(self, plan: WavePlan, error: BaseException | None) -> None:
        """A catch-up wave came back (or failed: the catch-up is abandoned, the old route serves on)."""
        self._catchup_waves.discard(plan.wave_id)
        cu = self._catchup
        if cu is None or not cu.owns(plan):
            return  # an abandoned catch-up's wave
        if error is not None:
            released = cu.abort(plan, f"a new-route station failed: {type(error).__name__}: {error}")
        else:
            released = cu.commit(plan)
            self.catchup_tokens += len(plan.token_ids)
        if released:
            self._catchup_pipeline.release(released)

    def _catchup_forget(self, seq_ids) -> None:
        """Sequences left the old route: drop their new-route KV too."""
        if self._catchup is not None and (released := self._catchup.forget(tuple(seq_ids))):
            self._catchup_pipeline.release(released)
