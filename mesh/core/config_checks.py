"""The checks every configuration dataclass runs on construction (mesh.core.config, mesh.core.serving_config,
mesh.control.mesh_config): a failed one is a ConfigError naming the field."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


def require(cond: bool, msg: str) -> None:
    """Raise ConfigError(msg) unless `cond`."""
    if not cond:
        raise ConfigError(msg)


def is_int(v: object) -> bool:
    """True for an int that is not a bool (YAML, JSON and keyword arguments give `True` where a count belongs)."""
    return isinstance(v, int) and not isinstance(v, bool)
