"""Stats dataclasses -> Prometheus, in one place (each registry private, never the global one).

MetricsRegistry is the orchestrator's: gauges and counters mapped from EngineStats at scrape
time (a custom collector, so no Prometheus call lives in scheduling logic), per-request
counters and histograms observed by the API layer from a RequestRecord when a request ends,
and wave histograms fed by `observe_wave`. A station process's metrics are station/metrics.py's,
which also holds the name prefix and the exposition both endpoints serve.
Neither exposes a `_created` series: prometheus_client adds one per Counter and Histogram (a
creation timestamp), so those live in an inner registry read through `_WithoutCreated`.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from station.metrics import CONTENT_TYPE, PREFIX, exposition

if TYPE_CHECKING:
    from orchestrator.scheduler_types import EngineStats

__all__ = ["CONTENT_TYPE", "MetricsRegistry", "RequestRecord"]
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
WAVE_TOKEN_BUCKETS = tuple(float(2**i) for i in range(14))  # 1 .. 8192 rows
OCCUPANCY_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)  # switch / recovery
WAVE_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one served request did, as the API layer saw it (all choices together)."""

    prompt_tokens: int  # prompt length (counted once per request)
    completion_tokens: int  # tokens generated, all choices
    finish_reasons: tuple[str, ...]  # one per choice: stop | length | cancelled | error
    ttft_s: float | None = None  # arrival -> first token
    e2e_s: float | None = None  # arrival -> last choice finished
    queue_s: float | None = None  # arrival -> first scheduled (when the engine reports it)
    inter_token_s: tuple[float, ...] = ()  # gaps between consecutive tokens of each choice


class _EngineCollector(Collector):
    """Gauges and counters read from EngineStats (plus the API's own refusals) at scrape time."""

    def __init__(self, stats: Callable[[], "EngineStats"] | None, api_refusals: Callable[[], dict[str, int]]) -> None:
        self._stats, self._api_refusals = stats, api_refusals

    def collect(self):
        """One EngineStats snapshot -> metric families."""
        refusals = dict(self._api_refusals())
        if self._stats is not None:
            s = self._stats()
            for name, value, doc in (
                    ("num_requests_running", s.running, "Sequences in the running set."),
                    ("num_requests_waiting", s.waiting, "Sequences in the waiting queue."),
                    ("num_waves_in_flight", s.waves_in_flight, "Waves sent to the stations and not yet committed."),
                    ("kv_cache_usage_perc", s.kv_bytes_used / s.kv_bytes_total if s.kv_bytes_total else 0.0,
                     "Fraction of the stations' KV bytes in use (1 = full)."),
                    ("prefix_cache_blocks", s.kv_blocks_cached, "KV blocks kept for prefix reuse, referenced by none."),
                    ("prefix_cache_bytes", s.kv_bytes_cached, "Bytes of those blocks over every station."),
                    ("prefix_cache_enabled", int(s.prefix_cache), "1 while shared prompt prefixes are reused."),
                    ("route_catchup_in_progress", int(s.route_catchup is not None),
                     "1 while a new route builds the live sequences' KV (make before break)."),
                    ("route_catchup_tokens_behind", s.route_catchup.tokens_behind if s.route_catchup else 0,
                     "Tokens the new route of the catch-up under way still lacks.")):
                yield GaugeMetricFamily(PREFIX + name, doc, value=value)
            for name, value, doc in (
                    ("num_preemptions", s.preemptions, "Sequences preempted to free KV (recomputed later)."),
                    ("waves", s.waves, "Waves committed."),
                    ("wave_prefill_rows", s.prefill_tokens, "Prompt and recompute rows computed in waves."),
                    ("wave_decode_rows", s.decode_tokens, "Decode rows computed in waves."),
                    ("prefix_cache_queries", s.prefix_cache_queries, "Prompt tokens looked up in the prefix cache."),
                    ("prefix_cache_hits", s.prefix_cache_hits, "Prompt tokens found in the prefix cache."),
                    ("route_switches", s.route_switches, "Route switches begun (mesh scale, add-station)."),
                    ("route_catchup_tokens", s.route_catchup_tokens,
                     "Tokens whose KV a catch-up copied to or recomputed on a new route while the old one decoded."),
                    ("route_replayed_sequences", s.route_replayed_sequences,
                     "Sequences a route switch moved by pause and re-prefill (no room on the new route, or a "
                     "switch that could not catch up)."),
                    ("recoveries", len(s.recovery_seconds), "Rebuilds of the route after a lost station."),
                    ("waves_ended_early", s.waves_ended_early, "Streamed several-step waves asked to end before "
                     "their last step (a request waited for a lane, or the route was to change).")):
                yield CounterMetricFamily(PREFIX + name, doc, value=value)
            yield _histogram("route_switch_pause_seconds", "Per route switch, the longest wait of a live stream "
                             "for its next token.", s.route_switch_pauses)
            yield _histogram("recovery_seconds", "Per lost station, the time to rebuild the route.", s.recovery_seconds)
            for reason, count in s.refusals.items():
                refusals[reason] = refusals.get(reason, 0) + count
        rejected = CounterMetricFamily(PREFIX + "requests_rejected", "Requests refused, by reason.", labels=["reason"])
        for reason, count in sorted(refusals.items()):
            rejected.add_metric([reason], count)
        yield rejected


def _histogram(name: str, doc: str, values: tuple[float, ...]) -> HistogramMetricFamily:
    """A histogram family over every value observed so far (few: one per switch or recovery)."""
    buckets = [(str(le), sum(v <= le for v in values)) for le in PAUSE_BUCKETS] + [("+Inf", len(values))]
    return HistogramMetricFamily(PREFIX + name, doc, buckets=buckets, sum_value=sum(values))


class _WithoutCreated(Collector):
    """The families of `inner` without the `<name>_created` samples prometheus_client adds to Counters and
    Histograms; local to this registry, where `disable_created_metrics()` would switch them off process-wide."""

    def __init__(self, inner: CollectorRegistry) -> None:
        self._inner = inner

    def collect(self):
        """The inner registry's families (fresh objects every scrape), less their `_created` samples."""
        for family in self._inner.collect():
            created = family.name + "_created"
            family.samples = [s for s in family.samples if s.name != created]
            yield family


class MetricsRegistry:
    """The orchestrator's metrics: a private CollectorRegistry rendered by GET /metrics."""

    def __init__(self, engine_stats: Callable[[], "EngineStats"] | None = None) -> None:
        """`engine_stats` (usually `engine.stats`) is called once per scrape."""
        self.registry = CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self._api_refusals: dict[str, int] = {}
        self.registry.register(_EngineCollector(engine_stats, self._refusals_snapshot))
        r = CollectorRegistry(auto_describe=False)  # the instruments below, rendered through _WithoutCreated
        self.registry.register(_WithoutCreated(r))
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of served requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated for served requests.",
                                         registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished choices, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Gap between consecutive tokens of a choice.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the end of the last choice.",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduled.",
                                    buckets=E2E_BUCKETS, registry=r)
        self.wave_tokens = Histogram(PREFIX + "wave_tokens", "Rows (tokens) in one wave.",
                                     buckets=WAVE_TOKEN_BUCKETS, registry=r)
        self.wave_occupancy = Histogram(PREFIX + "wave_occupancy", "Rows of a wave / max_wave_tokens.",
                                        buckets=OCCUPANCY_BUCKETS, registry=r)
        self.wave_duration = Histogram(PREFIX + "wave_duration_seconds", "Send to commit of one wave.",
                                       buckets=WAVE_SECONDS_BUCKETS, registry=r)
        self.client_disconnects = Counter(PREFIX + "client_disconnects",
                                          "Clients that went away before their request body had arrived.", registry=r)

    def _refusals_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._api_refusals)

    def observe_rejection(self, reason: str) -> None:
        """Count a request the API refused before it reached the engine (e.g. reason="invalid")."""
        with self._lock:
            self._api_refusals[reason] = self._api_refusals.get(reason, 0) + 1

    def observe_client_disconnect(self) -> None:
        """Count a client that closed its connection before sending the whole body (or sent a bad chunk)."""
        self.client_disconnects.inc()

    def observe_request(self, record: RequestRecord) -> None:
        """Count and time one request that ended (finished, cancelled or failed)."""
        self.prompt_tokens.inc(record.prompt_tokens)
        self.generation_tokens.inc(record.completion_tokens)
        for reason in record.finish_reasons:
            self.request_success.labels(finished_reason=reason).inc()
        for hist, value in ((self.ttft, record.ttft_s), (self.e2e, record.e2e_s), (self.queue_time, record.queue_s)):
            if value is not None:
                hist.observe(max(0.0, value))
        for gap in record.inter_token_s:
            self.itl.observe(max(0.0, gap))

    def observe_wave(self, tokens: int, occupancy: float, seconds: float) -> None:
        """One committed wave: its rows, rows / max_wave_tokens, and send-to-commit seconds."""
        self.wave_tokens.observe(tokens)
        self.wave_occupancy.observe(occupancy)
        self.wave_duration.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry (station.metrics.exposition, served as CONTENT_TYPE)."""
        return exposition(self.registry)
