"""A station process's Prometheus metrics: Station.stats() (and the server's wire byte counts) mapped at
scrape time, in a private registry, labelled by station and layer range.

PREFIX is every wavemesh series', and `exposition` is how every wavemesh endpoint (this one and the
orchestrator's /metrics) renders a registry. Names carry no colon, and the answer is always the text format
0.0.4 whatever the scraper's Accept header: prometheus_client's OpenMetrics answer rewrites a colon to `_` in
sample names (`escaping=underscores`, and only in the samples), so a name with one would be stored under two
spellings depending on how it was scraped. Colons are Prometheus' mark for recording rules anyway."""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "wavemesh_"
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what `exposition` renders, for the Content-Type header


def exposition(registry: CollectorRegistry) -> bytes:
    """`registry` in the Prometheus text format 0.0.4 (served as CONTENT_TYPE by every wavemesh endpoint)."""
    return generate_latest(registry)


class _StationCollector(Collector):
    def __init__(self, station, labels: dict[str, str], wire: Callable[[], Mapping[str, int]] | None,
                 releases_queued: Callable[[], int] | None) -> None:
        self._station, self._labels, self._wire, self._releases_queued = station, labels, wire, releases_queued

    def collect(self):
        """One Station.stats() snapshot -> metric families."""
        names, values = list(self._labels), list(self._labels.values())
        s = self._station.stats()

        def family(kind, name: str, doc: str, value=None, extra: dict[str, float] | None = None, label: str = ""):
            fam = kind(PREFIX + name, doc, labels=names + ([label] if label else []))
            if extra is None:
                fam.add_metric(values, value)
            for key, v in (extra or {}).items():
                fam.add_metric(values + [key], v)
            return fam

        yield family(CounterMetricFamily, "station_forward_seconds", "Seconds spent in forward, by phase.",
                     extra={"prefill": s.prefill_seconds, "decode": s.decode_seconds}, label="phase")
        yield family(CounterMetricFamily, "station_forwards", "Forward calls (waves) run.", s.forwards)
        yield family(CounterMetricFamily, "station_rows", "Rows (tokens) run through the layers.", s.rows)
        yield family(GaugeMetricFamily, "station_kv_bytes_used", "KV bytes in use.", s.kv.bytes_used)
        yield family(GaugeMetricFamily, "station_kv_bytes_total", "KV byte budget.", s.kv.bytes_total)
        yield family(GaugeMetricFamily, "station_sequences", "Sequences holding KV.", s.kv.sequences)
        yield family(GaugeMetricFamily, "station_load_seconds", "Seconds the station's load took (weights, KV).",
                     s.load_seconds)
        yield family(GaugeMetricFamily, "station_packed_weights",
                     "Layers (and head) whose packed weights were mapped from the packed cache or packed at load.",
                     extra={"cache": s.packed_mapped, "load": s.packed_at_load}, label="source")
        yield family(CounterMetricFamily, "station_graph_waves", "Decode waves replayed from CUDA graphs.",
                     s.graph_waves)
        yield family(CounterMetricFamily, "station_graph_captures", "CUDA graphs captured (decode wave shapes).",
                     s.graph_captures)
        yield family(CounterMetricFamily, "station_releases_queued",
                     "Releases that found a call holding the station and were queued for it to apply.",
                     self._releases_queued() if self._releases_queued is not None else 0)
        wire = dict(self._wire()) if self._wire is not None else {}
        yield family(CounterMetricFamily, "station_wire_bytes", "Message bytes on the wire, by direction.",
                     extra={d: wire.get(d, 0) for d in sorted({"in", "out", *wire})}, label="direction")


class StationMetrics:
    """A station process's metrics, labelled by station and layer range; `render()` for its endpoint."""

    def __init__(self, station, labels: Mapping[str, str] | None = None,
                 wire: Callable[[], Mapping[str, int]] | None = None,
                 releases_queued: Callable[[], int] | None = None) -> None:
        """`station` has `.stats() -> StationStats` and `.spec.layers`; `wire()` returns bytes by direction
        ({"in": n, "out": m}) as counted by the server, `releases_queued()` the releases its station lock queued
        (station.station_lock). Labels default to station="s<start>", layers="start-end"."""
        start, end = station.spec.layers
        merged = {"station": f"s{start}", "layers": f"{start}-{end}"}
        merged.update({str(k): str(v) for k, v in (labels or {}).items()})
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StationCollector(station, merged, wire, releases_queued))

    def render(self) -> bytes:
        """The Prometheus text exposition of this station's metrics."""
        return exposition(self.registry)

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
        """Serve `render()` over HTTP (any GET path, e.g. /metrics) on host:port (0 = a free port) from a
        daemon thread; returns the server: `.server_port` is the bound port, `.shutdown()` stops it."""
        httpd = ThreadingHTTPServer((host, port), _MetricsHandler)
        httpd.daemon_threads = True
        httpd.render = self.render
        threading.Thread(target=httpd.serve_forever, name="station-metrics", daemon=True).start()
        return httpd


class _MetricsHandler(BaseHTTPRequestHandler):
    """GET (any path) answers the server's `render()` as CONTENT_TYPE; nothing is logged per scrape."""

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        """One scrape: the exposition, whatever the Accept header asked for."""
        body = self.server.render()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class' signature
        """Quiet: a scrape every few seconds is not news."""
