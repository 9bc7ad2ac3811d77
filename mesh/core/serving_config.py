"""How the orchestrator plans waves (SchedulerConfig) and how its HTTP surface listens (ApiConfig): frozen dataclasses
that validate themselves on construction, part of mesh.core.config's tree (which names them too). No torch."""
from __future__ import annotations

import math
from dataclasses import dataclass

from mesh.core.config_checks import is_int, require as _require

MAX_DECODE_STEPS = 64  # decode steps one station call may run (scheduler.decode_steps, Forward's `steps`)
CHAIN_CALL_STEPS, CHAIN_REPLY_STEPS = 16, 4  # a direct chain's calls by default: 16 decode steps, a reply every 4
LONE_CALL_STEPS = 4  # a lone station's calls by default: 4 decode steps, one reply
HIDDEN_PATHS = ("direct", "hub")  # how hidden rows go from station to station (orchestrator/relay.py)
ROUTE_SWITCHES = ("catchup", "pause")  # how a live route moves onto new stations (orchestrator/catchup.py)
CATCHUP_SOURCES = ("copy", "recompute")  # where a catch-up gets the new route's KV (orchestrator/kv_move.py)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How the orchestrator plans waves and admits requests."""

    max_seqs: int = 32  # live sequences (lanes) at once
    max_wave_tokens: int = 512  # rows in one wave: decode tokens + prompt chunks
    max_queue: int = 256  # requests waiting beyond the max_seqs lanes: max_seqs + max_queue live, the next gets 503
    short_first: bool = False  # let short prompts jump the FIFO queue
    short_prompt_tokens: int = 64  # a prompt this long or shorter counts as short
    max_skips: int = 8  # a request passed over this many times is admitted next, short or not
    extra_waves: int = 0  # waves in flight beyond one per station: hides call latency, in smaller groups
    decode_steps: int = 0  # decode steps per station call while only decodes run; 0: by route (call_steps)
    reply_steps: int = 0  # steps per streamed reply of such a call; 0: one a call (by route with decode_steps 0)
    prefix_cache: bool = True  # reuse committed KV blocks of shared prompt prefixes (where the stations make it exact)
    hidden_path: str = "direct"  # "direct": station to station (gRPC stations); "hub": through the orchestrator
    route_switch: str = "catchup"  # "catchup": build the new route's KV while the old one decodes; "pause": stop and re-prefill
    catchup_kv: str = "copy"  # "copy": the old stations' KV is copied to the new ones; "recompute": the new ones prefill it
    catchup_copy_tokens: int = 1024  # most positions one KV copy of a catch-up moves (paced like the waves, in 1/16 steps)
    catchup_wave_tokens: int = 256  # most rows of one catch-up wave (paced down while it slows the old route's waves)
    catchup_slowdown: float = 1.75  # catch-up waves shrink while the old route's waves take longer than this x before; 0: unpaced

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_wave_tokens", "max_queue", "short_prompt_tokens", "max_skips",
                     "catchup_wave_tokens", "catchup_copy_tokens"):
            v = getattr(self, name)
            _require(is_int(v) and v > 0, f"scheduler.{name} must be a positive integer, got {v!r}")
        _require(isinstance(self.prefix_cache, bool), f"scheduler.prefix_cache must be true or false, got {self.prefix_cache!r}")
        _require(is_int(self.extra_waves) and self.extra_waves >= 0,
                 f"scheduler.extra_waves must be an integer >= 0, got {self.extra_waves!r}")
        _require(is_int(self.decode_steps) and 0 <= self.decode_steps <= MAX_DECODE_STEPS,
                 f"scheduler.decode_steps must be an integer in [0, {MAX_DECODE_STEPS}] (0: by route), "
                 f"got {self.decode_steps!r}")
        _require(is_int(self.reply_steps) and 0 <= self.reply_steps <= MAX_DECODE_STEPS,
                 f"scheduler.reply_steps must be an integer in [0, {MAX_DECODE_STEPS}], got {self.reply_steps!r}")
        _require(self.hidden_path in HIDDEN_PATHS,
                 f"scheduler.hidden_path must be one of {list(HIDDEN_PATHS)}, got {self.hidden_path!r}")
        _require(isinstance(self.catchup_slowdown, (int, float)) and not isinstance(self.catchup_slowdown, bool)
                 and math.isfinite(self.catchup_slowdown) and (self.catchup_slowdown == 0 or self.catchup_slowdown > 1),
                 f"scheduler.catchup_slowdown must be 0 (unpaced) or a number > 1, got {self.catchup_slowdown!r}")
        _require(self.catchup_kv in CATCHUP_SOURCES,
                 f"scheduler.catchup_kv must be one of {list(CATCHUP_SOURCES)}, got {self.catchup_kv!r}")
        _require(self.route_switch in ROUTE_SWITCHES,
                 f"scheduler.route_switch must be one of {list(ROUTE_SWITCHES)}, got {self.route_switch!r}")
        _require(self.max_wave_tokens >= self.max_seqs,
                 f"scheduler.max_wave_tokens ({self.max_wave_tokens}) must be >= max_seqs ({self.max_seqs}) "
                 "so every decoding sequence fits in one wave")

    def call_steps(self, stations: int) -> tuple[int, int]:
        """(decode steps per call, steps per streamed reply; 0: one reply a call) on a route of `stations` stations:
        the fields where decode_steps is set, else by route: a chain of stations keeps its wave 16 steps and
        streams its samples every 4 (`reply_steps` if set), one station runs 4 steps with one reply a call. Measured
        (README, issue 13): 16 + 4 gave a chain +3-5% and SIMULATED GPU stations +0.5-1.7%; one CPU station using
        every core ran 1-5% slower, its orchestrator's per-part work competing with the station's threads."""
        if self.decode_steps:
            return self.decode_steps, self.reply_steps
        if stations > 1:
            return CHAIN_CALL_STEPS, self.reply_steps or CHAIN_REPLY_STEPS
        return LONE_CALL_STEPS, self.reply_steps


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """The OpenAI-compatible HTTP surface."""

    host: str = "127.0.0.1"  # interface to bind
    port: int = 8000  # TCP port
    api_key: str | None = None  # bearer token required on every route but /health and /metrics
    model_name: str | None = None  # name reported by /v1/models (default: the model directory's name)
    max_n: int = 8  # cap on the `n` choices of one request
    health_cache_s: float = 2.0  # GET /health reuses a successful 1-token proof this long (0: prove every call)

    def __post_init__(self) -> None:
        _require(isinstance(self.port, int) and 0 <= self.port < 65536, f"api.port out of range: {self.port!r}")
        _require(isinstance(self.max_n, int) and self.max_n >= 1, "api.max_n must be >= 1")
        _require(isinstance(self.health_cache_s, (int, float)) and not isinstance(self.health_cache_s, bool)
                 and math.isfinite(self.health_cache_s) and self.health_cache_s >= 0,
                 f"api.health_cache_s must be a finite number >= 0, got {self.health_cache_s!r}")
