"""What the scheduler counts and what it refuses: the admission checks a request passes before it is queued, and
the running tallies (waves, tokens, occupancy, refusals, finishes) its SchedulerStats are read from, and the
engine's token rates over a window of those tallies (TokenRates).

Pure Python, no torch, like the scheduler itself.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mesh.core.params import SamplingParams
from orchestrator.kv_ledger import KVBlockLedger
from orchestrator.scheduler_types import REFUSAL_REASONS, AdmissionError, KVLimits, SchedulerStats


def admission_refusal(prompt: tuple[int, ...], params: SamplingParams, limits: KVLimits,
                      blocks_for: Callable[[int], int], live: int, max_seqs: int, max_queue: int,
                      probe: bool) -> AdmissionError | None:
    """Why a request cannot be queued (400 invalid / never fits, 503 queue full), or None when it can:
    `blocks_for(tokens)` the KV blocks they take (the ledger's), `live` sequences hold places of
    max_seqs + max_queue (a `probe` takes none)."""
    if not prompt:
        return AdmissionError("invalid", 400, "prompt is empty: at least one token is required", "prompt")
    if not all(isinstance(t, int) and t >= 0 for t in prompt):
        return AdmissionError("invalid", 400, "prompt token ids must be non-negative integers", "prompt")
    total, ctx = len(prompt) + params.max_tokens, limits.max_context
    if total > ctx:
        return AdmissionError("never_fits", 400,
                              f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                              f"exceeds the context of {ctx} tokens",
                              "prompt" if len(prompt) >= ctx else "max_tokens")
    need = blocks_for(total)
    if need > limits.kv_blocks:
        return AdmissionError("never_fits", 400,
                              f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                              f"need {need} KV blocks of {limits.block_tokens} tokens; the stations hold "
                              f"{limits.kv_blocks} blocks", "max_tokens")
    if not probe and live >= max_seqs + max_queue:
        return AdmissionError("queue_full", 503, f"waiting queue is full ({live} sequences live, the bound is "
                              f"max_seqs {max_seqs} + max_queue {max_queue}); retry later", None)
    return None


@dataclass(slots=True)
class SchedulerCounts:
    """Running tallies since the scheduler started (committed waves only for the wave figures)."""

    waves: int = 0
    prefill_tokens: int = 0  # committed rows of prompt / recompute chunks
    decode_tokens: int = 0  # committed rows of decode steps
    last_rows: int = 0
    last_entries: int = 0
    sum_entries: int = 0
    max_entries: int = 0
    sum_occupancy: float = 0.0  # rows / max_wave_tokens, summed over waves
    max_occupancy: float = 0.0
    preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached
    refusals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0))
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason

    def count_wave(self, rows: int, entries: int, decode_rows: int, max_wave_tokens: int) -> None:
        """A committed wave of `rows` rows in `entries` entries, `decode_rows` of them decode steps."""
        occupancy = rows / max_wave_tokens
        self.waves += 1
        self.decode_tokens += decode_rows
        self.prefill_tokens += rows - decode_rows
        self.last_rows, self.last_entries = rows, entries
        self.sum_occupancy += occupancy
        self.max_occupancy = max(self.max_occupancy, occupancy)
        self.sum_entries += entries
        self.max_entries = max(self.max_entries, entries)

    def count_finish(self, reason: str) -> None:
        """A sequence ended for `reason`."""
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def snapshot(self, running: int, waiting: int, in_flight: int, ledger: KVBlockLedger) -> SchedulerStats:
        """The scheduler's stats: these counts, its sequences and waves, its KV ledger's blocks."""
        waves = self.waves or 1
        return SchedulerStats(
            running=running, waiting=waiting, in_flight_waves=in_flight,
            kv_blocks_used=ledger.used, kv_blocks_total=ledger.total,
            preemptions=self.preemptions, prefill_tokens=self.prefill_tokens,
            decode_tokens=self.decode_tokens, waves=self.waves, last_wave_tokens=self.last_rows,
            mean_wave_occupancy=self.sum_occupancy / waves, max_wave_occupancy=self.max_occupancy,
            refusals=dict(self.refusals), finished=dict(self.finished),
            last_wave_entries=self.last_entries, mean_wave_entries=self.sum_entries / waves,
            max_wave_entries=self.max_entries, prefix_cache=ledger.prefix_cache,
            prefix_cache_queries=self.prefix_queries, prefix_cache_hits=self.prefix_hits,
            kv_blocks_cached=ledger.cached)


class TokenRates:
    """Prefill and decode tokens per second over the last `window_s` seconds of committed waves (the engine's
    EngineStats rates): the scheduler's running token counts marked at each commit, the oldest within the window
    taken as the start."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._marks: deque[tuple[float, int, int]] = deque()  # (monotonic time, prefill tokens, decode tokens)

    def mark(self, now: float, prefill_tokens: int, decode_tokens: int) -> None:
        """Record the counts after a commit at `now`; forget marks older than the window."""
        self._marks.append((now, prefill_tokens, decode_tokens))
        while now - self._marks[0][0] > self._window_s:
            self._marks.popleft()

    def rates(self, now: float, prefill_tokens: int, decode_tokens: int) -> tuple[float, float]:
        """(prefill, decode) tokens per second from the oldest mark kept to these counts at `now`; (0, 0) before
        any commit."""
        if not self._marks:
            return 0.0, 0.0
        start, prefill0, decode0 = self._marks[0]
        span = max(now - start, 1e-9)
        return (prefill_tokens - prefill0) / span, (decode_tokens - decode0) / span
