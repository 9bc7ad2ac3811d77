"""A station's gRPC server: the servicer (station.servicer) on a port, with health, auth, mTLS and a relay link.

Internal auth: started with `token=...`, the server refuses every call without the
metadata `authorization: Bearer <token>` (compared in constant time) with
UNAUTHENTICATED, before the request is decoded. Only the standard health service
(grpc.health.v1.Health) stays open, so Ray / Kubernetes probes work without the
secret; it tells nothing but SERVING / NOT_SERVING. With `tls=StationTls(...)` the
port speaks mutual TLS (client certificates required, health included); the token
may be used with or without it. The server binds only `host` (default loopback).

Beside the gRPC port, a station serves a relay link (station.relay_link, its port in
InfoReply.relay_port) on the same host: the same Forward for waves relayed by the
station before it, with the same token, mTLS and status codes.
"""
from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mesh.core.allocator import keep_large_blocks
from mesh.core.config import DTYPE_BYTES
from mesh.core.proto import station_pb2_grpc
from mesh.core.transport import StationTls, host_port
from station.interceptors import SERVICE_NAME, CountForwardBytes, StrictDecode, TokenAuth, WireBytes
from station.probe import HealthProbe, ProbeConfig
from station.link_shm import SEGMENT_BYTES
from station.relay import Successors
from station.relay_link import RelayLinkServer
from station.server_limits import ServerLimits
from station.servicer import StationServicer
from station.step import Station

log = logging.getLogger(__name__)


class StationServer:
    """A running gRPC server over one station: its address, and how to stop it."""

    def __init__(self, server: grpc.Server, health_servicer: health.HealthServicer, servicer: StationServicer,
                 host: str, port: int, probe: HealthProbe | None = None,
                 relay_link: RelayLinkServer | None = None) -> None:
        self._server = server
        self.relay_link = relay_link  # None: relays come as gRPC Forward calls
        self._health = health_servicer
        self._probe = probe
        self.servicer = servicer  # its `successors` are closed with the server
        self.host, self.port = host, port
        self.address = host_port(host, port)

    def stop(self, grace: float | None = 1.0) -> None:
        """Report NOT_SERVING, finish in-flight calls for up to `grace` seconds, then stop."""
        if self._probe is not None:
            self._probe.stop()
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        if self.relay_link is not None:  # after the grace: a wave relayed to this station meanwhile still lands
            self.relay_link.stop()
        if self.servicer.successors is not None:
            self.servicer.successors.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (True) or `timeout` passes (False)."""
        return self._server.wait_for_termination(timeout)

    def __enter__(self) -> "StationServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=0)


def start_server(station: Station, host: str = "127.0.0.1", port: int = 0, limits: ServerLimits = ServerLimits(),
                 metrics_address: str = "", *, token: str | None = None,
                 tls: StationTls | None = None, probe: ProbeConfig | None = None,
                 relay_tls: StationTls | None = None, relay_link: bool = True,
                 relay_shm: bool = True) -> StationServer:
    """Serve `station` on host:port (0 = a free port); health is SERVING once this returns.

    `probe`: keep the health answer true to the forward path (station.probe): a probe row every
    `probe.period_s`; NOT_SERVING while it fails or a forward holds the station past `probe.hang_s`.
    `token`: Forward / Release / Info need `authorization: Bearer <token>` (health stays open).
    `tls`: serve mutual TLS (clients must present a certificate signed by `tls.ca`).
    `relay_tls`: what this station presents when it relays a wave to the next station (default `tls`: one
    certificate for both sides, as `mesh up` deploys; give the orchestrator's client material where station
    certificates are for serving only). Relayed calls carry `token` too.
    `relay_link`: serve relayed waves on a relay link (station.relay_link) beside gRPC, and relay to successors
    over theirs; False: relays in and out are gRPC Forward calls (for comparison).
    `relay_shm`: a relay to a successor on this host sends its rows through shared memory (station.link_shm);
    False: by TCP (for comparison).
    """
    keep_large_blocks()  # a wave's payload buffers (hidden rows, MiB each) reuse freed memory, not fresh pages
    cfg = station.config
    kv_row = 2 * (station.spec.end - station.spec.start) * cfg.num_key_value_heads * cfg.head_dim * DTYPE_BYTES[station.spec.dtype]
    size = limits.message_bytes(cfg.hidden_size, kv_row)
    options = [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
               ("grpc.so_reuseport", 0)]  # a port taken by another process is an error, not shared
    wire = WireBytes()
    interceptors = ([TokenAuth(token)] if token is not None else []) + [StrictDecode(), CountForwardBytes(wire)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=limits.max_workers,
                                                    thread_name_prefix="station-grpc"),
                         options=options, interceptors=interceptors)
    # relayed waves go on with this station's own credentials
    successors = Successors(token, relay_tls or tls, size, wire, use_links=relay_link,
                            shm_bytes=SEGMENT_BYTES if relay_shm else 0)
    servicer = StationServicer(station, limits, wire, metrics_address, successors)
    station_pb2_grpc.add_StationServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bind = host_port(host, port)
    try:
        if tls is None:
            bound = server.add_insecure_port(bind)
        else:
            creds = grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca,
                                                require_client_auth=True)
            bound = server.add_secure_port(bind, creds)
    except RuntimeError as err:
        raise OSError(f"station server: cannot bind {bind}: {err}") from err
    if bound == 0:
        raise OSError(f"station server: cannot bind {bind}")
    link = None  # bound after gRPC's port, so a failed bind leaves nothing listening
    if relay_link:
        try:
            link = RelayLinkServer(host, servicer.forward_answer, prepare=servicer.prepare_forward,
                                   open_steps=servicer.open_steps, token=token,
                                   tls=tls, max_message_bytes=size, wire=wire)
        except OSError as err:
            raise OSError(f"station relay link: cannot bind {host}: {err}") from err
        servicer.relay_port = link.port
    server.start()
    def set_serving(ok: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            health_servicer.set(service, status)

    set_serving(True)  # the model is loaded: the Station exists
    prober = HealthProbe(servicer.probe, set_serving, probe).start() if probe is not None else None
    log.info("station [%d, %d) serving on %s:%d%s%s", station.spec.start, station.spec.end, host, bound,
             " (mTLS)" if tls else "", " (token)" if token is not None else "")
    return StationServer(server, health_servicer, servicer, host, bound, prober, link)
