"""Where stations may run: a plan is checked against the Ray cluster's nodes before any station starts.

Ray keeps an actor whose resources no node has pending for ever, which to a user looks like a hang;
`check_placement` refuses such a station at once, naming it and the resource it asks for.
"""
from __future__ import annotations

from mesh.core.config import ConfigError, StationSpec


def check_placement(specs: tuple[StationSpec, ...], nodes: list[dict]) -> None:
    """Refuse (ConfigError, naming the station and the resource) a station that no alive node of the Ray cluster
    could ever hold: more GPUs or CPUs than the largest node has, a custom resource (`resources`) no node has
    enough of, or needs no single node meets at once. Ray would keep such an actor pending for ever."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", n.get("alive", False))]
    for spec in specs:
        labels = {"GPU": "num_gpus", "CPU": "num_cpus"} | {name: f"resources.{name}" for name, _ in spec.resources}
        need = {"GPU": spec.num_gpus, "CPU": spec.num_cpus, **dict(spec.resources)}
        need = {k: v for k, v in need.items() if v > 0}
        if any(all(float(r.get(k, 0.0)) >= v for k, v in need.items()) for r in alive):
            continue
        station = f"station [{spec.start}, {spec.end})"
        for resource, amount in need.items():
            most = max((float(r.get(resource, 0.0)) for r in alive), default=0.0)
            if amount > most:
                raise ConfigError(f"{station}: {labels[resource]}={amount:g} but no node of this Ray cluster has that "
                                  f"much {resource} (largest: {most:g}){_custom_note(resource, alive)}")
        wanted = ", ".join(f"{labels[k]}={v:g}" for k, v in need.items())
        raise ConfigError(f"{station}: no single node of this Ray cluster has {wanted} at once")


def _custom_note(resource: str, alive: list[dict]) -> str:
    """For a custom resource: the custom resources the cluster's nodes do have."""
    if resource in ("CPU", "GPU"):
        return ""
    have = sorted({k for r in alive for k in r if k not in _RAY_BUILTIN and ":" not in k})
    return f"; custom resources on its nodes: {', '.join(have) or 'none'}"


_RAY_BUILTIN = frozenset({"CPU", "GPU", "memory", "object_store_memory"})  # ":" marks node: / accelerator_type:
