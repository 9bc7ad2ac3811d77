"""The mesh's configuration as frozen dataclasses: ModelSource, RayConfig, ClusterConfig and MeshConfig.

What `mesh up` runs, however it was given (the cluster YAML: mesh.control.cluster_yaml; the embedded default:
`default_mesh_config`). The dataclasses validate themselves as in mesh/core/config.py. Layer coverage needs the
model's layer count, so `MeshConfig.resolve(model)` checks explicit stations against it (or plans `count` stations,
mesh.control.layer_plan). No torch at import; presets import mesh.core.model.synthetic (torch) when their shape is
needed.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mesh.core.config import SUPPORTED_ARCHS, SUPPORTED_DTYPES, ApiConfig, ModelConfig, SchedulerConfig, StationSpec
from mesh.core.config_checks import ConfigError, is_int, require as _require
from mesh.core.model.gguf_convert import SMOLLM2, smollm2_gguf
from mesh.core.model.gguf_file import GGUFCheckpoint, GGUFError, is_gguf
from mesh.core.model.gguf_tokenizer import check_tokenizer
from mesh.core.transport import StationTls, token_travels
from mesh.control.layer_plan import BALANCES, plan_layers, split_weights

DEFAULT_KV_BYTES = 256 * 2**20


def is_num(v: object) -> bool:
    """A finite int or float, not a bool (what a numeric YAML value must be)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _presets() -> tuple[str, ...]:
    from mesh.core.model.synthetic import PRESETS  # imports torch: only when a preset is named

    return (*PRESETS, SMOLLM2)


# model.packed_cache unless the YAML names one (`mesh up` moves it to $WAVEMESH_CACHE/packed where that is set)
DEFAULT_PACKED_CACHE = "~/.cache/wavemesh/packed"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the model comes from: a checkpoint directory or GGUF file, or a built-in preset (exactly one)."""

    path: str | None = None  # a Hugging Face checkpoint directory (config.json + safetensors) or a .gguf file
    preset: str | None = None  # smollm2-135m-instruct (the embedded chat model) | tiny | small | bench (synthetic)
    arch: str = "llama"  # architecture of a preset (a checkpoint's config.json names its own)
    # where each node's stations keep the packed weights they build from a GGUF, so a restarted or re-split station
    # maps them instead of packing again (StationSpec.packed_cache); null keeps nothing
    packed_cache: str | None = DEFAULT_PACKED_CACHE

    def __post_init__(self) -> None:
        _require((self.path is None) != (self.preset is None),
                 "model: give exactly one of path or preset, got " + ("both" if self.path else "neither"))
        _require(self.path is None or (isinstance(self.path, str) and self.path != ""), "model.path: empty")
        _require(self.packed_cache is None or (isinstance(self.packed_cache, str) and self.packed_cache != ""),
                 f"model.packed_cache: expected a directory or null, got {self.packed_cache!r}")
        if self.preset is not None:  # listing the presets imports torch: only for a preset
            presets = _presets()
            _require(self.preset in presets, f"model.preset: unknown {self.preset!r}; choose from {', '.join(presets)}")
        _require(self.arch in SUPPORTED_ARCHS,
                 f"model.arch: unknown {self.arch!r}; choose from {', '.join(SUPPORTED_ARCHS)}")
        _require(self.preset != SMOLLM2 or self.arch == "llama", f"model.arch: {SMOLLM2} is a llama model")

    def model_config(self) -> ModelConfig:
        """The model's shape: the preset's, or read from the checkpoint's config.json or GGUF metadata."""
        if self.preset == SMOLLM2:
            return _gguf_config(smollm2_gguf, f"model.preset {SMOLLM2}")
        if self.preset is not None:
            from mesh.core.model.synthetic import preset_config

            return preset_config(self.preset, self.arch)
        if is_gguf(self.path):
            return _gguf_config(lambda: Path(self.path), "model.path")
        p = Path(self.path)
        _require(p.is_dir(), f"model.path: {self.path} does not exist" if not p.exists()
                 else f"model.path: {self.path} is not a directory")
        _require((p / "config.json").is_file(),
                 f"model.path: {self.path} has no config.json (is this a Hugging Face checkpoint directory?)")
        try:
            return ModelConfig.from_dir(p)
        except ConfigError as e:
            raise ConfigError(f"model.path: {e}") from None


def _gguf_config(locate, key: str) -> ModelConfig:
    """A GGUF file's shape, after checking everything a station and the tokenizer need (nothing loads)."""
    try:
        ckpt = GGUFCheckpoint(locate())
        check_tokenizer(ckpt)
        return ModelConfig.from_hf(ckpt.hf_config())
    except (GGUFError, ConfigError) as e:
        raise ConfigError(f"{key}: {e}") from None


@dataclass(frozen=True, slots=True)
class RayConfig:
    """Which Ray cluster to join."""

    address: str | None = None  # None: start a local Ray; "auto": join the running cluster; or "ray://host:10001"
    namespace: str = "wavemesh"  # Ray namespace of the named station actors

    def __post_init__(self) -> None:
        _require(self.address is None or (isinstance(self.address, str) and self.address != ""),
                 f"ray.address: expected a non-empty string or null, got {self.address!r}")
        _require(isinstance(self.namespace, str) and self.namespace != "", "ray.namespace: must be a non-empty string")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """How the orchestrator and the stations talk to each other."""

    token: str | None = None  # shared secret every station call carries (None: no auth)
    station_host: str = "127.0.0.1"  # interface station gRPC servers bind (0.0.0.0 across nodes)
    call_timeout_s: float = 30.0  # deadline of one station call
    shutdown_timeout_s: float = 30.0  # grace for in-flight work on `mesh down`
    targets_file: str | None = None  # Prometheus file_sd targets written here (None: not written)
    restart_timeout_s: float = 120.0  # how long a lost station may take to come back before its requests end
    max_restarts: int = 3  # Ray restarts of one station actor
    health_period_s: float = 5.0  # how often each station proves its forward path and the orchestrator checks it
    replan_timeout_s: float = 600.0  # a re-plan (scale, add-station) not switched by then is abandoned; the old route serves on
    tls_cert: str | None = None  # PEM certificate (SAN DNS:wavemesh-station) for mutual TLS (all three or none)
    tls_key: str | None = None  # its PEM private key
    tls_ca: str | None = None  # PEM CA bundle both sides' certificates must chain to

    def __post_init__(self) -> None:
        _require(is_num(self.call_timeout_s) and self.call_timeout_s > 0,
                 f"cluster.call_timeout_s: must be a number > 0, got {self.call_timeout_s!r}")
        _require(is_num(self.shutdown_timeout_s) and self.shutdown_timeout_s >= 0,
                 f"cluster.shutdown_timeout_s: must be a number >= 0, got {self.shutdown_timeout_s!r}")
        _require(is_num(self.restart_timeout_s) and self.restart_timeout_s > 0,
                 f"cluster.restart_timeout_s: must be a number > 0, got {self.restart_timeout_s!r}")
        _require(is_num(self.replan_timeout_s) and self.replan_timeout_s > 0,
                 f"cluster.replan_timeout_s: must be a number > 0, got {self.replan_timeout_s!r}")
        _require(is_num(self.health_period_s) and self.health_period_s > 0,
                 f"cluster.health_period_s: must be a number > 0, got {self.health_period_s!r}")
        _require(is_int(self.max_restarts) and self.max_restarts >= 0,
                 f"cluster.max_restarts: must be an integer >= 0, got {self.max_restarts!r}")
        _require(isinstance(self.station_host, str) and self.station_host != "", "cluster.station_host: empty")
        for name in ("token", "targets_file", "tls_cert", "tls_key", "tls_ca"):
            v = getattr(self, name)
            _require(v is None or (isinstance(v, str) and v != ""),
                     f"cluster.{name}: expected a non-empty string or null")
        _require(self.token is None or token_travels(self.token),
                 "cluster.token: must be printable ASCII (it travels as gRPC metadata)")
        tls = {n: getattr(self, n) for n in ("tls_cert", "tls_key", "tls_ca")}
        given, missing = [n for n, v in tls.items() if v is not None], [n for n, v in tls.items() if v is None]
        _require(not (given and missing), f"cluster.{given[0] if given else ''}: needs {' and '.join(missing)} too "
                 "(mutual TLS takes tls_cert, tls_key and tls_ca: all three or none)")
        for name, v in tls.items():
            _require(v is None or Path(v).expanduser().is_file(), f"cluster.{name}: {v} is not a file")

    def tls(self) -> StationTls | None:
        """The mutual-TLS material read from tls_cert / tls_key / tls_ca, or None when not configured."""
        if self.tls_cert is None:
            return None
        return StationTls.from_files(self.tls_cert, self.tls_key, self.tls_ca)


@dataclass(frozen=True, slots=True)
class MeshConfig:
    """One whole cluster: Ray, model, stations (explicit ranges or a count), scheduler, API."""

    ray: RayConfig = field(default_factory=RayConfig)
    model: ModelSource = field(default_factory=lambda: ModelSource(preset="tiny"))
    dtype: str = "float32"  # default dtype of every station
    device: str = "cpu"  # default device of every station
    kv_bytes: int = DEFAULT_KV_BYTES  # default KV budget of every station
    # default CPU cores of every station (StationSpec.num_cpus): a number, or "auto": on a local Ray the CPU stations
    # of a `count` plan share this machine's cores evenly (at least one each; `mesh scale` re-shares them), else 1
    num_cpus: float | str = "auto"
    stations: tuple[StationSpec, ...] | None = None  # explicit layer ranges (in YAML order) ...
    station_count: int | None = None  # ... or this many stations planned from the model
    balance: str = "memory"  # a count's split evens: memory (bytes held) or compute (bytes read per decode step)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        _require(self.dtype in SUPPORTED_DTYPES,
                 f"dtype: expected one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        _require(isinstance(self.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
                 f"device: expected 'cpu' or 'cuda[:N]', got {self.device!r}")
        _require(is_int(self.kv_bytes) and self.kv_bytes > 0, f"kv_bytes: must be > 0, got {self.kv_bytes!r}")
        _require(self.num_cpus == "auto" or (is_num(self.num_cpus) and self.num_cpus > 0),
                 f"num_cpus: expected a number > 0 or auto, got {self.num_cpus!r}")
        _require(self.balance in BALANCES, f"stations.balance: expected one of {', '.join(BALANCES)}, "
                 f"got {self.balance!r}")
        _require((self.stations is None) != (self.station_count is None),
                 "stations: give exactly one of explicit ranges or a count")
        if self.station_count is not None:
            _require(is_int(self.station_count) and self.station_count >= 1,
                     f"stations.count: expected a positive integer, got {self.station_count!r}")
            return
        _require(isinstance(self.stations, tuple) and len(self.stations) > 0
                 and all(isinstance(s, StationSpec) for s in self.stations), "stations: expected at least one station")
        order = sorted(range(len(self.stations)), key=lambda i: self.stations[i].start)
        for a, b in itertools.pairwise(order):
            sa, sb = self.stations[a], self.stations[b]
            _require(sb.start >= sa.end, f"stations: stations[{a}] layers {list(sa.layers)} and stations[{b}] "
                     f"layers {list(sb.layers)} overlap (layers {sb.start}..{min(sa.end, sb.end) - 1})")

    def station_defaults(self, count: int = 1, local_cores: int | None = None) -> dict[str, Any]:
        """The StationSpec fields every station of a plan of `count` inherits unless it says otherwise."""
        return {"device": self.device, "dtype": self.dtype, "kv_bytes": self.kv_bytes,
                "num_gpus": 1.0 if self.device.startswith("cuda") else 0.0,
                "num_cpus": self.station_cpus(count, local_cores), "packed_cache": self.model.packed_cache or ""}

    def station_cpus(self, count: int, local_cores: int | None) -> float:
        """num_cpus of each station of a `count` plan: the number given, or for "auto" this machine's
        `local_cores` shared evenly (at least 1) where the stations run on it (a local Ray) on the CPU, else 1."""
        if self.num_cpus != "auto":
            return float(self.num_cpus)
        if local_cores is None or self.ray.address is not None or self.device != "cpu":
            return 1.0
        return float(max(1, local_cores // count))

    def auto_cpus(self) -> bool:
        """True when a re-plan re-shares this machine's cores among its stations (`num_cpus: auto`, a count)."""
        return self.num_cpus == "auto" and self.station_count is not None

    def resolve(self, model: ModelConfig | int, local_cores: int | None = None) -> tuple[StationSpec, ...]:
        """The stations for a model of `model` layers (or this ModelConfig), sorted by start.

        Explicit ranges must chain exactly 0..L; a count is planned by plan_layers, balancing
        split_weights(model, dtype, balance) when given a ModelConfig (evenly by layers when given an int), each
        station with station_cpus(count, local_cores) cores (`local_cores`: this machine's, where a local Ray runs
        the stations).
        """
        num_layers = model.num_hidden_layers if isinstance(model, ModelConfig) else model
        _require(is_int(num_layers) and num_layers >= 1,
                 f"num_layers: expected a positive integer, got {num_layers!r}")
        if self.station_count is not None:
            weights = split_weights(model, self.dtype, self.balance) if isinstance(model, ModelConfig) else None
            ranges = plan_layers(num_layers, self.station_count, weights)
            defaults = self.station_defaults(self.station_count, local_cores)
            return tuple(StationSpec(layers=r, **defaults) for r in ranges)
        order = sorted(range(len(self.stations)), key=lambda i: self.stations[i].start)
        covered = 0
        for i in order:
            s = self.stations[i]
            _require(s.end <= num_layers, f"stations[{i}].layers: end {s.end} exceeds the model's {num_layers} layers")
            _require(s.start == covered, f"stations: layers {covered}..{s.start - 1} are not covered by any station"
                     + (" (the first station must start at layer 0)" if covered == 0 else ""))
            covered = s.end
        _require(covered == num_layers, f"stations: layers {covered}..{num_layers - 1} are not covered by any station "
                 f"(the model has {num_layers} layers; the last station must end at {num_layers})")
        return tuple(self.stations[i] for i in order)

    def with_stations(self, specs) -> MeshConfig:
        """A new MeshConfig with these explicit stations in place of the current ones (or count)."""
        return replace(self, stations=tuple(specs), station_count=None)

    def with_packed_cache(self, directory: str | None) -> MeshConfig:
        """A new MeshConfig whose model.packed_cache, and every explicit station's, is `directory` (None: off)."""
        stations = None if self.stations is None else tuple(
            replace(s, packed_cache=directory or "") for s in self.stations)
        return replace(self, model=replace(self.model, packed_cache=directory), stations=stations)


def default_mesh_config() -> MeshConfig:
    """The embedded default: local Ray, SmolLM2-135M-Instruct, one full-model CPU station, API on 127.0.0.1:8000."""
    return MeshConfig(model=ModelSource(preset=SMOLLM2, arch="llama"), station_count=1)
