"""Continuous-batching scheduler: admission, token and KV budgets, wave plans, retirement.

Pure Python, no torch; tested with fake station outputs. Each plan() builds one ragged
wave (orchestrator.wave_builder): 1-token entries of decoding sequences first, then prompt (or
recompute) chunks within `max_wave_tokens`, then admissions from the waiting queue. Several waves may be
in flight; a sequence is in at most one. KV is counted in the stations' paged blocks.

Where a sequence's station KV must be released:
- it finished at a commit, or was cancelled/finished while in that wave: `CommitResult.released`;
- cancel()/finish() of a sequence not in flight: their return value;
- preemption inside plan(), or a cancelled sequence whose wave was aborted: `take_releases()`,
  which the engine must drain after every plan() and abort_wave(), BEFORE sending the wave
  (the wave may reuse the blocks the preempted sequence held).
"""
from __future__ import annotations

import logging

from mesh.core.config import SchedulerConfig
from mesh.core.params import SamplingParams
from mesh.core.wave import SampledToken
from orchestrator.scheduler_counts import SchedulerCounts, admission_refusal
from orchestrator.scheduler_types import (REFUSAL_REASONS, AdmissionError, CommitResult, KVLimits, SchedulerStats,
                               TokenEvent, WaveFlight, WavePlan)
from orchestrator.kv_ledger import KVBlockLedger
from orchestrator.sequence import Request, Sequence, SequenceStatus, SequenceTable, WaitingQueue
from orchestrator.scheduler_route import RouteMoves
from orchestrator.wave_builder import WaveBuilder

log = logging.getLogger(__name__)

__all__ = ["REFUSAL_REASONS", "AdmissionError", "CommitResult", "KVLimits", "Scheduler", "SchedulerStats",
           "TokenEvent", "WavePlan"]


class Scheduler(RouteMoves):
    """Plans ragged waves over live sequences and retires them from sampled tokens."""

    def __init__(self, config: SchedulerConfig, limits: KVLimits, eos_token_ids: tuple[int, ...]) -> None:
        """An idle scheduler with every KV block free."""
        self.config = config
        self.limits = limits
        self.eos_token_ids = frozenset(eos_token_ids)
        self._ledger = self._new_ledger(limits)
        self._waiting = WaitingQueue(config.short_first, config.short_prompt_tokens, config.max_skips)
        self._seqs = SequenceTable()
        self._in_flight: dict[int, WaveFlight] = {}  # by wave id
        self._pending_releases: list[int] = []
        self._next_wave_id = 0
        self._arrivals = 0
        self._counts = SchedulerCounts()
        self._probes: set[int] = set()  # live probe sequences: outside the admission bound, each with a lane of its own

    def _new_ledger(self, limits: KVLimits) -> KVBlockLedger:
        """A ledger of every block free; its prefix cache on when asked for and exact on these stations."""
        if self.config.prefix_cache and not limits.prefill_chunk_invariant:
            log.warning("prefix cache off on this route: its stations' prefill depends on how a prompt is chunked "
                        "(not the native float32 kernels), so a cached prefix could change tokens")
        return KVBlockLedger(limits.kv_blocks, limits.block_tokens,
                             self.config.prefix_cache and limits.prefill_chunk_invariant)

    @property
    def prefix_cache(self) -> bool:
        """True while shared prompt prefixes are served from cached KV blocks."""
        return self._ledger.prefix_cache

    def add(self, seq_id: int, request_id: str, prompt_ids: tuple[int, ...], params: SamplingParams,
            probe: bool = False) -> None:
        """Queue a request, or raise AdmissionError (400 never fits / invalid, 503 queue full).

        The bound is `max_seqs + max_queue` live sequences: a burst fills the free lanes and then the queue,
        though the sequences only move into their lanes at the next plan(). A `probe` (a health check's
        1-token proof) is queued first, counts against neither lanes nor queue, and is the caller's to bound."""
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id} is already live")
        prompt = tuple(prompt_ids)
        refusal = admission_refusal(prompt, params, self.limits, self._ledger.blocks_for,
                                    self.live() - len(self._probes), self.config.max_seqs, self.config.max_queue, probe)
        if refusal is not None:
            self._counts.refusals[refusal.reason] += 1
            raise refusal
        seq = Sequence(seq_id, Request(request_id, prompt, params), arrival=self._arrivals)
        self._arrivals += 1
        self._seqs.add(seq)
        if probe:
            self._probes.add(seq_id)
            self._waiting.push_front(seq)
        else:
            self._waiting.push_back(seq)

    def plan(self, max_entries: int | None = None, max_steps: int = 1, reply_steps: int = 0) -> WavePlan | None:
        """Build the next wave from sequences not in flight (None when nothing can be scheduled); a wave of
        decodes only, with nothing else to schedule, may run up to `max_steps` decode steps in one call, its
        samples streamed back every `reply_steps` of them (0, or as many as the call runs: at its end)."""
        lanes = self.config.max_seqs + len(self._probes)
        cap = lanes if max_entries is None else max_entries
        if cap < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        wave = WaveBuilder(self.config.max_wave_tokens, cap, self._ledger, self._seqs, self._preempt)
        ready = [s for s in self._seqs.running if s.in_flight_wave is None]
        wave.add_oversized_replay(ready)
        wave.add_decodes(ready)
        wave.add_chunks(ready)
        if not wave.preempted:  # no admission while KV is short
            wave.add_admissions(self._waiting, lanes)
        self._counts.prefix_queries += wave.prefix_queries
        self._counts.prefix_hits += wave.prefix_hits
        if not wave.entries:
            return None
        steps = wave.decode_steps(max_steps, self.limits.max_context, len(self._waiting), len(ready))
        reply_steps = reply_steps if 0 < reply_steps < steps else 0
        plan = WavePlan(tuple(wave.entries), tuple(wave.tokens), self._next_wave_id, tuple(wave.admitted), steps,
                        reply_steps)
        self._next_wave_id += 1
        for entry in wave.entries:
            self._seqs[entry.seq_id].in_flight_wave = plan.wave_id
        self._in_flight[plan.wave_id] = WaveFlight(plan, wave.decode_rows, wave.names)
        return plan

    def _preempt(self, seq: Sequence) -> None:
        """Drop `seq`'s KV and put it at the front of the waiting queue to be recomputed."""
        self._requeue(seq)
        seq.preemptions += 1
        self._counts.preemptions += 1

    def new_wave_id(self) -> int:
        """A wave id no plan has used (catch-up waves draw from the same counter)."""
        self._next_wave_id += 1
        return self._next_wave_id - 1

    def running(self) -> list[Sequence]:
        """The running sequences, oldest first (read only)."""
        return self._seqs.running

    def take_releases(self) -> tuple[int, ...]:
        """Seq ids whose station KV must be released before the next wave is sent (preemptions in
        plan(), cancelled sequences of an aborted wave); drains the list."""
        out, self._pending_releases = tuple(self._pending_releases), []
        return out

    def commit(self, plan: WavePlan, samples: list[SampledToken | None], first_step: int = 0) -> CommitResult:
        """Apply a wave's sampled tokens (aligned with plan.entries, step-major): advance, stream, retire.

        A several-step wave whose samples stream back commits in parts: `samples` then hold the steps from
        `first_step` on, each part taking up where the one before ended, and the wave leaves flight with the part
        holding its last step. A sequence that ends inside the wave stays in flight until then (its later steps'
        samples dropped); its KV is released with that last part. A wave ended early lands with an empty part
        after its last committed step (its blocks reserved for the steps it did not run stay with its sequences)."""
        flight = self._in_flight.get(plan.wave_id)
        if flight is None or flight.plan != plan:
            raise ValueError(f"wave {plan.wave_id} is not in flight")
        k = len(plan.entries)
        n = len(samples) // k
        if not samples and first_step == flight.steps_done > 0:  # ended early, at a step committed already
            released: list[int] = []
            self._land(flight, released)
            return CommitResult((), (), tuple(released), flight.steps_done)
        if n < 1 or n * k != len(samples) or first_step != flight.steps_done or first_step + n > plan.steps:
            raise ValueError(f"wave {plan.wave_id}: {len(samples)} samples for {k} entries from step {first_step} "
                             f"({flight.steps_done} of its {plan.steps} steps committed)")
        for j, (entry, sample) in enumerate(zip(plan.entries * n, samples)):
            if entry.sample is not None and sample is None and self._seqs[entry.seq_id].finish_reason is None:
                raise ValueError(f"wave {plan.wave_id}: seq {entry.seq_id} asked for a token at step "
                                 f"{first_step + j // k} and got none")
        events: list[TokenEvent] = []
        finished: list[int] = []
        if first_step == 0:
            for entry, sample in zip(plan.entries, samples):
                seq = self._seqs[entry.seq_id]
                filled = flight.names.get(seq.seq_id, [])
                self._ledger.computing(filled, -1)
                if seq.status is SequenceStatus.FINISHED:  # cancelled / finished while in flight
                    continue
                seq.num_computed = entry.end_pos
                seq.history.append(entry.n_tokens)
                self._ledger.name_blocks(seq, filled)
                if entry.sample is not None:
                    self._take(seq, sample, events, finished)
        for step in range(max(first_step, 1), first_step + n):  # later decode steps: each sequence until its stop
            row = (step - first_step) * k
            for i, entry in enumerate(plan.entries):
                seq = self._seqs[entry.seq_id]
                if seq.status is not SequenceStatus.FINISHED:
                    flight.later += 1
                    seq.num_computed += 1
                    seq.history.append(1)
                    self._take(seq, samples[row + i], events, finished)
        flight.steps_done += n
        released = []
        landed = flight.steps_done == plan.steps
        if landed:
            self._land(flight, released)
        return CommitResult(tuple(events), tuple(finished), tuple(released), flight.steps_done if landed else 0)

    def _land(self, flight: WaveFlight, released: list[int]) -> None:
        """A wave's last step is committed: its sequences leave flight, those that ended are dropped (into
        `released`), and the blocks its later steps filled are named for the prefix cache."""
        plan = flight.plan
        del self._in_flight[plan.wave_id]
        for entry in plan.entries:
            seq = self._seqs[entry.seq_id]
            seq.in_flight_wave = None
            if seq.status is SequenceStatus.FINISHED:
                self._drop(seq)
                released.append(seq.seq_id)
            elif plan.steps > 1 and self._ledger.prefix_cache:  # blocks the later steps filled, named now
                self._ledger.name_blocks(seq, self._ledger.names_filled(seq, seq.num_computed))
        self._count_wave(flight)

    def _count_wave(self, flight: WaveFlight) -> None:
        plan = flight.plan
        self._counts.count_wave(len(plan.token_ids), len(plan.entries), flight.decode_rows + flight.later,
                                self.config.max_wave_tokens)

    def _take(self, seq: Sequence, sample: SampledToken, events: list[TokenEvent], finished: list[int]) -> None:
        """Append a sampled token to `seq` and its event; where it ends the sequence, mark it finished (its wave
        drops it and releases its KV when it lands)."""
        seq.output_ids.append(sample.token_id)
        reason = self._stop_reason(seq, sample.token_id)
        events.append(TokenEvent(seq.seq_id, seq.request_id, sample.token_id, sample.logprob,
                                 tuple(sample.top_logprobs), reason))
        if reason is not None:
            self._end(seq, reason)
            finished.append(seq.seq_id)

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return "stop"
        if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.limits.max_context:
            return "length"
        return None

    def abort_wave(self, plan: WavePlan) -> None:
        """A wave failed: its sequences leave flight with num_computed as its committed steps left it (replanned later).
        KV of those cancelled meanwhile is reported by take_releases()."""
        flight = self._in_flight.pop(plan.wave_id, None)
        if flight is None:
            raise ValueError(f"wave {plan.wave_id} is not in flight")
        for entry in flight.plan.entries:
            seq = self._seqs[entry.seq_id]
            seq.in_flight_wave = None
            if not flight.steps_done:  # a wave with steps committed gave its first step's blocks their names then
                self._ledger.computing(flight.names.get(seq.seq_id, []), -1)
            if seq.status is SequenceStatus.FINISHED:
                self._drop(seq)
                self._pending_releases.append(seq.seq_id)
        if flight.steps_done:  # the parts it committed count as a wave
            self._count_wave(flight)

    def cancel(self, request_id: str) -> tuple[int, ...]:
        """End every sequence of a request; returns seq ids whose KV to release now (those in
        flight are released at their wave's commit, their sampled token dropped)."""
        release_now: list[int] = []
        for seq_id in self._seqs.of_request(request_id):
            release_now.extend(self.finish(seq_id, "cancelled"))
        return tuple(release_now)

    def finish(self, seq_id: int, reason: str) -> tuple[int, ...]:
        """End one sequence for an engine reason (e.g. a stop string); release semantics as cancel.
        Unknown or already finished ids are ignored."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.status is SequenceStatus.FINISHED:
            return ()
        was_waiting = seq.status is SequenceStatus.WAITING
        self._end(seq, reason)
        if seq.in_flight_wave is not None:
            return ()
        self._drop(seq)
        return () if was_waiting else (seq_id,)

    def _end(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished and take it out of the waiting queue or the running list."""
        if seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
        else:
            self._seqs.stop_running(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._probes.discard(seq.seq_id)
        self._counts.count_finish(reason)

    def _drop(self, seq: Sequence) -> None:
        """Free a finished sequence's KV blocks and forget it."""
        self._ledger.release(seq)
        self._seqs.forget(seq)

    def admissible(self) -> bool:
        """True when a request waits and a lane is free for it (a plan now would admit it, KV allowing)."""
        return bool(len(self._waiting)) and len(self._seqs.running) < self.config.max_seqs + len(self._probes)

    def live(self) -> int:
        """Sequences running or waiting (cheap: the engine asks every wave)."""
        return len(self._seqs.running) + len(self._waiting)

    def token_counts(self) -> tuple[int, int]:
        """Committed (prefill, decode) rows so far (cheap: the engine's rates read it every wave)."""
        return self._counts.prefill_tokens, self._counts.decode_tokens

    def has_work(self) -> bool:
        """True while any sequence waits or runs, or a wave is in flight."""
        return bool(self._seqs.running or len(self._waiting) or self._in_flight)

    def stats(self) -> SchedulerStats:
        """A snapshot of the counters and gauges."""
        return self._counts.snapshot(len(self._seqs.running), len(self._waiting), len(self._in_flight), self._ledger)
