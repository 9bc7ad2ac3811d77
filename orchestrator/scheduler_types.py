"""Value types of the orchestrator's interfaces: limits, plans, token events, commit results, stats, refusals."""
from __future__ import annotations

from dataclasses import dataclass, field

from mesh.core.config import is_int
from mesh.core.wave import WaveEntry

REFUSAL_REASONS = ("never_fits", "queue_full", "invalid")


class AdmissionError(Exception):
    """A request is refused: `reason` (never_fits | queue_full | invalid), HTTP `status`, `param`."""

    def __init__(self, reason: str, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class KVLimits:
    """What the stations can hold: context length and the smallest station's paged KV."""

    max_context: int  # most tokens (prompt + output) one sequence may reach
    kv_blocks: int  # KV blocks the smallest station holds
    block_tokens: int  # tokens per KV block
    prefill_chunk_invariant: bool = False  # every station gives a prompt the same KV bits however it is chunked

    def __post_init__(self) -> None:
        for name in ("max_context", "kv_blocks", "block_tokens"):
            v = getattr(self, name)
            if not (is_int(v) and v > 0):
                raise ValueError(f"KVLimits.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.prefill_chunk_invariant, bool):
            raise ValueError(f"KVLimits.prefill_chunk_invariant must be a bool, got {self.prefill_chunk_invariant!r}")

    @property
    def sequence_tokens(self) -> int:
        """The most tokens one sequence can reach here: the context, or fewer where the KV pool holds fewer."""
        return min(self.max_context, self.kv_blocks * self.block_tokens)


@dataclass(frozen=True, slots=True)
class WavePlan:
    """One wave: its entries and their token ids concatenated in entry order."""

    entries: tuple[WaveEntry, ...]
    token_ids: tuple[int, ...]
    wave_id: int
    admitted: tuple[tuple[int, int], ...] = ()  # (seq id, prompt tokens found in the prefix cache) of each admission
    steps: int = 1  # decode steps the station runs (> 1: every entry a sampled decode; its blocks cover them all)
    reply_steps: int = 0  # steps per streamed reply of such a call (0 or >= steps: its samples come back at its end)


@dataclass(slots=True)
class WaveFlight:
    """A wave in flight: its plan, its decode rows, the prefix-cache names of the blocks it fills, and how far
    its commits have come (a several-step wave whose samples stream back commits in parts)."""

    plan: WavePlan
    decode_rows: int
    names: dict[int, list[bytes]]
    steps_done: int = 0  # steps committed so far
    later: int = 0  # tokens its steps after the first added


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One newly generated token of a sequence (finish_reason set on its last)."""

    seq_id: int
    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: tuple
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a commit produced: tokens to stream, sequences finished, station KV to release."""

    events: tuple[TokenEvent, ...]
    finished: tuple[int, ...]  # seq ids that finished (stop / length) at this commit
    released: tuple[int, ...]  # seq ids whose station KV must be released now
    landed_steps: int = 0  # where this commit landed the wave (it left flight): the steps it ran; 0: still in flight


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counters and gauges of the scheduler; wave figures count committed waves."""

    running: int
    waiting: int
    in_flight_waves: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    prefill_tokens: int  # committed rows of prompt / recompute chunks
    decode_tokens: int  # committed rows of decode steps
    waves: int
    last_wave_tokens: int
    mean_wave_occupancy: float  # rows / max_wave_tokens, averaged over waves
    max_wave_occupancy: float
    refusals: dict[str, int]
    finished: dict[str, int]  # by finish reason (stop, length, cancelled, engine reasons)
    last_wave_entries: int = 0
    mean_wave_entries: float = 0.0
    max_wave_entries: int = 0
    prefix_cache: bool = False  # shared prompt prefixes are served from cached KV blocks
    prefix_cache_queries: int = 0  # prompt tokens of fresh admissions looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached (not computed again)
    kv_blocks_cached: int = 0  # blocks nobody references, kept for reuse (counted free for admission)


@dataclass(frozen=True, slots=True)
class CatchUpProgress:
    """Where a catch-up stands (status page, `mesh status`, `mesh scale` progress)."""

    sequences: int  # running sequences being moved
    tokens_done: int  # their tokens whose KV is on the new route
    tokens_behind: int  # their tokens committed on the old route and not yet on the new one
    waves: int  # catch-up waves committed so far
    no_room: int  # sequences the new stations cannot hold (re-prefilled after the switch)
    seconds: float  # since the catch-up began


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine: queues, waves, token counts and rates, KV, outcomes."""

    running: int
    waiting: int
    waves_in_flight: int
    waves: int
    wave_occupancy_last: float
    wave_occupancy_mean: float
    wave_occupancy_max: float
    prefill_tokens: int
    decode_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    kv_bytes_used: int
    kv_bytes_total: int
    preemptions: int
    refusals: dict[str, int] = field(default_factory=dict)
    finished: dict[str, int] = field(default_factory=dict)
    prefix_cache: bool = False  # shared prompt prefixes are served from cached KV blocks
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    kv_blocks_cached: int = 0  # KV blocks nobody references, kept for reuse
    kv_bytes_cached: int = 0  # their bytes over every station
    recovery_seconds: tuple[float, ...] = ()  # how long each rebuild of the route after a lost station took
    route_switches: int = 0  # route switches begun (mesh scale, add-station)
    route_switch_pauses: tuple[float, ...] = ()  # per switch: the longest wait of a live stream for its next token
    route_error: str | None = None  # set while a lost station is not back (new requests get 503)
    route_catchup: CatchUpProgress | None = None  # a make-before-break switch under way, else None
    route_catchup_tokens: int = 0  # tokens whose KV catch-ups copied or recomputed on a new route, all switches
    waves_ended_early: int = 0  # streamed several-step waves asked to end before their last step
    route_replayed_sequences: int = 0  # sequences moved by pause-and-re-prefill instead (fallback or setting)
