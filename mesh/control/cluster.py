"""YAML -> Ray -> station actors -> engine: a running mesh, and how it grows while serving.

`Cluster` owns the Ray connection, one actor per station, the gRPC links to them
and the engine that drives waves over those links. Growing (`scale`,
`add_station`) starts the new plan's stations beside the old ones while the old
route keeps serving, switches the engine's route between waves (live sequences
are re-prefilled on the new route, their tokens unchanged), then retires the
stations the new plan no longer uses.
"""
from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import ray

from mesh.control.mesh_config import MeshConfig
from mesh.control.ray_connect import connect_ray
from mesh.control.layer_plan import plan_layers, split_weights
from mesh.core.config import ConfigError, ModelConfig, StationSpec
from orchestrator.engine import Engine
from orchestrator.remote import RemoteLink
from mesh.control.placement import check_placement
from mesh.control.station_recovery import bring_back
from station.actor import create_station, station_address, stop_station
from station.probe import ProbeConfig

def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Cluster:
    """A running mesh over Ray actors."""

    def __init__(self, config: MeshConfig, model_dir: str | Path, progress: Callable[[str], None] = _say) -> None:
        self.config = config
        self.model_dir = Path(model_dir)
        self.model = ModelConfig.from_dir(self.model_dir)
        self.progress = progress
        # this machine's cores, where the stations run on it (a local Ray): `num_cpus: auto` shares them out
        self._local_cores = (os.cpu_count() or 1) if config.ray.address is None else None
        self.specs: tuple[StationSpec, ...] = config.resolve(self.model, self._local_cores)
        self.engine = None
        self._actors: dict[StationSpec, object] = {}
        self._links: dict[StationSpec, object] = {}
        self._owns_ray = False
        # every station call carries the cluster token: the YAML's, or one made for this cluster
        self.token = config.cluster.token or secrets.token_urlsafe(24)
        self.tls = config.cluster.tls()
        self._scale_lock = threading.Lock()  # the route's stations and links: held briefly, recovery takes it
        self._replan_lock = threading.Lock()  # one re-plan (load + switch) at a time
        self._generation = 0
        self._stopping = threading.Event()
        self.on_restart: Callable[[], None] | None = None  # called after a station came back on a new address
        self._watcher = threading.Thread(target=self._watch, name="station-health-watch", daemon=True)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self, tokenizer=None) -> None:
        """Connect to (or start) Ray, launch every station, and build the engine over them."""
        # logical CPUs of a local Ray: room for the old and the new plan side by side while growing
        self._owns_ray = connect_ray(self.config.ray, num_cpus=max(os.cpu_count() or 1, 4 * len(self.specs) + 8))
        try:
            check_placement(self.specs, ray.nodes())  # before any station starts: never a silent pending actor
        except ConfigError:
            if self._owns_ray:
                ray.shutdown()
            raise
        self._launch(self.specs)
        self.engine = Engine([self._links[s] for s in self.specs], self.model, self.config.scheduler, tokenizer,
                             recover=self.recover)
        self._watcher.start()

    def stop(self) -> None:
        """Stop the engine and every station actor (and Ray, if this cluster started it)."""
        self._stopping.set()
        if self.engine is not None:
            self.engine.close()
        for spec in list(self._actors):
            self._retire(spec)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    # ---- growth ----------------------------------------------------------------------------------
    def scale(self, count: int) -> tuple[StationSpec, ...]:
        """Re-plan the model over `count` stations (balanced as `stations.balance` says) and move serving onto them."""
        if not (isinstance(count, int) and 1 <= count <= self.model.num_hidden_layers):
            raise ConfigError(f"stations: expected 1..{self.model.num_hidden_layers}, got {count!r}")
        weights = split_weights(self.model, self.config.dtype, self.config.balance)
        ranges = plan_layers(self.model.num_hidden_layers, count, weights)
        return self.reroute(self._share_cores([replace(self.specs[0], layers=r) for r in ranges]))

    def add_station(self, layers: tuple[int, int] | None = None, num_gpus: float | None = None) -> tuple[StationSpec, ...]:
        """Add one station: on `layers` (the others shrink around it), or splitting the largest station."""
        specs = list(self.specs)
        if layers is None:
            big = max(specs, key=lambda s: s.end - s.start)
            if big.end - big.start < 2:
                raise ConfigError("add-station: every station holds one layer; nothing left to split")
            mid = big.start + (big.end - big.start) // 2
            layers = (mid, big.end)
        a, b = layers
        if not (0 <= a < b <= self.model.num_hidden_layers):
            raise ConfigError(f"layers: expected A-B with 0 <= A < B <= {self.model.num_hidden_layers}, got {a}-{b}")
        new = []
        for s in specs:  # clip every station around [a, b)
            for lo, hi in ((s.start, min(s.end, a)), (max(s.start, b), s.end)):
                if lo < hi:
                    new.append(replace(s, layers=(lo, hi)))
        added = replace(specs[0], layers=(a, b), num_gpus=specs[0].num_gpus if num_gpus is None else num_gpus)
        return self.reroute(self._share_cores(sorted(new + [added], key=lambda s: s.start)))

    def _share_cores(self, plan: list[StationSpec]) -> tuple[StationSpec, ...]:
        """The plan, under `num_cpus: auto` with this machine's cores shared out again over its stations (a kept
        station whose share changes is restarted), else as it is."""
        if not self.config.auto_cpus():
            return tuple(plan)
        cpus = self.config.station_cpus(len(plan), self._local_cores)
        return tuple(replace(s, num_cpus=cpus) for s in plan)

    def _fresh_copies(self, specs: tuple[StationSpec, ...]) -> tuple[StationSpec, ...]:
        """A plan that keeps some of the serving stations (add-station leaves the others as they are) would share
        them between the routes, and a switch over a shared station pauses and re-prefills. With
        `route_switch: catchup` the kept ranges are loaded again as fresh copies beside the serving ones (retired
        after the switch, as every replaced station is) when Ray has the resources for every station the plan
        starts now; else they are shared, and the switch pauses (said here)."""
        kept = [s for s in specs if s in self.specs]
        if self.config.scheduler.route_switch != "catchup" or not kept or len(kept) == len(specs):
            return specs
        def fresh_copy(spec: StationSpec) -> StationSpec:  # a copy the serving route does not use (maybe prepared)
            while spec in self.specs:
                spec = replace(spec, copy=spec.copy + 1)
            return spec

        fresh = tuple(fresh_copy(s) for s in specs)
        need: dict[str, float] = {}
        for spec in (s for s in fresh if s not in self._actors):  # what this re-plan starts now
            for name, amount in (("CPU", spec.num_cpus), ("GPU", spec.num_gpus), *spec.resources):
                need[name] = need.get(name, 0.0) + amount
        free = ray.available_resources()
        short = sorted(name for name, amount in need.items() if amount > free.get(name, 0.0) + 1e-9)
        if short:
            self.progress(f"kept station(s) {[list(s.layers) for s in kept]} serve both routes: no room for fresh "
                          f"copies ({', '.join(short)} short), so the switch pauses and re-prefills")
            return specs
        return fresh

    def prepare(self, specs: tuple[StationSpec, ...]) -> tuple[StationSpec, ...]:
        """Check a plan (placement included: a station no node can hold is refused at once, naming the resource)
        and start (load) the stations it needs that are not running yet. Loading holds no lock that recovery
        needs; a station that does not come up ends every station this call started."""
        specs = self.config.with_stations(specs).resolve(self.model)
        with self._scale_lock:
            todo = tuple(s for s in specs if s not in self._actors)
        check_placement(todo, ray.nodes())
        self._launch(todo)
        return specs

    def reroute(self, specs: tuple[StationSpec, ...]) -> tuple[StationSpec, ...]:
        """Start what `specs` needs beside the current stations, switch the route between waves,
        then retire the old route's stations that the new plan does not use. One re-plan at a time; a
        re-plan that fails ends the stations it started and leaves the route as it was. The plan already
        serving is left as it is (nothing loads, no stream waits), as scaling to the current size does elsewhere."""
        with self._replan_lock:
            if self.config.with_stations(specs).resolve(self.model) == self.specs:
                self.progress(f"already serving {len(self.specs)} station(s) {[list(s.layers) for s in self.specs]}: "
                              "nothing to change")
                return self.specs
            specs = self.prepare(self._fresh_copies(specs))
            try:
                with self._scale_lock:
                    self.progress(f"switching route to {len(specs)} station(s): {[list(s.layers) for s in specs]}")
                    self.engine.switch_route([self._links[s] for s in specs], self.config.cluster.replan_timeout_s,
                                             self.progress)
                    for old in [s for s in self.specs if s not in specs]:
                        self._retire(old)
                    self.specs = specs
                    self._generation += 1
                    for spec in specs:  # the retired stations' cores are free: an unpinned station claims them
                        self._actors[spec].pin.remote()
            except BaseException:
                with self._scale_lock:
                    for spec in [s for s in specs if s not in self.specs]:
                        self._retire(spec)
                raise
        return specs

    def recover(self, links) -> list:
        """Bring the current route back after a failed call: keep stations that answer, wait for Ray to restart
        dead ones (never spending a restart Ray is already spending), restart hung ones, and replace one with no
        restarts left by a fresh actor for the same layers (see mesh.control.station_recovery). Raises
        StationLost when a station is not back within `cluster.restart_timeout_s` or cannot be started."""
        cc = self.config.cluster
        deadline = time.monotonic() + cc.restart_timeout_s
        moved = False
        with self._scale_lock:
            for spec in self.specs:
                link = self._links[spec]
                if link.health():
                    continue  # answering: a lost call, not a lost station
                back = bring_back(spec, self._actors[spec], link, deadline=deadline, call_timeout_s=cc.call_timeout_s,
                                  create=self._replace, connect=self._link, progress=self.progress)
                self._actors[spec], self._links[spec] = back.handle, back.link
                if back.link is not link:
                    moved = True
                    self.progress(f"station [{spec.start}, {spec.end}) is back at {back.link.address}"
                                  + (" (a fresh actor)" if back.replaced else ""))
            links = [self._links[s] for s in self.specs]
        if moved and self.on_restart is not None:
            try:
                self.on_restart()
            except Exception as e:  # noqa: BLE001 - the route is back all the same; say what failed
                self.progress(f"after a station restart: {type(e).__name__}: {e}")
        return links

    def _watch(self) -> None:
        """Every `health_period_s`, ask each station of the route for its health (its forward-path probe);
        one that says NOT_SERVING or does not answer within the call deadline sets off the engine's
        recovery, which restarts it and replays its sequences, even while no request is running."""
        while not self._stopping.wait(self.config.cluster.health_period_s):
            if not self._scale_lock.acquire(blocking=False):
                continue  # growing or recovering: that path checks the stations itself
            try:
                links = [self._links[s] for s in self.specs]
            finally:
                self._scale_lock.release()
            sick = next((link for link in links if not link.health()), None)
            if sick is not None and not self._stopping.is_set() and sick in self._links.values():  # not retired since
                if self.engine.recover_route():  # said once per recovery, not at every look while it runs
                    self.progress(f"station at {sick.address} fails its health check: recovering the route")

    # ---- status ----------------------------------------------------------------------------------
    def status(self) -> dict:
        """Stations (layer ranges, addresses, health, KV, pid, node and cores), and the engine's queues and waves."""
        stations = []
        for i, spec in enumerate(self.specs):
            d = self._links[spec].describe()
            try:
                placed = ray.get(self._actors[spec].placement.remote(), timeout=2)
            except Exception:  # noqa: BLE001 - a station that is down has no pid or node to report
                placed = {"pid": None}
            d.update(placed, index=i, num_gpus=spec.num_gpus, num_cpus=spec.num_cpus, resources=dict(spec.resources))
            stations.append(d)
        return {"model": self.model_dir.name, "num_layers": self.model.num_hidden_layers,
                "route_generation": self._generation, "stations": stations}

    def step_spans(self) -> list[list[tuple[float, float, int, int]]]:
        """Each station's last steps (StationActor.step_spans: wall-clock start, seconds, rows, entries), in chain
        order: what a benchmark takes the pipeline's idle apart from."""
        return ray.get([self._actors[spec].step_spans.remote() for spec in self.specs], timeout=30)

    # ---- internals -------------------------------------------------------------------------------
    def _launch(self, specs: tuple[StationSpec, ...]) -> None:
        started = time.monotonic()
        handles = {}
        for spec in specs:
            self.progress(f"station [{spec.start}, {spec.end}) on {spec.device}/{spec.dtype}, {spec.num_cpus:g} "
                          f"core(s): loading")
            handles[spec] = self._create(spec)
        ready: dict[StationSpec, tuple[object, RemoteLink]] = {}
        try:
            for spec, handle in handles.items():
                address = station_address(handle, timeout_s=600)
                ready[spec] = (handle, self._link(address))
                self.progress(f"station [{spec.start}, {spec.end}): ready at {address} "
                              f"({time.monotonic() - started:.1f}s)")
        except BaseException:  # none of this launch serves: end them all, loaded or not
            for handle, link in ready.values():
                link.close()
            for handle in handles.values():
                stop_station(handle)
            raise
        with self._scale_lock:
            for spec, (handle, link) in ready.items():
                self._actors[spec], self._links[spec] = handle, link

    def _create(self, spec: StationSpec):
        """Start (not wait for) a station actor for `spec`, with the cluster's token, TLS, probe and restarts."""
        cc = self.config.cluster
        return create_station(self.model_dir, spec, host=cc.station_host, max_restarts=cc.max_restarts,
                              token=self.token, tls=self.tls,
                              probe=ProbeConfig(period_s=cc.health_period_s, hang_s=cc.call_timeout_s))

    def _replace(self, spec: StationSpec):
        """Start a fresh actor for `spec` in place of one that is gone for good (a new restart budget); it is
        the spec's actor from now on, so a later recovery waits for it and `stop` ends it."""
        self._actors[spec] = handle = self._create(spec)
        return handle

    def _link(self, address: str):
        return RemoteLink(address, timeout_s=self.config.cluster.call_timeout_s, token=self.token, tls=self.tls)

    def _retire(self, spec: StationSpec) -> None:
        link = self._links.pop(spec, None)
        if link is not None:
            link.close()
        handle = self._actors.pop(spec, None)
        if handle is not None:
            stop_station(handle)
