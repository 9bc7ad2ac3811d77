"""Moving a live engine onto a new chain of stations: make before break, or pause and re-prefill.

The Engine's route switches, kept apart from its wave loop. `switch_route` takes the catch-up path
(orchestrator/catchup.py) where it is exact and possible: the new stations are all new (a station in both
routes would hold two copies of a sequence under one id), and either the old stations' KV can be copied to the
new ones (orchestrator/kv_move.py: any kernels, one dtype) or every station of both routes is chunk-invariant
(the new stations recompute it).
Otherwise, or with `scheduler.route_switch: pause`, planning stops, the pipeline empties and every live
sequence is prefilled again on the new route (its counter-based sampling keeps its tokens unchanged).

Faults: a new-route station failing during the catch-up abandons it (the old route carries on, the call raises);
an old-route station failing during the catch-up switches at once (the new route replays the residual tokens
where that is exact, else re-prefills those sequences).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from mesh.core.config import DTYPE_BYTES
from orchestrator.catchup import MIN_ROWS, CatchUp, SwitchReport
from orchestrator.kv_move import CopySourceFailed, KVCopier, can_copy
from orchestrator.pipeline import StationDown, StationLink
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
            reason, copy = self._pause_reason(links, limits)
            if reason is None:
                report = self._catchup_switch(links, limits, timeout, progress or (lambda _: None), copy)
            else:
                if self.config.route_switch == "catchup":
                    log.warning("route switch: pause and re-prefill every live sequence: %s", reason)
                report = self._pause_switch(links, limits, timeout, reason)
            self.switch_reports.append(report)
            return report
        finally:
            self._switch_lock.release()

    def _pause_reason(self, links: list[StationLink], limits: KVLimits) -> tuple[str | None, bool]:
        """Why this switch cannot be made before break (None: it can), and whether its catch-up copies KV."""
        with self._lock:
            old, old_limits, state = list(self.pipeline.links), self.scheduler.limits, self.route.state
        if self.config.route_switch == "pause":
            return "scheduler.route_switch is pause", False
        if state not in (RouteState.SERVING, RouteState.DRAINING):
            return f"the route is {state.value}", False
        shared = [link.address for link in links if any(link is o for o in old)]
        if shared:
            return f"station(s) {shared} serve both routes (a catch-up needs new stations)", False
        no_copy = can_copy(old, links) if self.config.catchup_kv == "copy" else "scheduler.catchup_kv is recompute"
        if no_copy is None:
            return None, True
        if not (old_limits.prefill_chunk_invariant and limits.prefill_chunk_invariant):
            return (f"no KV copy ({no_copy}) and a station's KV depends on how a sequence is cut into entries "
                    "(not the float32 CPU kernels)"), False
        if self.config.catchup_kv == "copy":
            log.warning("route switch: the catch-up recomputes the KV: %s", no_copy)
        return None, False

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
            self._wave_seconds.clear()  # the old route's pace is no baseline for the new one's next switch
        old.release(released)  # reused stations drop the old KV before the new pipeline sends a wave
        old.barrier()
        old.close()

    def _catchup_switch(self, links: list[StationLink], limits: KVLimits, timeout: float,
                        progress: Callable[[str], None], copy: bool) -> SwitchReport:
        t0 = time.monotonic()
        deadline = t0 + timeout
        pipeline = make_pipeline(links, self._on_wave_done, self.config.hidden_path)
        copier = None
        with self._lock:
            if copy:
                row_bytes = 2 * self.model.num_key_value_heads * self.model.head_dim * DTYPE_BYTES[links[0].kv().dtype]
                copier = KVCopier(list(self.pipeline.links), links, row_bytes, limits.block_tokens, self._on_wave_done)
            old_depth = self.pipeline.depth + self.config.extra_waves
            recent, busy = sorted(self._wave_seconds), bool(self.scheduler.running())
            baseline = recent[len(recent) // 2] if recent and busy else None  # else learnt where busy (CatchUp)
            rows = self.config.catchup_copy_tokens if copier else self.config.catchup_wave_tokens
            cu = CatchUp(self.scheduler.new_ledger(limits), rows, self.config.max_seqs,
                         old_depth + (copier or pipeline).depth, self.scheduler.new_wave_id, t0, baseline,
                         self.config.max_wave_tokens, old_depth, self.config.catchup_slowdown,
                         max(MIN_ROWS, rows // 16) if copier else MIN_ROWS, learn=busy and not recent)
            self._catchup, self._catchup_pipeline, self._catchup_copier = cu, pipeline, copier
            if copier is not None:
                copier.forgotten = cu.forgotten
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
                if copier is not None and cu.error is None and not self.route.closed:
                    self._final_copy(cu, copier, limits.prefill_chunk_invariant)
                    copier.flush()  # its queued releases reach the new stations before the first wave there
                if cu.error is not None or self.route.closed:
                    raise CatchUpFailed(f"route not switched, the old route serves on: {cu.error or 'engine closed'}")
                released, residual = self.scheduler.adopt(limits, cu.ledger, cu.shadows, cu.no_room)
                old, self.pipeline = self.pipeline, pipeline
                self._wave_seconds.clear()  # the old route's pace is no baseline for the new one's next switch
                self._catchup = self._catchup_copier = None
                self.switch_pauses.begin()
                self.replayed_sequences += len(cu.no_room)
                report = SwitchReport("catchup", "", t_pause - t0, cu.waves, cu.tokens, dict(cu.decoded), residual,
                                      tuple(sorted(cu.no_room)), time.monotonic() - t_pause,
                                      "copy" if copier else "recompute")
                self.route.end_switch()  # plan on the new route now; the old stations let go below, meanwhile
                switching = False
                self._inbox.put(self._wake)
            if cu.no_room:
                log.warning("route switch: %d sequence(s) did not fit the new stations' KV beside the others and "
                            "are prefilled again there", len(cu.no_room))
            progress(f"caught up ({report.kv_source}): {cu.tokens} tokens in {cu.waves} waves over {report.catchup_seconds:.1f} s; "
                     f"switched with at most {max(residual.values(), default=0)} token(s) left per sequence")
            old.release(released)
            old.barrier()
            old.close()
            return report
        except BaseException:
            with self._lock:
                self._catchup = self._catchup_copier = None
            pipeline.close()
            raise
        finally:
            if copier is not None:
                copier.close()
            if switching:
                self.route.end_switch()
            self._inbox.put(self._wake)

    def _final_copy(self, cu: CatchUp, copier: KVCopier, chunk_invariant: bool) -> None:
        """With the old route drained: copy what each sequence still lacks, so it switches with its one decode
        token. An old station that cannot export leaves the rest to be recomputed on the new route where that
        is exact (chunk-invariant kernels), else to a re-prefill of those sequences; a new station's failure
        abandons the catch-up."""
        running = self.scheduler.running()
        plan = cu.plan(running, final=True)
        self._catchup_release(cu.take_releases())  # sequences with no room: free there before their blocks are reused
        copier.flush()
        if plan is not None:
            try:
                copier.copy(plan)
            except CopySourceFailed as e:
                log.warning("route switch: the last KV copy failed (%s); the new route computes the rest", e)
                cu.skip(plan)
            except Exception as e:  # noqa: BLE001 - a new station: the old route serves on
                cu.abort(plan, f"a new-route station failed: {type(e).__name__}: {e}")
                return
            else:
                cu.commit(plan)
                self.catchup_tokens += len(plan.token_ids)
        if not chunk_invariant:  # a residual chunk would change these sequences' KV bits: prefill them again
            for seq in running:
                shadow = cu.shadows.get(seq.seq_id)
                if shadow is not None and shadow.num_computed != seq.num_computed:
                    cu._no_room(seq.seq_id)
            self._catchup_release(cu.take_releases())

    # ---- the wave loop's side of a catch-up (called under the engine's lock) ----------------------------------
    def _fill_catchup(self) -> None:
        """Keep one catch-up wave per new station in flight."""
        cu = self._catchup
        if cu is None:
            return
        mover = self._catchup_copier or self._catchup_pipeline
        while cu.in_flight < mover.depth:
            plan = cu.plan(self.scheduler.running())
            self._catchup_release(cu.take_releases())
            if plan is None:
                return
            self._catchup_waves.add(plan.wave_id)
            mover.submit(plan)

    def _pace_wave(self, plan: WavePlan, seconds: float, ran: int) -> None:
        """A wave of the route landed after `seconds`, having run `ran` steps (fewer than planned where it was ended
        early): keep the pace a catch-up must keep, the one-step decode-only waves (as the old route runs during a
        catch-up) since the route last ran several steps a call, and tell a catch-up under way its time per step (a
        several-step wave sent before the catch-up began is no slowdown)."""
        if len(plan.token_ids) == len(plan.entries):
            if ran > 1:
                self._wave_seconds.clear()
            else:
                self._wave_seconds.append(seconds)
        if self._catchup is not None:
            self._catchup.old_wave(seconds / ran, ran)

    def _catchup_wave_done(self, plan: WavePlan, error: BaseException | None) -> None:
        """A catch-up wave came back (or failed: the catch-up is abandoned, the old route serves on)."""
        self._catchup_waves.discard(plan.wave_id)
        cu = self._catchup
        if cu is None or not cu.owns(plan):
            return  # an abandoned catch-up's wave
        if isinstance(error, CopySourceFailed):  # an old station: a dead one switches now (its waves fail too)
            released = cu.skip(plan)
            if isinstance(error.__cause__, StationDown):
                cu.force = True
            else:
                cu.error = cu.error or str(error)
        elif error is not None:
            released = cu.abort(plan, f"a new-route station failed: {type(error).__name__}: {error}")
        else:
            released = cu.commit(plan)
            self.catchup_tokens += len(plan.token_ids)
        self._catchup_release(released)

    def _catchup_forget(self, seq_ids) -> None:
        """Sequences left the old route: drop their new-route KV too."""
        if self._catchup is not None:
            self._catchup_release(self._catchup.forget(tuple(seq_ids)))

    def _catchup_release(self, seq_ids: tuple[int, ...]) -> None:
        """Free these sequences' KV at the new stations, in order with the catch-up's own calls there."""
        if seq_ids:
            (self._catchup_copier or self._catchup_pipeline).release(tuple(seq_ids))
