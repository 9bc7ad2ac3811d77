"""The cluster YAML that `mesh up CONFIG.yaml` reads, as one frozen MeshConfig (mesh.control.mesh_config).

`load_mesh_config` refuses every mistake with a ConfigError whose message starts
`"{file}: {key.path}: "`: an unknown key, a value of the wrong kind, a size that does not parse, a file that is
not YAML; the dataclasses then check the values. No torch at import.
"""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import yaml

from mesh.core.config import ApiConfig, SchedulerConfig, StationSpec
from mesh.core.config_checks import ConfigError, is_int, require as _require
from mesh.core.model.gguf_convert import SMOLLM2
from mesh.control.layer_plan import BALANCES
from mesh.control.mesh_config import ClusterConfig, MeshConfig, ModelSource, RayConfig, is_num

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

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
    "pos_num": (lambda v: is_num(v) and v > 0, "a number > 0"),
    "nonneg_num": (lambda v: is_num(v) and v >= 0, "a number >= 0"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "opt_str": (lambda v: v is None or (isinstance(v, str) and v != ""), "a non-empty string or null"),
    "opt_nonneg_int": (lambda v: v is None or (is_int(v) and v >= 0), "an integer >= 0 or null"),
}
_SCHEMA = {  # section: {key: kind}
    "ray": {"address": "opt_str", "namespace": "str"},
    "model": {"path": "str", "preset": "str", "arch": "str", "packed_cache": "opt_str"},
    "scheduler": {"max_seqs": "pos_int", "max_wave_tokens": "pos_int", "max_queue": "pos_int",
                  "short_first": "bool", "short_prompt_tokens": "pos_int", "max_skips": "pos_int",
                  "extra_waves": "nonneg_int", "decode_steps": "nonneg_int", "reply_steps": "nonneg_int",
                  "prefix_cache": "bool", "hidden_path": "str",
                  "route_switch": "str", "catchup_kv": "str", "catchup_copy_tokens": "pos_int", "catchup_wave_tokens": "pos_int", "catchup_slowdown": "nonneg_num"},
    "api": {"host": "str", "port": "int", "api_key": "opt_str", "model_name": "opt_str", "max_n": "pos_int",
            "health_cache_s": "nonneg_num"},
    "cluster": {"token": "opt_str", "station_host": "str", "call_timeout_s": "pos_num",
                "shutdown_timeout_s": "nonneg_num", "targets_file": "opt_str",
                "restart_timeout_s": "pos_num", "max_restarts": "nonneg_int", "health_period_s": "pos_num",
                "replan_timeout_s": "pos_num",
                "tls_cert": "opt_str", "tls_key": "opt_str", "tls_ca": "opt_str"},
    "station": {"layers": "layers", "device": "str", "dtype": "str", "kv_bytes": "size",
                "num_gpus": "nonneg_num", "num_cpus": "nonneg_num", "linear_backend": "str", "resources": "resources",
                "cuda_graphs": "bool", "huge_pages": "bool", "relay_part_rows": "opt_nonneg_int"},
}
_TOP = ("ray", "model", "dtype", "device", "kv_bytes", "num_cpus", "stations", "scheduler", "api", "cluster")


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
        if "num_cpus" in raw:  # a number, or auto (MeshConfig checks which)
            kw["num_cpus"] = raw["num_cpus"]
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
