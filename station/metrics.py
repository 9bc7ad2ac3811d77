"""A station process's Prometheus metrics: Station.stats() (and the server's wire byte counts) mapped at
scrape time, in a private registry, labelled by station and layer range. PREFIX is every wavemesh series'."""
from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "wavemesh:"


class _StationCollector(Collector):
    def __init__(self, station, labels: dict[str, str], wire: Callable[[], Mapping[str, int]] | None) -> None:
        self._station, self._labels, self._wire = station, labels, wire

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
        wire = dict(self._wire()) if self._wire is not None else {}
        yield family(CounterMetricFamily, "station_wire_bytes", "Message bytes on the wire, by direction.",
                     extra={d: wire.get(d, 0) for d in sorted({"in", "out", *wire})}, label="direction")


class StationMetrics:
    """A station process's metrics, labelled by station and layer range; `render()` for its endpoint."""

    def __init__(self, station, labels: Mapping[str, str] | None = None,
                 wire: Callable[[], Mapping[str, int]] | None = None) -> None:
        """`station` has `.stats() -> StationStats` and `.spec.layers`; `wire()` returns bytes by direction
        ({"in": n, "out": m}) as counted by the server. Labels default to station="s<start>", layers="start-end"."""
        start, end = station.spec.layers
        merged = {"station": f"s{start}", "layers": f"{start}-{end}"}
        merged.update({str(k): str(v) for k, v in (labels or {}).items()})
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StationCollector(station, merged, wire))

    def render(self) -> bytes:
        """The Prometheus text exposition of this station's metrics."""
        return generate_latest(self.registry)

    def serve(self, host: str = "127.0.0.1", port: int = 0):
        """Serve this registry over HTTP (any path, e.g. /metrics) on host:port (0 = a free port) from a
        daemon thread; returns the server: `.server_port` is the bound port, `.shutdown()` stops it."""
        httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        return httpd
