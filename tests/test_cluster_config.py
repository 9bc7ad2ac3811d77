"""The cluster YAML schema: every mistake names the file, the key path and the problem."""
from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mesh.control.cluster_yaml import load_mesh_config, mesh_config_from_dict, parse_size
from mesh.control.mesh_config import ClusterConfig, MeshConfig, ModelSource, RayConfig, default_mesh_config
from mesh.control.layer_plan import layer_weights, plan_layers, split_weights, station_bytes, step_weights
from mesh.core.config import ApiConfig, ConfigError, ModelConfig, SchedulerConfig, StationSpec
from mesh.core.model.synthetic import preset_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
GOOD = "model: {preset: tiny}\n"  # 6 layers


def _write(tmp_path: Path, text: str, name: str = "mesh.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _refused(tmp_path: Path, text: str, *parts: str, check_paths: bool = True) -> str:
    """Load `text` as a YAML file; it must raise a ConfigError starting with the file name and containing parts."""
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_mesh_config(p, check_paths=check_paths)
    msg = str(info.value)
    assert msg.startswith(f"{p}: "), msg
    for part in parts:
        assert part in msg, (part, msg)
    return msg


# ---- mistakes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, parts", [
    (GOOD + "colour: red\n", ["colour: unknown key", "allowed: ray, model"]),
    (GOOD + "api: {prot: 80}\n", ["api.prot: unknown key", "host, port"]),
    (GOOD + "scheduler: {max_seq: 4}\n", ["scheduler.max_seq: unknown key", "max_seqs"]),
    (GOOD + "cluster: {tokn: x}\n", ["cluster.tokn: unknown key", "token"]),
    (GOOD + "ray: {adress: auto}\n", ["ray.adress: unknown key", "address, namespace"]),
    ("model: {preset: tiny, size: 3}\n", ["model.size: unknown key", "path, preset, arch"]),
    (GOOD + "stations: [{layers: [0, 6], gpus: 1}]\n", ["stations[0].gpus: unknown key", "num_gpus"]),
    (GOOD + "stations: {count: 2, split: even}\n", ["stations.split: unknown key", "count"]),
])
def test_unknown_keys_are_refused_at_every_level(tmp_path, text, parts):
    _refused(tmp_path, text, *parts)


@pytest.mark.parametrize("text, parts", [
    (GOOD + "stations: [{layers: [0, 3]}, {layers: x}]\n",
     ["stations[1].layers: expected [start, end] integers, got 'x'"]),
    (GOOD + "stations: [{layers: [0, 2, 6]}]\n", ["stations[0].layers: expected [start, end] integers"]),
    (GOOD + "stations: [{layers: [4, 2]}]\n", ["stations[0].layers: need 0 <= start < end"]),
    (GOOD + "stations: [{device: cpu}]\n", ["stations[0].layers: missing"]),
    (GOOD + "stations: [{layers: [0, 6], device: tpu}]\n", ["stations[0].device: expected 'cpu' or 'cuda[:N]'"]),
    (GOOD + "stations: [{layers: [0, 6], dtype: int8}]\n", ["stations[0].dtype: expected one of"]),
    (GOOD + "stations: [{layers: [0, 6], cuda_graphs: maybe}]\n", ["stations[0].cuda_graphs: expected true or false"]),
    (GOOD + "stations: [{layers: [0, 6], huge_pages: 1}]\n", ["stations[0].huge_pages: expected true or false"]),
    (GOOD + "stations: [{layers: [0, 6], num_gpus: -1}]\n", ["stations[0].num_gpus: expected a number >= 0"]),
    (GOOD + "stations: [{layers: [0, 6], kv_bytes: lots}]\n", ["stations[0].kv_bytes: expected bytes", "'lots'"]),
    (GOOD + "stations: [{layers: [0, 6], resources: [gpu_a]}]\n",
     ["stations[0].resources: expected a mapping of resource name to amount, got a list"]),
    (GOOD + "stations: [{layers: [0, 6], resources: {zone_a: 0}}]\n", ["stations[0].resources.zone_a: expected a number > 0, got 0"]),
    (GOOD + "stations: [{layers: [0, 6], resources: {zone_a: many}}]\n",
     ["stations[0].resources.zone_a: expected a number > 0, got 'many'"]),
    (GOOD + "stations: [{layers: [0, 3]}, {layers: [3, 6], resources: {7: 1}}]\n",
     ["stations[1].resources: a resource name must be a non-empty string, got 7"]),
    (GOOD + "stations: [{layers: [0, 6], resources: {CPU: 2}}]\n",
     ["stations[0].resources: CPU is asked for with num_cpus / num_gpus"]),
    (GOOD + "stations: []\n", ["stations: expected a list"]),
    (GOOD + "stations: 3\n", ["stations: expected a list", "{count: N}"]),
    (GOOD + "stations: [3]\n", ["stations[0]: expected a mapping, got 3"]),
    (GOOD + "stations: {count: 0}\n", ["stations.count: expected a positive integer, got 0"]),
    (GOOD + "stations: {count: 7}\n", ["stations.count: 7 stations for a model of 6 layers"]),
    (GOOD + "kv_bytes: 12XB\n", ["kv_bytes: expected bytes", "'12XB'"]),
    (GOOD + "kv_bytes: -5\n", ["kv_bytes: expected a positive byte count, got -5"]),
    (GOOD + "dtype: float64\n", ["dtype: expected one of float32, bfloat16, float16, got 'float64'"]),
    (GOOD + "device: gpu\n", ["device: expected 'cpu' or 'cuda[:N]', got 'gpu'"]),
    (GOOD + "device: 3\n", ["device: expected a non-empty string, got 3"]),
    (GOOD + "scheduler: {max_seqs: 0}\n", ["scheduler.max_seqs: expected a positive integer, got 0"]),
    (GOOD + "scheduler: {max_seqs: 64, max_wave_tokens: 16}\n", ["scheduler.max_wave_tokens: ", "must be >= max_seqs"]),
    (GOOD + "scheduler: {short_first: maybe}\n", ["scheduler.short_first: expected true or false, got 'maybe'"]),
    (GOOD + "scheduler: [1, 2]\n", ["scheduler: expected a mapping, got a list"]),
    (GOOD + "api: {port: 70000}\n", ["api.port: ", "out of range: 70000"]),
    (GOOD + "api: {port: '80'}\n", ["api.port: expected an integer, got '80'"]),
    (GOOD + "api: {max_n: 0}\n", ["api.max_n: expected a positive integer, got 0"]),
    (GOOD + "cluster: {call_timeout_s: 0}\n", ["cluster.call_timeout_s: expected a number > 0, got 0"]),
    (GOOD + "cluster: {shutdown_timeout_s: -1}\n", ["cluster.shutdown_timeout_s: expected a number >= 0"]),
    (GOOD + "cluster: {health_period_s: 0}\n", ["cluster.health_period_s: expected a number > 0, got 0"]),
    (GOOD + "scheduler: {extra_waves: -1}\n", ["scheduler.extra_waves: expected an integer >= 0"]),
    (GOOD + "cluster: {token: ''}\n", ["cluster.token: expected a non-empty string or null"]),
    (GOOD + "ray: {address: 6379}\n", ["ray.address: expected a non-empty string or null, got 6379"]),
    ("dtype: float32\n", ["model: missing"]),
    ("model: {preset: huge}\n", ["model.preset: unknown 'huge'", "tiny, small, bench"]),
    ("model: {preset: tiny, arch: gpt2}\n", ["model.arch: unknown 'gpt2'"]),
    ("model: {path: /x, preset: tiny}\n", ["model: give exactly one of path or preset, got both"]),
    ("model: {}\n", ["model: give exactly one of path or preset, got neither"]),
    ("model: {path: /x, arch: llama}\n", ["model.arch: only with preset"]),
    ("model: /models/x\n", ["model: expected a mapping, got '/models/x'"]),
])
def test_bad_values_name_the_key_and_the_problem(tmp_path, text, parts):
    _refused(tmp_path, text, *parts)


@pytest.mark.parametrize("ranges, parts", [
    ("[[0, 4], [3, 6]]", ["stations: stations[0] layers [0, 4] and stations[1] layers [3, 6] overlap (layers 3..3)"]),
    ("[[2, 6], [0, 3]]", ["stations[1] layers [0, 3] and stations[0] layers [2, 6] overlap"]),
    ("[[0, 2], [4, 6]]", ["stations: layers 2..3 are not covered by any station"]),
    ("[[2, 6]]", ["stations: layers 0..1 are not covered by any station", "must start at layer 0"]),
    ("[[0, 2], [2, 5]]", ["stations: layers 5..5 are not covered", "the last station must end at 6"]),
    ("[[0, 3], [3, 9]]", ["stations[1].layers: end 9 exceeds the model's 6 layers"]),
])
def test_layer_ranges_must_chain_exactly_over_the_model(tmp_path, ranges, parts):
    stations = ", ".join(f"{{layers: {r}}}" for r in json.loads(ranges))
    _refused(tmp_path, GOOD + f"stations: [{stations}]\n", *parts)


def test_preset_coverage_is_checked_even_without_path_checks(tmp_path):
    _refused(tmp_path, GOOD + "stations: [{layers: [0, 5]}]\n", "layers 5..5 are not covered", check_paths=False)


def test_non_scalar_yaml_keys_are_refused_not_crashed(tmp_path):
    _refused(tmp_path, GOOD + "? [a, b]\n: 1\n", "line 2", "invalid YAML", "unhashable key")


def test_gap_message_matches_the_documented_form(tmp_path):
    text = "model: {preset: bench}\nstations: [{layers: [0, 5]}, {layers: [8, 12]}]\n"
    _refused(tmp_path, text, "stations: layers 5..7 are not covered by any station")


def test_model_path_must_exist_and_hold_a_config_json(tmp_path):
    _refused(tmp_path, "model: {path: /no/such/model}\n", "model.path: /no/such/model does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(tmp_path, f"model: {{path: {empty}}}\n", f"model.path: {empty} has no config.json")
    (empty / "config.json").write_text("{not json")
    _refused(tmp_path, f"model: {{path: {empty}}}\n", "model.path: ", "not valid JSON")
    # without path checks the same file parses
    assert load_mesh_config(_write(tmp_path, "model: {path: /no/such/model}\n"), check_paths=False).model.path == \
        "/no/such/model"


@pytest.mark.parametrize("text, parts", [
    ("model: {preset: tiny\nstations: [\n", ["line ", "invalid YAML"]),
    ("model:\n  preset: tiny\n   arch: llama\n", ["line 3", "invalid YAML"]),
    ("model: {preset: tiny}\nmodel: {preset: small}\n", ["line 2", "invalid YAML", "duplicate key 'model'"]),
    ("- model\n- dtype\n", ["top level: expected a mapping", "got a list"]),
    ("just words\n", ["top level: expected a mapping", "got 'just words'"]),
    ("", ["top level: expected a mapping", "an empty document"]),
])
def test_broken_files_are_refused_with_a_location(tmp_path, text, parts):
    _refused(tmp_path, text, *parts)


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read"):
        load_mesh_config(tmp_path / "nope.yaml")


def test_dict_errors_carry_the_source_name():
    with pytest.raises(ConfigError, match=r"^<dict>: api\.host: expected a non-empty string, got 5$"):
        mesh_config_from_dict({"model": {"preset": "tiny"}, "api": {"host": 5}})
    with pytest.raises(ConfigError, match=r"^cli: top level: expected a mapping"):
        mesh_config_from_dict([1], source="cli")


# ---- valid files -----------------------------------------------------------------------------------

def test_explicit_ranges_with_defaults_and_overrides(tmp_path):
    text = """
ray: {address: auto, namespace: prod}
model: {preset: bench, arch: qwen2}
dtype: float16
device: cpu
kv_bytes: 64MiB
stations:
  - {layers: [5, 12], device: cuda, dtype: bfloat16, kv_bytes: 1GiB, num_cpus: 2, cuda_graphs: false}
  - {layers: [0, 5], num_gpus: 0, resources: {zone_b: 1, big_mem: 0.5}, huge_pages: false}
scheduler: {max_seqs: 16, max_wave_tokens: 256, max_queue: 8, short_first: true, short_prompt_tokens: 32, max_skips: 2,
            extra_waves: 1}
api: {host: 0.0.0.0, port: 9000, api_key: sk-test, model_name: bench, max_n: 4}
cluster: {token: s3cret, station_host: 0.0.0.0, call_timeout_s: 5, shutdown_timeout_s: 0, targets_file: /tmp/t.json,
          health_period_s: 2.5}
"""
    cfg = load_mesh_config(_write(tmp_path, text))
    assert cfg == MeshConfig(
        ray=RayConfig("auto", "prod"), model=ModelSource(preset="bench", arch="qwen2"), dtype="float16", device="cpu",
        kv_bytes=64 * 2**20, stations=(
            StationSpec((5, 12), device="cuda", dtype="bfloat16", kv_bytes=2**30, num_gpus=1.0, num_cpus=2.0,
                        packed_cache="~/.cache/wavemesh/packed", cuda_graphs=False),
            StationSpec((0, 5), device="cpu", dtype="float16", kv_bytes=64 * 2**20, num_gpus=0.0, num_cpus=1.0,
                        resources=(("big_mem", 0.5), ("zone_b", 1.0)), packed_cache="~/.cache/wavemesh/packed",
                        huge_pages=False)),
        scheduler=SchedulerConfig(16, 256, 8, True, 32, 2, extra_waves=1),
        api=ApiConfig("0.0.0.0", 9000, "sk-test", "bench", 4),
        cluster=ClusterConfig("s3cret", "0.0.0.0", 5.0, 0.0, "/tmp/t.json", health_period_s=2.5))
    assert [s.layers for s in cfg.resolve(12)] == [(0, 5), (5, 12)]  # sorted by start


def test_count_split_and_sections_left_out(tmp_path):
    cfg = load_mesh_config(_write(tmp_path, "model: {preset: small}\ndevice: cuda\nstations: {count: 3}\napi:\n"))
    assert cfg.stations is None and cfg.station_count == 3 and cfg.api == ApiConfig()
    assert (cfg.ray, cfg.scheduler, cfg.cluster) == (RayConfig(), SchedulerConfig(), ClusterConfig())
    specs = cfg.resolve(preset_config("small"))
    assert [s.layers for s in specs] == plan_layers(8, 3, layer_weights(preset_config("small")))
    assert all(s.device == "cuda" and s.num_gpus == 1.0 and s.kv_bytes == 256 * 2**20 for s in specs)
    assert [s.layers for s in cfg.resolve(9)] == [(0, 3), (3, 6), (6, 9)]  # a bare layer count splits evenly


def test_num_cpus_auto_shares_this_machines_cores_among_a_count(tmp_path):
    """`num_cpus: auto` (the default): on a local Ray the CPU stations of a count split the machine's cores evenly,
    at least one each; on a Ray cluster, on a GPU, or for explicit stations, 1; a number is every station's."""
    cfg = load_mesh_config(_write(tmp_path, GOOD + "stations: {count: 2}\n"))
    assert cfg.num_cpus == "auto" and cfg.auto_cpus()
    assert [s.num_cpus for s in cfg.resolve(6, local_cores=8)] == [4.0, 4.0]
    assert [s.num_cpus for s in cfg.resolve(6, local_cores=3)] == [1.0, 1.0]
    assert [s.num_cpus for s in cfg.resolve(6)] == [1.0, 1.0]  # no local machine to share (local_cores None)
    assert cfg.station_cpus(3, local_cores=2) == 1.0 and cfg.station_cpus(1, local_cores=2) == 2.0
    far = load_mesh_config(_write(tmp_path, GOOD + "ray: {address: 'ray://head:10001'}\nstations: {count: 2}\n"))
    assert [s.num_cpus for s in far.resolve(6, local_cores=8)] == [1.0, 1.0]
    gpu = load_mesh_config(_write(tmp_path, GOOD + "device: cuda\nstations: {count: 2}\n"))
    assert [s.num_cpus for s in gpu.resolve(6, local_cores=8)] == [1.0, 1.0]
    fixed = load_mesh_config(_write(tmp_path, GOOD + "num_cpus: 3\nstations: [{layers: [0, 2]}, {layers: [2, 6], "
                                                     "num_cpus: 1}]\n"))
    assert [s.num_cpus for s in fixed.resolve(6, local_cores=8)] == [3.0, 1.0] and not fixed.auto_cpus()
    listed = load_mesh_config(_write(tmp_path, GOOD + "stations: [{layers: [0, 2]}, {layers: [2, 6]}]\n"))
    assert [s.num_cpus for s in listed.resolve(6, local_cores=8)] == [1.0, 1.0] and not listed.auto_cpus()
    for bad in ("fast", 0, -1, "[2]"):
        _refused(tmp_path, GOOD + f"num_cpus: {bad}\n", "num_cpus: expected a number > 0 or auto")


def test_packed_cache_reaches_every_station_and_null_turns_it_off(tmp_path):
    specs = load_mesh_config(_write(tmp_path, "model: {preset: tiny}\nstations: {count: 2}\n")).resolve(6)
    assert [s.packed_cache for s in specs] == ["~/.cache/wavemesh/packed"] * 2  # the default: each node's home
    text = "model: {preset: tiny, packed_cache: /var/cache/mesh}\nstations: [{layers: [0, 6]}]\n"
    assert load_mesh_config(_write(tmp_path, text)).resolve(6)[0].packed_cache == "/var/cache/mesh"
    off = load_mesh_config(_write(tmp_path, "model: {preset: tiny, packed_cache: null}\n")).resolve(6)
    assert off[0].packed_cache == ""  # nothing kept
    _refused(tmp_path, "model: {preset: tiny, packed_cache: ''}\n",
             "model.packed_cache: expected a non-empty string or null")
    _refused(tmp_path, "model: {preset: tiny, packed_cache: 3}\n", "model.packed_cache")
    with pytest.raises(ConfigError, match="model.packed_cache: expected a directory or null, got 3"):
        ModelSource(preset="tiny", packed_cache=3)  # built directly, past the YAML's own check


def test_wavemesh_cache_moves_the_default_packed_cache_only(tmp_path, monkeypatch):
    from mesh.control.cli import _load_config

    monkeypatch.setenv("WAVEMESH_CACHE", str(tmp_path / "wm"))
    moved = str(tmp_path / "wm" / "packed")
    for stations in ("{count: 2}", "[{layers: [0, 6]}]"):
        text = f"model: {{preset: tiny}}\nstations: {stations}\n"
        cfg = _load_config(str(_write(tmp_path, text)))
        assert cfg.model.packed_cache == moved and {s.packed_cache for s in cfg.resolve(6)} == {moved}
    assert _load_config(None).model.packed_cache == moved  # the embedded default too
    own = "model: {preset: tiny, packed_cache: /srv/packed}\nstations: [{layers: [0, 6]}]\n"
    assert _load_config(str(_write(tmp_path, own))).resolve(6)[0].packed_cache == "/srv/packed"  # the YAML's own
    off = _load_config(str(_write(tmp_path, "model: {preset: tiny, packed_cache: null}\n")))
    assert off.model.packed_cache is None and off.resolve(6)[0].packed_cache == ""
    monkeypatch.delenv("WAVEMESH_CACHE")
    assert _load_config(None).model.packed_cache == "~/.cache/wavemesh/packed"


def test_no_stations_key_means_one_full_model_station(tmp_path):
    cfg = load_mesh_config(_write(tmp_path, "model: {preset: tiny, arch: mistral}\n"))
    assert cfg.station_count == 1 and [s.layers for s in cfg.resolve(6)] == [(0, 6)]


def test_relative_model_path_is_taken_from_the_yaml_folder(tmp_path, tiny_llama):
    link = tmp_path / "ckpt"
    link.symlink_to(tiny_llama)
    cfg = load_mesh_config(_write(tmp_path, "model: {path: ckpt}\nstations: [{layers: [0, 3]}, {layers: [3, 6]}]\n"))
    assert cfg.model == ModelSource(path=str(link)) and cfg.model.model_config().num_hidden_layers == 6


@pytest.mark.parametrize("text, n", [
    (268435456, 268435456), ("268435456", 268435456), ("256MiB", 256 * 2**20), ("2GiB", 2 * 2**30),
    ("2 gib", 2 * 2**30), ("1.5GB", 1_500_000_000), ("512Ki", 512 * 1024), ("10KB", 10_000), ("7B", 7),
])
def test_size_strings(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "GiB", "1.5B", "0", 0, "2 GiBs", "-1MiB", True, 1.5])
def test_bad_size_strings(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_local_yaml_is_the_embedded_default():
    assert load_mesh_config(DEPLOY / "local.yaml") == default_mesh_config()
    d = default_mesh_config()
    assert d.ray.address is None and d.model == ModelSource(preset="smollm2-135m-instruct", arch="llama")
    want = StationSpec((0, 30), packed_cache="~/.cache/wavemesh/packed")  # SmolLM2-135M: 30 layers
    assert d.resolve(d.model.model_config()) == (want,)
    assert (d.api.host, d.api.port) == ("127.0.0.1", 8000)


@pytest.mark.parametrize("name", ["local", "one-gpu", "two-gpu", "three-gpu", "multi-node"])
def test_deploy_yamls_load(name, tmp_path):
    path = DEPLOY / f"{name}.yaml"
    cfg = load_mesh_config(path, check_paths=False)
    if cfg.model.path is None:
        return
    if not Path(cfg.model.path).exists():  # /models/...: only the path is wrong
        with pytest.raises(ConfigError, match=rf"^{path}: model\.path: {cfg.model.path} does not exist$"):
            load_mesh_config(path)
    # against a Llama-3.1-8B-shaped config.json the stations chain over all 32 layers
    (tmp_path / "config.json").write_text(json.dumps(_llama8b().to_hf()))
    specs = dataclasses.replace(cfg, model=ModelSource(path=str(tmp_path))).resolve(_llama8b())
    assert specs[0].start == 0 and specs[-1].end == 32 and all(s.device == "cuda" and s.num_gpus == 1 for s in specs)
    if name == "multi-node":
        assert cfg.ray.address == "auto" and len(specs) == 3
        assert [s.layers for s in specs] == plan_layers(32, 3, layer_weights(_llama8b(), "bfloat16"))


def _llama8b() -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128)


# ---- dataclasses and plans -------------------------------------------------------------------------

def test_configs_are_frozen_and_with_stations_returns_a_new_object():
    cfg = default_mesh_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dtype = "bfloat16"
    grown = cfg.with_stations([StationSpec((0, 3)), StationSpec((3, 6))])
    assert cfg.station_count == 1 and cfg.stations is None
    assert grown.station_count is None and [s.layers for s in grown.resolve(6)] == [(0, 3), (3, 6)]
    with pytest.raises(ConfigError, match="overlap"):
        cfg.with_stations([StationSpec((0, 4)), StationSpec((3, 6))])
    with pytest.raises(ConfigError, match="exactly one"):
        MeshConfig()


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match="ray.address"):
        RayConfig(address="")
    with pytest.raises(ConfigError, match="cluster.call_timeout_s"):
        ClusterConfig(call_timeout_s=0)
    with pytest.raises(ConfigError, match="exactly one of path or preset"):
        ModelSource()
    with pytest.raises(ConfigError, match="kv_bytes"):
        MeshConfig(station_count=1, kv_bytes=0)
    with pytest.raises(ConfigError, match=r"resources: expected \(name, amount\) pairs"):
        StationSpec((0, 6), resources={"zone_a": 1})  # a dict is not hashable: specs are dict keys
    with pytest.raises(ConfigError, match="resources: zone_a: expected a number > 0, got -1"):
        StationSpec((0, 6), resources=(("zone_a", -1),))


@pytest.mark.parametrize("build, field", [
    (lambda: SchedulerConfig(max_seqs=True), "scheduler.max_seqs"),
    (lambda: SchedulerConfig(extra_waves=False), "scheduler.extra_waves"),
    (lambda: StationSpec(layers=(False, 3)), "layers"),
    (lambda: ClusterConfig(max_restarts=True), "cluster.max_restarts"),
    (lambda: MeshConfig(station_count=True), "stations.count"),
    (lambda: plan_layers(6, True), "stations.count"),
    (lambda: dataclasses.replace(preset_config("tiny"), head_dim=True), "head_dim"),
])
def test_a_bool_is_not_an_integer(build, field):
    """Every integer field refuses True/False (a bool is an int to Python), naming the field."""
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build()


def test_one_arch_list_and_one_dtype_table():
    """The presets, the YAML schema, the CLI and config.json all read the same architectures and dtypes."""
    from mesh.control.cli import build_parser
    from mesh.core.config import ARCH_CLASSES, DTYPE_BYTES, SUPPORTED_ARCHS, SUPPORTED_DTYPES

    assert SUPPORTED_ARCHS == tuple(ARCH_CLASSES) and SUPPORTED_DTYPES == tuple(DTYPE_BYTES)
    for arch in SUPPORTED_ARCHS:
        hf = preset_config("tiny", arch).to_hf()
        assert hf["architectures"] == [ARCH_CLASSES[arch]] and ModelConfig.from_hf(hf).arch == arch
        assert ModelSource(preset="tiny", arch=arch).arch == arch
    parser = build_parser()
    assert parser.parse_args(["init-model", "--arch", SUPPORTED_ARCHS[-1], "--out", "x"]).arch == SUPPORTED_ARCHS[-1]
    last_dtype = SUPPORTED_DTYPES[-1]
    assert parser.parse_args(["generate", "--prompt", "x", "--dtype", last_dtype]).dtype == last_dtype
    with pytest.raises(SystemExit):
        parser.parse_args(["init-model", "--arch", "gpt2", "--out", "x"])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_plan_layers_on_bench_covers_all_layers_with_balanced_bytes(arch, count):
    cfg = preset_config("bench", arch)
    L = cfg.num_hidden_layers
    ranges = plan_layers(L, count, layer_weights(cfg))
    assert len(ranges) == count and ranges[0][0] == 0 and ranges[-1][1] == L
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)) and all(s < e for s, e in ranges)
    sizes = [station_bytes(cfg, s, e, "float32") for s, e in ranges]
    assert sum(sizes) >= station_bytes(cfg, 0, L, "float32")  # a tied head split off costs a copy
    if count in (2, 3):
        assert max(sizes) <= 1.5 * sum(sizes) / count
    if count >= 3:  # the embedding / head ends carry fewer layers than the middle
        assert ranges[0][1] - ranges[0][0] <= ranges[1][1] - ranges[1][0]


def test_plan_layers_even_and_refusals():
    assert plan_layers(6, 1) == [(0, 6)]
    assert plan_layers(12, 5) in ([(0, 2), (2, 4), (4, 6), (6, 9), (9, 12)],
                                  [(0, 3), (3, 6), (6, 8), (8, 10), (10, 12)])
    assert [e - s for s, e in plan_layers(12, 5)].count(3) == 2  # as even as can be: 3, 3, 2, 2, 2
    assert plan_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ConfigError, match="stations.count: 5 stations for a model of 4 layers"):
        plan_layers(4, 5)
    with pytest.raises(ConfigError, match="stations.count"):
        plan_layers(4, 0)


def test_station_bytes_counts_embedding_head_and_tying():
    cfg = preset_config("tiny", "llama")  # untied
    d, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    layer = station_bytes(cfg, 1, 2, "float32")
    assert station_bytes(cfg, 0, 1, "float32") == layer + V * d * 4
    assert station_bytes(cfg, L - 1, L, "float32") == layer + (V * d + d) * 4
    assert station_bytes(cfg, 0, L, "bfloat16") * 2 == station_bytes(cfg, 0, L, "float32")
    tied = preset_config("tiny", "qwen2")
    whole = station_bytes(tied, 0, L, "float32")
    assert whole + V * d * 4 == station_bytes(tied, 0, 3, "float32") + station_bytes(tied, 3, L, "float32")


def test_a_checkpoint_config_loads_without_importing_torch(tmp_path):
    code = ("import sys; from mesh.control.cluster_yaml import mesh_config_from_dict as f; "
            "f({'model': {'path': '/models/x'}, 'stations': {'count': 2}}, check_paths=False); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


def test_compute_balance_evens_bytes_read_per_step(tmp_path):
    """balance: compute counts the head (read whole every step) but not the embedding (read by rows),
    so the first station takes more layers than a memory split gives it and the per-step reads even out."""
    cfg = preset_config("bench")
    memory = load_mesh_config(_write(tmp_path, "model: {preset: bench}\nstations: {count: 2}\n")).resolve(cfg)
    compute = load_mesh_config(_write(tmp_path, "model: {preset: bench}\nstations: {count: 2, balance: compute}\n"))
    assert compute.balance == "compute"
    assert [s.layers for s in memory] == [(0, 6), (6, 12)]
    ranges = [s.layers for s in compute.resolve(cfg)]
    assert ranges == plan_layers(12, 2, step_weights(cfg)) and ranges[0][1] > 6
    reads = [sum(step_weights(cfg)[a:b]) for a, b in ranges]
    even_reads = [sum(step_weights(cfg)[a:b]) for a, b in ((0, 6), (6, 12))]
    assert max(reads) < max(even_reads)
    assert split_weights(cfg, "float32", "memory") == layer_weights(cfg)
    with pytest.raises(ConfigError, match="stations.balance: expected one of memory, compute, got 'speed'"):
        load_mesh_config(_write(tmp_path, "model: {preset: bench}\nstations: {count: 2, balance: speed}\n"))


def test_scale_and_add_station_share_the_cores_out_again(tiny_llama, monkeypatch):
    """Under `num_cpus: auto` a re-plan gives each station of the new count its share of this machine's cores (as
    planned here on a 4-core machine, before any station starts); explicit stations keep their own."""
    import os

    from mesh.control.cluster import Cluster

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    cluster = Cluster(mesh_config_from_dict({"model": {"path": str(tiny_llama)}}), tiny_llama, progress=lambda _: None)
    monkeypatch.setattr(cluster, "reroute", lambda specs: specs)  # the plan it would start, not started
    assert [s.num_cpus for s in cluster.specs] == [4.0]
    assert [s.num_cpus for s in cluster.scale(2)] == [2.0, 2.0]
    assert [s.num_cpus for s in cluster.scale(3)] == [1.0, 1.0, 1.0]
    cluster.specs = cluster.scale(1)
    assert [(s.layers, s.num_cpus) for s in cluster.add_station()] == [((0, 3), 2.0), ((3, 6), 2.0)]
    listed = Cluster(mesh_config_from_dict({"model": {"path": str(tiny_llama)},
                                            "stations": [{"layers": [0, 6], "num_cpus": 3}]}),
                     tiny_llama, progress=lambda _: None)
    monkeypatch.setattr(listed, "reroute", lambda specs: specs)
    assert [s.num_cpus for s in listed.scale(2)] == [3.0, 3.0]


def test_model_flag_takes_a_path_or_a_preset_name(tmp_path, monkeypatch):
    """`--model` of `mesh generate` and the benchmarks: a file or checkpoint directory as given, else a preset's name
    is its built-in model, and any other name stays a path (whatever reads it names the missing file)."""
    from mesh.control.cli import resolve_model

    monkeypatch.setenv("WAVEMESH_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    built = resolve_model("tiny")
    assert built == resolve_model(None, "tiny") and (built / "config.json").is_file()
    assert ModelConfig.from_dir(built).num_hidden_layers == preset_config("tiny").num_hidden_layers
    assert resolve_model("no/such/checkpoint") == Path("no/such/checkpoint")
    (tmp_path / "tiny").mkdir()  # a directory of that name here, but no checkpoint: still the preset
    assert resolve_model("tiny") == built
    (tmp_path / "tiny" / "config.json").write_text("{}")  # a checkpoint directory of that name: the path wins
    assert resolve_model("tiny") == Path("tiny")
