"""Make before break: the new route's KV is built while the old route keeps decoding (no torch).

A route switch with catch-up (`scheduler.route_switch: catchup`) runs in three steps:

1. Catch-up. Plans (`CatchUp.plan`) name, for every running sequence, the tokens whose KV the old route has
   committed and the new route lacks. With `scheduler.catchup_kv: copy` (where both routes can) the new stations
   take a copy of the old stations' KV (orchestrator/kv_move.py: the same bits, whatever the kernels), one plan
   at a time; with `recompute` they are waves of the new route, one per new station in flight, beside the old
   route's own waves. Their
   size is paced by the old route's wave time (`old_wave`): where both routes share cores they grow only while
   the old route's waves stay within 1.75x their time before the catch-up, up to
   `scheduler.catchup_wave_tokens` rows. Recompute is only exact where every station of both routes gives
   a token the same KV bits however its sequence is cut into entries (the native kernels: `prefill_chunk_invariant`);
   the engine checks that before it starts one.
2. Ready. Once every running sequence is at most a few tokens behind the old route (`ready`), planning
   pauses and the waves in flight of both routes finish (their tokens still stream).
   With a copy, once the old route's waves are drained, one last plan copies what each sequence still lacks
   (`plan(final=True)`), so the new route starts where the old one stopped.
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

MIN_ROWS = 16  # the smallest catch-up wave, and the step it grows by
LEARN_WAVES = 3  # one-step old-route waves whose median is a busy route's baseline where none came before
STALL_WAVES = 8  # catch-up waves without a smaller largest lag before the switch accepts a looser one


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
    kv_source: str = ""  # how a catch-up built the new route's KV: "copy" or "recompute" ("" for a pause switch)


class CatchUp:
    """The new route's ledger and the sequences being moved onto it: one `shadow` Sequence per running sequence,
    sharing its request and output list, whose `num_computed` and `table` are the new route's."""

    def __init__(self, ledger: KVBlockLedger, wave_tokens: int, max_entries: int, ready_lag: int,
                 new_wave_id: Callable[[], int], started: float, baseline_s: float | None = None,
                 residual_rows: int | None = None, old_depth: int = 1, slowdown: float = 1.75,
                 step: int = MIN_ROWS, learn: bool = False) -> None:
        """An empty catch-up over `ledger` (the new route's blocks, every one free); wave ids from `new_wave_id`
        (the scheduler's counter, so no wave id is used twice at a station). `baseline_s`: the old route's wave
        time before the catch-up (None: it was idle), which paces the catch-up's wave size (`old_wave`).
        `residual_rows`: the rows the first wave on the new route may hold (default `wave_tokens`); `old_depth`:
        the old route's waves in flight (each carries about 1/old_depth of the running sequences); `slowdown`:
        `scheduler.catchup_slowdown` (0: no pacing); `step`: the smallest plan and the step it grows by (MIN_ROWS
        for waves, more for copies, whose rows cost far less); `learn`: the old route was busy with several-step
        calls only, whose time per step is no measure of the one-step calls it runs during a catch-up: the baseline
        is then the median of its first LEARN_WAVES one-step waves, the plans kept at `step` rows until then."""
        self.ledger = ledger
        self.wave_tokens, self.max_entries, self.ready_lag = wave_tokens, max_entries, ready_lag
        self.baseline_s = baseline_s if slowdown else None  # 0: unpaced
        self.slowdown = slowdown
        self.residual_rows = residual_rows or wave_tokens
        self.old_depth = old_depth
        self._best_lag, self._best_wave = 1 << 62, 0  # the smallest largest-lag seen, and the catch-up wave then
        self._floor = self._step = min(step, wave_tokens)
        self._learnt: list[float] | None = [] if learn and slowdown and self.baseline_s is None else None
        self.rows = wave_tokens if self.baseline_s is None and self._learnt is None else self._floor  # starts small
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

    def _busy(self) -> set[int]:
        """Seq ids in a catch-up wave now."""
        return {e.seq_id for p in self._in_flight.values() for e in p.entries}

    def owns(self, plan: WavePlan) -> bool:
        """True if `plan` is one of this catch-up's waves in flight."""
        return plan.wave_id in self._in_flight

    def plan(self, running: list[Sequence], final: bool = False) -> WavePlan | None:
        """The next catch-up wave: the committed tokens each running sequence not in a catch-up wave still lacks
        on the new route, oldest sequence first, within `rows` rows (at least twice the tokens one wave of the
        old route adds, so it gains on the decode) and `max_entries` entries. `final`: everything every sequence
        lacks, in one plan (a copy's last one, with the old route drained)."""
        if (self.closing and not final) or self.error is not None:
            return None
        busy = self._busy()
        gain = 2 * -(-len(running) // self.old_depth)  # twice the tokens one old-route wave adds: always gains
        entries, tokens, budget = [], [], max(self.rows, min(self.wave_tokens, gain))
        if final:
            budget = sum(seq.num_computed for seq in running)
        for seq in running:
            if budget < 1 or (len(entries) >= self.max_entries and not final):
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

    def skip(self, plan: WavePlan) -> tuple[int, ...]:
        """A plan was not carried out (an old station could not export): its shadows stay where they were (the
        reserved blocks stay theirs, to be filled by a later plan). Returns the seq ids forgotten meanwhile."""
        del self._in_flight[plan.wave_id]
        return self._release_dropped(plan)

    def forgotten(self, seq_id: int) -> bool:
        """True if `seq_id` left the old route while a plan holding it is in flight (any thread may ask: a KV
        copy drops such a sequence from its plan when an old station no longer holds it)."""
        return seq_id in self._dropped

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

    def old_wave(self, seconds: float, steps: int = 1) -> None:
        """The old route committed a wave of `steps` steps that took `seconds` a step from send to commit: the
        pacing. Where both routes share hardware a catch-up wave delays the old route's next one, so its wave time
        is the streams' token gap. Plans start at `step` rows (MIN_ROWS for waves); while the old route's waves stay
        within `slowdown` x their time before the catch-up (or the learnt one) they grow by `step` (up to
        `wave_tokens`), and a slower one cuts them by a quarter (never below `step`; `plan` takes at least twice what
        one old-route wave adds, so the catch-up always gains). On hardware of its own the catch-up slows nothing
        and soon runs at `wave_tokens`."""
        if self.baseline_s is None:
            if self._learnt is not None and steps == 1:
                self._learnt.append(seconds)
                if len(self._learnt) == LEARN_WAVES:
                    self.baseline_s = sorted(self._learnt)[LEARN_WAVES // 2]
            return
        if seconds > self.slowdown * self.baseline_s:
            self.rows = max(self._floor, self.rows * 3 // 4)
        else:
            self.rows = min(self.wave_tokens, self.rows + self._step)

    def old_commit(self, seq_id: int) -> None:
        """The old route committed a token of `seq_id` while the catch-up ran."""
        self.decoded[seq_id] = self.decoded.get(seq_id, 0) + 1

    def forget(self, seq_ids: tuple[int, ...]) -> tuple[int, ...]:
        """These sequences left the old route (ended, cancelled, preempted): drop their shadows. Returns the seq
        ids whose new-route KV must be released now (one in a catch-up wave is released when the wave ends)."""
        busy = self._busy()
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
        routes: the catch-up cannot get closer while the old route decodes), or, once the chase has stopped
        gaining for STALL_WAVES catch-up waves, up to 16 tokens while all residual chunks still fit one wave
        (at most `residual_rows` together). A residual chunk costs about as much as a decode row."""
        loose = min(16, self.residual_rows // max(1, running))
        return max(1, min(self.ready_lag, loose)) if self.waves - self._best_wave < STALL_WAVES else max(1, loose)

    def ready(self, running: list[Sequence]) -> bool:
        """True when every running sequence the new route can hold is at most `lag_limit` tokens behind."""
        lag = max((seq.num_computed - (self.shadows[seq.seq_id].num_computed if seq.seq_id in self.shadows else 0)
                   for seq in running if seq.seq_id not in self.no_room), default=0)
        if lag < self._best_lag:
            self._best_lag, self._best_wave = lag, self.waves
        return lag <= self.lag_limit(len(running))

    def progress(self, running: list[Sequence], now: float) -> CatchUpProgress:
        """A snapshot for status pages."""
        moving = [s for s in running if s.seq_id not in self.no_room]
        done = sum(self.shadows[s.seq_id].num_computed for s in moving if s.seq_id in self.shadows)
        return CatchUpProgress(len(moving), done, max(0, sum(s.num_computed for s in moving) - done), self.waves,
                               len(self.no_room), now - self.started)
