"""The Ray actor of one station (thin): loads the Station, owns its gRPC server, reports where it listens.

Waves never pass through Ray: the orchestrator reads `address()` and talks gRPC.
Each station also serves its own Prometheus endpoint (StationMetrics over the Station's
stats and the servicer's wire bytes) on the same host, advertised in Info's `metrics_address`.
Ray places the actor (num_cpus / num_gpus of the StationSpec) and restarts it when
its process dies; a restarted actor reloads the weights, starts with an empty KV
and listens on a NEW port, so callers re-read `address()` after a failure.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from mesh.core.compute import on_compute_thread
from mesh.core.config import StationSpec
from mesh.core.long_lived import freeze_long_lived
from mesh.core.transport import host_port
from station.cores import claim_cores
from station.metrics import StationMetrics
from station.kv import DEFAULT_BLOCK_TOKENS
from station.probe import ProbeConfig
from station.server import ServerLimits, start_server
from station.replies import info_reply
from station.step import Station

_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def spec_from(spec: StationSpec | Mapping[str, Any]) -> StationSpec:
    """A StationSpec from itself or from its dict (layers as a list or tuple)."""
    if isinstance(spec, StationSpec):
        return spec
    d = dict(spec)
    if "layers" in d:
        d["layers"] = tuple(d["layers"])
    if "resources" in d:
        d["resources"] = tuple(tuple(pair) for pair in d["resources"])
    return StationSpec(**d)


class StationActor:
    """One station inside a Ray actor: the Station, its gRPC server, and where it listens."""

    def __init__(self, model_dir: str, spec: StationSpec | Mapping[str, Any], host: str = "127.0.0.1",
                 block_tokens: int = DEFAULT_BLOCK_TOKENS, limits: ServerLimits | None = None,
                 token: str | None = None, tls: Any = None, probe: ProbeConfig | None = None) -> None:
        """Load the station and serve it; `token` / `tls` (StationTls): what every caller must present;
        `probe`: prove the forward path to the health service (see station.probe)."""
        spec = spec_from(spec)
        # Everything imported so far, and the model loaded below, lives as long as the process: frozen, the cyclic
        # collector stops walking it (~170k objects after torch and Ray), where each full collection during the
        # load took 90-130 ms of a station's start
        freeze_long_lived(collect=False)
        # the station's num_cpus cores are its own: pinned where the node has them free (before any torch thread
        # starts, so the compute thread and its OpenMP team inherit them), and as many torch threads
        self._spec = spec
        self.cores = claim_cores(spec.num_cpus, _core_claim_dir())
        if not self.cores.pinned:
            print(f"wavemesh station [{spec.start}, {spec.end}): {self.cores.reason}", file=sys.stderr, flush=True)
        on_compute_thread(torch.set_num_threads, max(1, int(spec.num_cpus)))
        self.station = Station(model_dir, spec, block_tokens)
        if self.station.packed_cache_dir is not None:
            done = self.station.packed_load
            print(f"wavemesh station [{spec.start}, {spec.end}): loaded in {self.station.load_seconds:.2f} s; the "
                  f"packed weights of {len(done.mapped)} of {len(done.mapped) + len(done.packed)} layers (the head "
                  f"counted as one) mapped from the packed cache {self.station.packed_cache_dir}, the rest packed "
                  f"and stored there", file=sys.stderr, flush=True)
        self.server = None
        advertised = ray.util.get_node_ip_address() if host in _WILDCARD_HOSTS else host
        # the metrics endpoint starts first, so that Info can name it; it reads the servicer's wire bytes late
        self._metrics_http = StationMetrics(self.station, wire=self._wire_bytes,
                                            releases_queued=self._releases_queued).serve(host, 0)
        self._metrics_address = host_port(advertised, self._metrics_http.server_port)
        self.server = start_server(self.station, host=host, port=0, limits=limits or ServerLimits(),
                                   metrics_address=self._metrics_address, token=token, tls=tls,
                                   probe=probe)
        self._address = host_port(advertised, self.server.port)
        freeze_long_lived()  # the load's own garbage collected first (~1 ms with the imports frozen)

    def _wire_bytes(self) -> dict[str, int]:
        """Forward request / reply bytes counted by the gRPC servicer (zero before it starts)."""
        if self.server is None:
            return {"in": 0, "out": 0}
        return dict(self.server.servicer.wire_bytes)

    def _releases_queued(self) -> int:
        """Releases the servicer's station lock queued behind a call holding it (zero before it starts)."""
        return 0 if self.server is None else self.server.servicer.lock.queued_releases

    def address(self) -> str:
        """The "host:port" the station's gRPC service listens on (new after every restart)."""
        return self._address

    def metrics_address(self) -> str:
        """The "host:port" of the station's Prometheus endpoint (new after every restart)."""
        return self._metrics_address

    def ready(self) -> bool:
        """True once the weights are loaded and the server runs (the constructor has returned)."""
        return True

    def pid(self) -> int:
        """The actor's process id (tests kill it to exercise restarts)."""
        return os.getpid()

    def info(self) -> dict[str, Any]:
        """The station's Info as a plain dict, plus its address, pid and placement (see `placement`)."""
        reply = info_reply(self.station, self._metrics_address)
        d = {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}
        d.update(address=self._address, **self.placement())
        return d

    def placement(self) -> dict[str, Any]:
        """Where the station runs: its pid and Ray node, the cores its process may use now, whether they are
        pinned (and why not), and its torch thread count."""
        in_ray = ray.is_initialized()  # the class also runs in-process (tests); never start a Ray just to ask
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id() if in_ray else None,
                "node_ip": ray.util.get_node_ip_address() if in_ray else None,
                "cpu_affinity": sorted(os.sched_getaffinity(0)), "cpu_pinned": self.cores.pinned,
                "cpu_pinning_note": self.cores.reason, "torch_threads": on_compute_thread(torch.get_num_threads)}

    def step_spans(self) -> list[tuple[float, float, int, int]]:
        """The station's last steps (station.timeline.StepSpan: wall-clock start, seconds, rows, entries), oldest
        first: what a benchmark takes its pipeline's idle apart from."""
        return [tuple(span) for span in self.station.timeline.spans()]

    def pin(self) -> bool:
        """Claim the station's cores again if it runs unpinned (cores others held when it started, such as the
        old route's stations while the mesh grows, may be free now); True when it is pinned."""
        if not self.cores.pinned:
            self.cores = claim_cores(self._spec.num_cpus, _core_claim_dir())
        return self.cores.pinned

    def shutdown(self, grace: float = 1.0) -> None:
        """Stop the gRPC server (health goes NOT_SERVING first) and the metrics endpoint; the actor
        process stays until killed."""
        self.server.stop(grace)
        self.cores.release()
        self._metrics_http.shutdown()
        self._metrics_http.server_close()


def _core_claim_dir() -> Path:
    """The folder where the stations of this Ray session on this machine claim cores (see station.cores)."""
    try:
        session = ray._private.worker.global_worker.node.get_session_dir_path()
    except AttributeError:  # not inside a Ray worker (a test building the actor class directly)
        return Path(tempfile.gettempdir()) / f"wavemesh-cores-{os.getuid()}"
    return Path(session) / "wavemesh-cores"


def create_station(model_dir: str | Path, spec: StationSpec, *, name: str | None = None, max_restarts: int = 3,
                   host: str = "127.0.0.1", block_tokens: int = DEFAULT_BLOCK_TOKENS,
                   limits: ServerLimits | None = None, token: str | None = None, tls: Any = None,
                   probe: ProbeConfig | None = None) -> Any:
    """Start a StationActor with the spec's Ray resources and return its handle at once (it loads meanwhile).

    Call tasks are never retried by Ray (max_task_retries=0): a wave lost with a dead station is
    replayed by the orchestrator, which knows what the KV held.
    """
    remote_cls = ray.remote(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=dict(spec.resources),
                            max_restarts=max_restarts, max_task_retries=0)(StationActor)
    if name is not None:
        remote_cls = remote_cls.options(name=name)
    return remote_cls.remote(str(model_dir), dataclasses.asdict(spec), host, block_tokens, limits, token, tls, probe)


def launch_station(model_dir: str | Path, spec: StationSpec, *, name: str | None = None, max_restarts: int = 3,
                   host: str = "127.0.0.1", block_tokens: int = DEFAULT_BLOCK_TOKENS,
                   limits: ServerLimits | None = None, timeout_s: float = 300.0, token: str | None = None,
                   tls: Any = None) -> tuple[Any, str]:
    """Start a StationActor and wait until it serves; returns (actor handle, gRPC address)."""
    handle = create_station(model_dir, spec, name=name, max_restarts=max_restarts, host=host,
                            block_tokens=block_tokens, limits=limits, token=token, tls=tls)
    return handle, station_address(handle, timeout_s)


def station_address(handle: Any, timeout_s: float = 300.0, poll_s: float = 0.2) -> str:
    """The station's current gRPC address, waiting while Ray (re)starts the actor.

    A call to an actor Ray is (re)starting waits in Ray's queue until the actor is up; one made just after
    its process died fails at once with ActorUnavailableError (max_task_retries=0), and is retried here
    until `timeout_s`. A dead actor (no restarts left) raises ActorDiedError, and one that is not up and
    answering in time raises GetTimeoutError (a hang and a slow restart look alike: see `actor_state`).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise GetTimeoutError(f"station actor gave no address within {timeout_s}s")
        try:
            return ray.get(handle.address.remote(), timeout=left)
        except ActorUnavailableError:
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


# Ray's actor states in which the actor is being (re)started: calls to it wait in Ray's queue meanwhile
STARTING_STATES = frozenset({"DEPENDENCIES_UNREADY", "PENDING_CREATION", "RESTARTING"})


def actor_record(handle: Any) -> dict[str, Any] | None:
    """Ray's own record of a station actor: {"State": ALIVE / RESTARTING / DEAD / ..., "NumRestarts", "Pid", ...},
    read from the GCS (the public state API goes through the dashboard, which wavemesh does not start).

    This is what tells a station Ray is restarting (a call to it waits in Ray's queue and times out, exactly as
    a call to a hung process does) from one that is alive and does not answer. None if Ray cannot say.
    """
    from ray._private import state  # the GCS actor table; no dashboard needed

    try:
        record = state.actors(actor_id=handle._actor_id.hex())
    except Exception:  # noqa: BLE001 - a Ray without this table: the caller falls back on the call's outcome
        return None
    return record if isinstance(record, dict) and record.get("State") else None


def actor_state(handle: Any) -> str | None:
    """The actor's state in Ray's record (see `actor_record`), or None if Ray cannot say."""
    record = actor_record(handle)
    return None if record is None else str(record["State"])


def stop_station(handle: Any, grace: float = 1.0, timeout_s: float = 30.0) -> None:
    """Stop a station's server, then end its actor for good (no restart)."""
    try:
        ray.get(handle.shutdown.remote(grace), timeout=timeout_s)
    except (RayActorError, GetTimeoutError):
        pass  # dead, restarting or stuck: the kill below ends it all the same
    finally:
        ray.kill(handle, no_restart=True)
