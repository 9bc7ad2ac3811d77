"""The cluster YAML that `mesh up CONFIG.yaml` reads, as one frozen MeshConfig.

`load_mesh_config` refuses every mistake with a ConfigError whose message starts
`"{file}: {key.path}: "`; the dataclasses validate themselves as in mesh/core/config.py.
Layer coverage needs the model's layer count, so `MeshConfig.resolve(model)` checks
explicit stations against it (or plans `count` stations, mesh.control.layer_plan). No torch at
import; presets import mesh.core.model.synthetic (torch) when their shape is needed.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from mesh.core.config import (SUPPORTED_ARCHS, SUPPORTED_DTYPES, ApiConfig, ConfigError, ModelConfig,
                         SchedulerConfig, StationSpec, _require, is_int)
from mesh.core.model.gguf_convert import SMOLLM2, smollm2_gguf
from mesh.core.model.gguf_file import GGUFCheckpoint, GGUFError, is_gguf
from mesh.core.model.gguf_tokenizer import check_tokenizer
from mesh.core.transport import StationTls, token_travels
from mesh.control.layer_plan import BALANCES, plan_layers, split_weights

DEFAULT_KV_BYTES = 256 * 2**20
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


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
        _require(_is_num(self.call_timeout_s) and self.call_timeout_s > 0,
                 f"cluster.call_timeout_s: must be a number > 0, got {self.call_timeout_s!r}")
        _require(_is_num(self.shutdown_timeout_s) and self.shutdown_timeout_s >= 0,
                 f"cluster.shutdown_timeout_s: must be a number >= 0, got {self.shutdown_timeout_s!r}")
        _require(_is_num(self.restart_timeout_s) and self.restart_timeout_s > 0,
                 f"cluster.restart_timeout_s: must be a number > 0, got {self.restart_timeout_s!r}")
        _require(_is_num(self.replan_timeout_s) and self.replan_timeout_s > 0,
                 f"cluster.replan_timeout_s: must be a number > 0, got {self.replan_timeout_s!r}")
        _require(_is_num(self.health_period_s) and self.health_period_s > 0,
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

    def station_defaults(self) -> dict[str, Any]:
        """The StationSpec fields every station inherits unless it says otherwise."""
        return {"device": self.device, "dtype": self.dtype, "kv_bytes": self.kv_bytes,
                "num_gpus": 1.0 if self.device.startswith("cuda") else 0.0, "num_cpus": 1.0,
                "packed_cache": self.model.packed_cache or ""}

    def resolve(self, model: ModelConfig | int) -> tuple[StationSpec, ...]:
        """The stations for a model of `model` layers (or this ModelConfig), sorted by start.

        Explicit ranges must chain exactly 0..L; a count is planned by plan_layers, balancing
        split_weights(model, dtype, balance) when given a ModelConfig (evenly by layers when given an int).
        """
        num_layers = model.num_hidden_layers if isinstance(model, ModelConfig) else model
        _require(is_int(num_layers) and num_layers >= 1,
                 f"num_layers: expected a positive integer, got {num_layers!r}")
        if self.station_count is not None:
            weights = split_weights(model, self.dtype, self.balance) if isinstance(model, ModelConfig) else None
            ranges = plan_layers(num_layers, self.station_count, weights)
            return tuple(StationSpec(layers=r, **self.station_defaults()) for r in ranges)
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


# ---- YAML -> MeshConfig -------------------------------------------------------------------------

def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def parse_size(v: object) -> int:
    """Bytes from an integer or a size string: "268435456", "256MiB", "2GiB", "1.5GB", "512Ki"."""
    if is_int(v):
        _require(v > 0, f"expected a positive byte count, got {v!r}")
        return v
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", v) if isinstance(v, str) else None
    unit = m.group(2).upper() if m else None
    _require(m is not None and unit in _UNITS, f"expected bytes as an integer or a size like '256MiB' or '2GiB' "
             f"(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {v!r}")
    n = float(m.group(1)) * _UNITS[unit]
    _require(n >= 1 and n == int(n), f"expected a positive whole number of bytes, got {v!r}")
    return int(n)


_KINDS = {  # kind: (check, what it expects)
    "pos_int": (lambda v: is_int(v) and v > 0, "a positive integer"),
    "int": (is_int, "an integer"),
    "nonneg_int": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "pos_num": (lambda v: _is_num(v) and v > 0, "a number > 0"),
    "nonneg_num": (lambda v: _is_num(v) and v >= 0, "a number >= 0"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "opt_str": (lambda v: v is None or (isinstance(v, str) and v != ""), "a non-empty string or null"),
}
_SCHEMA = {  # section: {key: kind}
    "ray": {"address": "opt_str", "namespace": "str"},
    "model": {"path": "str", "preset": "str", "arch": "str", "packed_cache": "opt_str"},
    "scheduler": {"max_seqs": "pos_int", "max_wave_tokens": "pos_int", "max_queue": "pos_int",
                  "short_first": "bool", "short_prompt_tokens": "pos_int", "max_skips": "pos_int",
                  "extra_waves": "nonneg_int", "decode_steps": "pos_int", "prefix_cache": "bool", "hidden_path": "str",
                  "route_switch": "str", "catchup_kv": "str", "catchup_copy_tokens": "pos_int", "catchup_wave_tokens": "pos_int", "catchup_slowdown": "nonneg_num"},
    "api": {"host": "str", "port": "int", "api_key": "opt_str", "model_name": "opt_str", "max_n": "pos_int",
            "health_cache_s": "nonneg_num"},
    "cluster": {"token": "opt_str", "station_host": "str", "call_timeout_s": "pos_num",
                "shutdown_timeout_s": "nonneg_num", "targets_file": "opt_str",
                "restart_timeout_s": "pos_num", "max_restarts": "nonneg_int", "health_period_s": "pos_num",
                "replan_timeout_s": "pos_num",
                "tls_cert": "opt_str", "tls_key": "opt_str", "tls_ca": "opt_str"},
    "station": {"layers": "layers", "device": "str", "dtype": "str", "kv_bytes": "size",
                "num_gpus": "nonneg_num", "num_cpus": "nonneg_num", "linear_backend": "str", "resources": "resources"},
}
_TOP = ("ray", "model", "dtype", "device", "kv_bytes", "stations", "scheduler", "api", "cluster")


def _type(v: object) -> str:
    return {type(None): "null", dict: "a mapping", list: "a list"}.get(type(v), repr(v))


def _key(path: str, k: object) -> str:
    return f"{path}.{k}" if path else str(k)


def _mapping(d: object, path: str, allowed) -> dict:
    _require(isinstance(d, dict), f"{path}: expected a mapping, got {_type(d)}")
    for k in d:
        _require(k in allowed, f"{_key(path, k)}: unknown key; allowed: {', '.join(allowed)}")
    return d


def _fields(d: dict, path: str, schema: dict) -> dict:
    out = {}
    for k, v in d.items():
        kind, key = schema[k], _key(path, k)
        if kind == "size":
            try:
                out[k] = parse_size(v)
            except ConfigError as e:
                raise ConfigError(f"{key}: {e}") from None
        elif kind == "layers":
            _require(isinstance(v, list) and len(v) == 2 and all(is_int(x) for x in v),
                     f"{key}: expected [start, end] integers, got {v!r}")
            out[k] = tuple(v)
        elif kind == "resources":
            out[k] = _resources(v, key)
        else:
            ok, what = _KINDS[kind]
            _require(ok(v), f"{key}: expected {what}, got {_type(v)}")
            out[k] = float(v) if kind.endswith("_num") else v
    return out


def _resources(v: object, key: str) -> tuple[tuple[str, float], ...]:
    """A station's Ray custom resources {NAME: amount} as sorted (name, amount) pairs; names are strings,
    amounts numbers > 0."""
    _require(isinstance(v, dict), f"{key}: expected a mapping of resource name to amount, got {_type(v)}")
    for name, amount in v.items():
        _require(isinstance(name, str) and name != "", f"{key}: a resource name must be a non-empty string, "
                 f"got {name!r}")
        _require(_KINDS["pos_num"][0](amount), f"{key}.{name}: expected a number > 0, got {_type(amount)}")
    return tuple(sorted((name, float(amount)) for name, amount in v.items()))


def _build(cls, kw: dict, path: str):
    """cls(**kw), its error moved under `path` ("scheduler.max_seqs must ..." -> "scheduler.max_seqs: ...")."""
    try:
        return cls(**kw)
    except ConfigError as e:
        msg = str(e)
        msg = msg[len(path) + 1:] if path and msg.startswith(path + ".") else msg
        name = re.match(r"\w+", msg)
        if name and name.group(0) in kw:
            rest = msg[len(name.group(0)):]
            msg = f"{_key(path, name.group(0))}: " + (rest[1:].lstrip() if rest.startswith(":") else msg)
        elif path and not msg.startswith(path):
            msg = f"{path}: {msg}"
        raise ConfigError(msg) from None


def _section(raw: dict, name: str, cls):
    d = raw.get(name)
    return cls() if d is None else _build(cls, _fields(_mapping(d, name, _SCHEMA[name]), name, _SCHEMA[name]), name)


def _model(raw: dict, base: Path | None) -> ModelSource:
    d = raw.get("model")
    _require(d is not None, f"model: missing; give {{path: DIR or FILE.gguf}} or {{preset: {SMOLLM2}|tiny|small|bench}}")
    kw = _fields(_mapping(d, "model", _SCHEMA["model"]), "model", _SCHEMA["model"])
    _require(not ("arch" in kw and "path" in kw),
             "model.arch: only with preset (a checkpoint's config.json names its own)")
    if "path" in kw:
        p = Path(kw["path"]).expanduser()
        kw["path"] = str(p if p.is_absolute() or base is None else base / p)
    return _build(ModelSource, kw, "model")


def _stations(raw: dict, top: MeshConfig) -> dict:
    d = {"count": 1} if raw.get("stations") is None else raw["stations"]
    if isinstance(d, dict):
        d = _mapping(d, "stations", ("count", "balance"))
        count, balance = d.get("count"), d.get("balance", "memory")
        _require(is_int(count) and count >= 1, f"stations.count: expected a positive integer, got {_type(count)}")
        _require(balance in BALANCES, f"stations.balance: expected one of {', '.join(BALANCES)}, got {_type(balance)}")
        return {"stations": None, "station_count": count, "balance": balance}
    _require(isinstance(d, list) and len(d) > 0,
             f"stations: expected a list of {{layers: [start, end], ...}} or {{count: N}}, got {_type(d)}")
    specs = []
    for i, s in enumerate(d):
        key = f"stations[{i}]"
        kw = _fields(_mapping(s, key, _SCHEMA["station"]), key, _SCHEMA["station"])
        _require("layers" in kw, f"{key}.layers: missing; expected [start, end]")
        defaults = top.station_defaults()
        if "device" in kw:  # a station's own device decides its default GPU request
            defaults["num_gpus"] = 1.0 if kw["device"].startswith("cuda") else 0.0
        specs.append(_build(StationSpec, defaults | kw, key))
    return {"stations": tuple(specs), "station_count": None}


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)):
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def mesh_config_from_dict(d: object, source: str = "<dict>", base_dir: str | Path | None = None,
                          check_paths: bool = True) -> MeshConfig:
    """Validate a parsed cluster YAML; every ConfigError starts "{source}: {key.path}: ".

    Relative model paths are taken from `base_dir` (the YAML's folder; the working directory when
    None). The stations must cover a preset's layers exactly; a checkpoint's too unless check_paths
    is False (then its directory is not read: schema only).
    """
    try:
        _require(isinstance(d, dict), f"top level: expected a mapping of {', '.join(_TOP)}, got "
                 + ("an empty document" if d is None else _type(d)))
        raw = _mapping(d, "", _TOP)
        kw = _fields({k: raw[k] for k in ("dtype", "device", "kv_bytes") if k in raw}, "",
                     {"dtype": "str", "device": "str", "kv_bytes": "size"})
        model = _model(raw, Path(base_dir) if base_dir else None)
        top = _build(MeshConfig, kw | {"model": model, "station_count": 1}, "")
        cfg = replace(top, ray=_section(raw, "ray", RayConfig), scheduler=_section(raw, "scheduler", SchedulerConfig),
                      api=_section(raw, "api", ApiConfig), cluster=_section(raw, "cluster", ClusterConfig),
                      **_stations(raw, top))
        if check_paths or cfg.model.preset is not None:  # a preset's layers are known without any file
            cfg.resolve(cfg.model.model_config())
        return cfg
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_mesh_config(path: str | Path, check_paths: bool = True) -> MeshConfig:
    """Read and validate a cluster YAML file (see deploy/README.md for the schema)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        d = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "top level"
        what = "; ".join(x for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
        raise ConfigError(f"{p}: {where}: invalid YAML: {what}") from None
    return mesh_config_from_dict(d, str(p), p.parent, check_paths)
