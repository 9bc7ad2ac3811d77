"""Make before break: the new route's KV is built while the old route keeps decoding (no torch).

A route switch with catch-up (`scheduler.route_switch: catchup`) runs in three steps:

1. Catch-up. Waves of the new route (`CatchUp.plan`) recompute, for every running sequence, the tokens whose
   KV the old route has committed, in chunks of at most `scheduler.catchup_wave_tokens` rows, one wave per new
   station in flight, beside the old route's own waves. Only exact where every station of both routes gives
   a token the same KV bits however its sequence is cut into entries (the native kernels: `prefill_chunk_invariant`);
   the engine checks that before it starts one.
2. Ready. Once every running sequence is at most a few tokens behind the old route (`ready`), planning
   pauses and the waves in flight of both routes finish (their tokens still stream).
3. Adoption (Scheduler.adopt). Each sequence takes its new-route block table; the tokens decoded since its last
   catch-up chunk, with the one to sample, are one short chunk of the first wave on the new route. A sequence
   the new stations have no room for is re-prefilled there after the switch (today's pause, for it alone).

Sequences that end, are cancelled or preempted on the old route meanwhile are dropped here too (`forget`),
their new-route KV released; a sequence admitted meanwhile is caught up like the others.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mesh.core.wave import WaveEntry
from orchestrator.kv_ledger import KVBlockLedger
from orchestrator.scheduler_types import CatchUpProgress, WavePlan
from orchestrator.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SwitchReport:
    """What one route switch did, for tests, benchmarks and logs."""

    mode: str  # "catchup" (make before break) or "pause" (pause and re-prefill)
    reason: str  # why this mode ("" for a catch-up)
    catchup_seconds: float  # from the start of the catch-up to the pause (0 for a pause switch)
    catchup_waves: int  # catch-up waves committed
    catchup_tokens: int  # tokens whose KV the catch-up computed
    decoded_during_catchup: dict[int, int]  # seq id -> tokens the old route committed for it meanwhile
    residual: dict[int, int]  # seq id -> tokens left to compute on the new route at the switch (the sampled one incl.)
    replayed: tuple[int, ...]  # seq ids re-prefilled from nothing on the new route (no room, or a pause switch)
    pause_seconds: float  # from the pause of planning to the swap of the route


class CatchUp:
    """The new route's ledger and the sequences being moved onto it: one `shadow` Sequence per running sequence,
    sharing its request and output list, whose `num_computed` and `table` are the new route's."""

    def __init__(self, ledger: KVBlockLedger, wave_tokens: int, max_entries: int, ready_lag: int,
                 new_wave_id: Callable[[], int], started: float) -> None:
        """An empty catch-up over `ledger` (the new route's blocks, every one free); wave ids from `new_wave_id`
        (the scheduler's counter, so no wave id is used twice at a station)."""
        self.ledger = ledger
        self.wave_tokens, self.max_entries, self.ready_lag = wave_tokens, max_entries, ready_lag
        self._new_wave_id = new_wave_id
        self.started = started
        self.shadows: dict[int, Sequence] = {}
        self.no_room: set[int] = set()  # seq ids the new route cannot hold
        self._in_flight: dict[int, WavePlan] = {}
        self._dropped: dict[int, Sequence] = {}  # forgotten while in a catch-up wave: released when it ends
        self._releases: list[int] = []  # new-route KV to release before the next catch-up wave
        self.decoded: dict[int, int] = {}  # seq id -> old-route tokens committed during the catch-up
        self.waves = self.tokens = 0
        self.closing = False  # ready reached (or given up): no more catch-up waves
        self.error: str | None = None  # a new-route station failed: the catch-up is abandoned
        self.force = False  # an old-route station failed: switch now, whatever the lag

    @property
    def in_flight(self) -> int:
        """Catch-up waves at the new stations now."""
        return len(self._in_flight)

    def owns(self, plan: WavePlan) -> bool:
        """True if `plan` is one of this catch-up's waves in flight."""
        return plan.wave_id in self._in_flight

    def plan(self, running: list[Sequence]) -> WavePlan | None:
        """The next catch-up wave: the committed tokens each running sequence not in a catch-up wave still lacks
        on the new route, oldest sequence first, within `wave_tokens` rows and `max_entries` entries."""
        if self.closing or self.error is not None:
            return None
        busy = {e.seq_id for p in self._in_flight.values() for e in p.entries}
        entries, tokens, budget = [], [], self.wave_tokens
        for seq in running:
            if budget < 1 or len(entries) >= self.max_entries:
                break
            if seq.seq_id in busy or seq.seq_id in self.no_room:
                continue
            shadow = self.shadows.get(seq.seq_id)
            if shadow is None:
                shadow = self.shadows[seq.seq_id] = Sequence(seq.seq_id, seq.request, seq.arrival,
                                                             output_ids=seq.output_ids)
            n = min(seq.num_computed - shadow.num_computed, budget)
            if n < 1:
                continue
            end = shadow.num_computed + n
            if not self.ledger.reserve(shadow, end):
                self._no_room(seq.seq_id)
                continue
            entries.append(WaveEntry(seq.seq_id, shadow.num_computed, n, None,
                                     tuple(shadow.table[:self.ledger.blocks_for(end)])))
            tokens.extend(seq.token_slice(shadow.num_computed, end))
            budget -= n
        if not entries:
            return None
        plan = WavePlan(tuple(entries), tuple(tokens), self._new_wave_id())
        self._in_flight[plan.wave_id] = plan
        return plan

    def _no_room(self, seq_id: int) -> None:
        shadow = self.shadows.pop(seq_id)
        self.no_room.add(seq_id)
        if shadow.table:
            self.ledger.release(shadow)
            self._releases.append(seq_id)

    def take_releases(self) -> tuple[int, ...]:
        """Seq ids whose new-route KV must be released before the next catch-up wave; drains the list."""
        out, self._releases = tuple(self._releases), []
        return out

    def commit(self, plan: WavePlan) -> tuple[int, ...]:
        """A catch-up wave came back: its shadows advance. Returns the seq ids forgotten meanwhile, whose KV the
        new stations must now release."""
        del self._in_flight[plan.wave_id]
        for e in plan.entries:
            if e.seq_id in self._dropped:
                continue
            self.shadows[e.seq_id].num_computed = e.end_pos
            self.shadows[e.seq_id].history.append(e.n_tokens)
            self.tokens += e.n_tokens
        self.waves += 1
        return self._release_dropped(plan)

    def abort(self, plan: WavePlan, error: str) -> tuple[int, ...]:
        """A catch-up wave failed (a new-route station): the catch-up is abandoned with `error`. Returns the seq
        ids forgotten meanwhile (as commit)."""
        self._in_flight.pop(plan.wave_id, None)
        self.error = self.error or error
        self.closing = True
        return self._release_dropped(plan)

    def _release_dropped(self, plan: WavePlan) -> tuple[int, ...]:
        out = []
        for e in plan.entries:
            if (shadow := self._dropped.pop(e.seq_id, None)) is not None:
                self.ledger.release(shadow)  # only now: the wave wrote these blocks until it ended
                out.append(e.seq_id)
        return tuple(out)

    def old_commit(self, seq_id: int) -> None:
        """The old route committed a token of `seq_id` while the catch-up ran."""
        self.decoded[seq_id] = self.decoded.get(seq_id, 0) + 1

    def forget(self, seq_ids: tuple[int, ...]) -> tuple[int, ...]:
        """These sequences left the old route (ended, cancelled, preempted): drop their shadows. Returns the seq
        ids whose new-route KV must be released now (one in a catch-up wave is released when the wave ends)."""
        busy = {e.seq_id for p in self._in_flight.values() for e in p.entries}
        now = []
        for seq_id in seq_ids:
            self.no_room.discard(seq_id)
            shadow = self.shadows.pop(seq_id, None)
            if shadow is None:
                continue
            if seq_id in busy:
                self._dropped[seq_id] = shadow
            else:
                self.ledger.release(shadow)
                now.append(seq_id)
        return tuple(now)

    def lag_limit(self, running: int) -> int:
        """How far behind the old route a sequence may be at the switch: `ready_lag` (the waves in flight of both
        routes: the catch-up cannot get closer while the old route decodes), or up to 16 tokens while the
        residual chunks of all `running` sequences still fit one catch-up wave (a short chunk costs about as
        much as a decode row, so the switch need not wait for a closer chase)."""
        return max(self.ready_lag, min(16, self.wave_tokens // max(1, running)))

    def ready(self, running: list[Sequence]) -> bool:
        """True when every running sequence the new route can hold is at most `lag_limit` tokens behind."""
        limit = self.lag_limit(len(running))
        for seq in running:
            if seq.seq_id in self.no_room:
                continue
            shadow = self.shadows.get(seq.seq_id)
            if seq.num_computed - (shadow.num_computed if shadow else 0) > limit:
                return False
        return True

    def progress(self, running: list[Sequence], now: float) -> CatchUpProgress:
        """A snapshot for status pages."""
        moving = [s for s in running if s.seq_id not in self.no_room]
        done = sum(self.shadows[s.seq_id].num_computed for s in moving if s.seq_id in self.shadows)
        return CatchUpProgress(len(moving), done, max(0, sum(s.num_computed for s in moving) - done), self.waves,
                               len(self.no_room), now - self.started)
