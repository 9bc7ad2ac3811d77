"""Joining Ray: an existing cluster at `ray.address`, or a new local one that listens on loopback only."""
from __future__ import annotations

import contextlib
import os

import ray

from mesh.control.mesh_config import RayConfig

_RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's own switch; 0 makes a node's address loopback


def connect_ray(config: RayConfig, num_cpus: int) -> bool:
    """Join the Ray cluster at `config.address`, or, when it is None, start a new local Ray of `num_cpus` logical
    CPUs, listening on loopback only: never one found through RAY_ADDRESS or a `ray_current_cluster` file that
    another session left behind. False when Ray was already up in this process (the caller does not own it)."""
    if ray.is_initialized():
        return False
    kw = {"namespace": config.namespace, "include_dashboard": False, "logging_level": "WARNING",
          "log_to_driver": False}
    if config.address is None:
        with loopback_node():
            ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kw)
    else:
        ray.init(address=config.address, **kw)
    return True


@contextlib.contextmanager
def loopback_node():
    """While a new local Ray starts: make its node address loopback, so its GCS, raylet, workers and agents
    listen on 127.0.0.1 only. Ray (2.x) turns `_node_ip_address="127.0.0.1"` into the host's routable address
    unless its cluster mode is off (its default on macOS and Windows); that switch is read by this process
    (a module constant) and by the processes Ray spawns (an environment variable), so both are set for the
    start and restored after it (the node's address is fixed from then on)."""
    from ray._private import ray_constants

    saved_constant, saved_env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(_RAY_CLUSTER_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[_RAY_CLUSTER_ENV] = "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_constant
        if saved_env is None:
            os.environ.pop(_RAY_CLUSTER_ENV, None)
        else:
            os.environ[_RAY_CLUSTER_ENV] = saved_env
