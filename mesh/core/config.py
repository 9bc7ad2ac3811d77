"""Frozen configuration dataclasses shared by every process.

One tree: MeshConfig -> ModelConfig (what the checkpoint is), StationSpec (which
layers a station holds and where), SchedulerConfig (how waves are planned) and
ApiConfig (how the HTTP surface listens; these two in mesh.core.serving_config,
named here too). Every dataclass validates itself on construction and raises
ConfigError (mesh.core.config_checks) naming the offending field. Nothing here
imports torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mesh.core.config_checks import ConfigError, is_int, require as _require

# HF model_type -> its class name in config.json `architectures`
ARCH_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ARCHS = tuple(ARCH_CLASSES)  # the one list of architectures (config, presets, tokenizers, CLI)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the one table of station dtypes: name -> bytes per element
SUPPORTED_DTYPES = tuple(DTYPE_BYTES)


def _read_json(p: Path) -> dict[str, Any]:
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON: {e}") from e
    _require(isinstance(d, dict), f"{p}: expected a JSON object")
    return d


def _id_list(v: Any) -> list[int]:
    return list(v) if isinstance(v, list) else ([] if v is None else [v])


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary embedding frequency scaling, as in a Hugging Face config.json."""

    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0  # frequency divisor (linear, llama3)
    low_freq_factor: float = 1.0  # llama3: wavelengths above orig/low are fully scaled
    high_freq_factor: float = 4.0  # llama3: wavelengths below orig/high are kept
    original_max_position_embeddings: int = 8192  # llama3: the pre-extension context

    def __post_init__(self) -> None:
        _require(self.rope_type in ("default", "linear", "llama3"),
                 f"rope_scaling.rope_type: unsupported {self.rope_type!r} (default, linear, llama3)")
        _require(self.factor > 0, f"rope_scaling.factor must be > 0, got {self.factor}")
        _require(self.high_freq_factor > self.low_freq_factor or self.rope_type != "llama3",
                 "rope_scaling.high_freq_factor must exceed low_freq_factor")

    @staticmethod
    def from_hf(d: dict[str, Any] | None) -> "RopeScaling":
        """Read the `rope_scaling` (or `rope_parameters`) dict of an HF config."""
        if not d:
            return RopeScaling()
        kind = d.get("rope_type", d.get("type", "default"))
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return RopeScaling(rope_type=kind, **{k: d[k] for k in keys if k in d})

    def to_hf(self) -> dict[str, Any] | None:
        """The HF `rope_scaling` dict (None for plain RoPE)."""
        if self.rope_type == "default":
            return None
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {"rope_type": "llama3", "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face config.json."""

    arch: str  # "llama" | "mistral" | "qwen2" (HF model_type)
    vocab_size: int  # rows of the embedding and of lm_head
    hidden_size: int  # d, width of the residual stream
    intermediate_size: int  # width of the SwiGLU MLP
    num_hidden_layers: int  # L, decoder layers in the whole model
    num_attention_heads: int  # query heads H
    num_key_value_heads: int  # KV heads (GQA when < H)
    head_dim: int  # D, per-head width
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # frequency scaling
    max_position_embeddings: int = 2048  # the model's context length
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    qkv_bias: bool = False  # q/k/v projections carry a bias (qwen2; llama attention_bias)
    o_bias: bool = False  # o_proj carries a bias (llama attention_bias only)
    sliding_window: int | None = None  # mistral: attend only to the last W positions
    bos_token_id: int | None = 1  # prepended by the tokenizer
    eos_token_ids: tuple[int, ...] = (2,)  # any of these ends a sequence

    def __post_init__(self) -> None:
        _require(self.arch in SUPPORTED_ARCHS,
                 f"model_type: unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            _require(is_int(v) and v > 0, f"{name} must be a positive integer, got {v!r}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                 f"num_key_value_heads ({self.num_key_value_heads})")
        _require(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        _require(self.rms_norm_eps > 0, "rms_norm_eps must be > 0")
        _require(self.rope_theta > 0, "rope_theta must be > 0")
        _require(self.sliding_window is None or self.sliding_window > 0, "sliding_window must be > 0")
        _require(all(0 <= t < self.vocab_size for t in self.eos_token_ids),
                 f"eos_token_id {self.eos_token_ids} outside the vocabulary ({self.vocab_size})")

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K and V bytes of one token in one layer, in float32 units of 1 (multiply by dtype size)."""
        return 2 * self.num_key_value_heads * self.head_dim

    @staticmethod
    def from_hf(d: dict[str, Any]) -> "ModelConfig":
        """Build from the dict of a Hugging Face config.json, refusing what we cannot run."""
        arch = d.get("model_type")
        _require(arch in SUPPORTED_ARCHS,
                 f"config.json model_type: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        _require(d.get("hidden_act", "silu") == "silu", f"config.json hidden_act: unsupported {d.get('hidden_act')!r}")
        _require(not d.get("mlp_bias", False), "config.json mlp_bias: true is not supported")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            _require(key in d, f"config.json: missing required key {key!r}")
        heads = d["num_attention_heads"]
        rope_params = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
        theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        eos = d.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = d.get("sliding_window")
        if arch == "qwen2" and not d.get("use_sliding_window", False):
            window = None
        if arch == "llama":
            window = None
        bias = bool(d.get("attention_bias", False))
        return ModelConfig(
            arch=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=RopeScaling.from_hf(scaling),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "qwen2" else bias, o_bias=bias if arch == "llama" else False,
            sliding_window=window, bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids)

    @staticmethod
    def from_dir(path: str | Path) -> "ModelConfig":
        """Read `config.json` from a checkpoint directory (its EOS list joined by generation_config.json's),
        or the metadata of a `.gguf` file."""
        if Path(path).suffix.lower() == ".gguf" and not Path(path).is_dir():
            from mesh.core.model.gguf_file import GGUFCheckpoint, GGUFError  # numpy, no torch: only for GGUF

            try:
                return ModelConfig.from_hf(GGUFCheckpoint(path).hf_config())
            except GGUFError as e:
                raise ConfigError(str(e)) from None
        p = Path(path) / "config.json"
        _require(p.is_file(), f"{p}: no config.json (is this a Hugging Face checkpoint directory?)")
        d = _read_json(p)
        gen = Path(path) / "generation_config.json"
        if gen.is_file():  # a checkpoint's end-of-turn token is often listed only here
            eos = [e for src in (d, _read_json(gen)) for e in _id_list(src.get("eos_token_id"))]
            d = d | {"eos_token_id": list(dict.fromkeys(eos))}
        return ModelConfig.from_hf(d)

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face config.json dict for this model."""
        d: dict[str, Any] = {
            "architectures": [ARCH_CLASSES[self.arch]], "model_type": self.arch,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": "float32",
        }
        if self.arch == "llama":
            d["attention_bias"] = self.qkv_bias
            d["mlp_bias"] = False
        if self.arch == "mistral":
            d["sliding_window"] = self.sliding_window
        if self.arch == "qwen2":
            d["use_sliding_window"] = False
            d["sliding_window"] = None
        return d


CPU_PART_ROWS = 48  # StationSpec.relay_part_rows on a CPU (bench/out/core_quota_s51.txt part 3)


@dataclass(frozen=True, slots=True)
class StationSpec:
    """One station: a contiguous layer range [start, end) and where it runs."""

    layers: tuple[int, int]  # [start, end) absolute layer indices
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    dtype: str = "float32"  # weights and activations
    kv_bytes: int = 256 * 2**20  # KV budget of this station in bytes
    num_gpus: float = 0.0  # Ray resource request
    num_cpus: float = 1.0  # Ray resource request (and the station's torch threads)
    # matmul kernel: auto (on CPU the first row-count invariant kernel that passes its start-up probe, so a row's
    # bits never depend on its wave: packed for float32, then oneDNN; else F.linear) | packed (the project's own
    # C kernel, float32, or refuse) | onednn (or refuse) | aten (F.linear: MKL's bits vary with the row count)
    linear_backend: str = "auto"
    # Ray custom resources the station's node must have, as sorted (name, amount) pairs (YAML: {NAME: amount}),
    # e.g. a label a KubeRay worker group advertises: they place the station on that node
    resources: tuple[tuple[str, float], ...] = ()
    # which copy of this layer range (not a YAML key): a re-plan that keeps a range loads a fresh copy beside the
    # serving one, so the switch can be made before it breaks (mesh.control.cluster)
    copy: int = 0
    # a directory (~ expanded on the station's node) where the weights a packed station builds from a GGUF are
    # kept for the next station holding the same layers (mesh.core.model.packed_cache); "" keeps nothing
    packed_cache: str = ""
    cuda_graphs: bool = True  # on a CUDA device, replay decode waves as CUDA graphs (station.decode_graphs); False: eager
    # on a CPU, ask Linux for transparent huge pages (2 MiB) for the packed weights and the KV cache
    # (mesh.core.model.host_memory: decode faster where huge pages fault in fast); False: 4 KiB pages
    huge_pages: bool = True
    # a relayed wave of at least twice this many rows goes on to the next station in parts of at least this many (up
    # to 4), each the moment its rows exist (station.relay_parts); null: by device (48 on a CPU, whose prefill runs
    # at full rate from there; on CUDA never, as a part re-reads every weight); 0: never
    relay_part_rows: int | None = None

    def __post_init__(self) -> None:
        _require(self.relay_part_rows is None or (is_int(self.relay_part_rows) and self.relay_part_rows >= 0),
                 f"relay_part_rows: expected an integer >= 0 or null, got {self.relay_part_rows!r}")
        _require(isinstance(self.cuda_graphs, bool), f"cuda_graphs: expected true or false, got {self.cuda_graphs!r}")
        _require(isinstance(self.huge_pages, bool), f"huge_pages: expected true or false, got {self.huge_pages!r}")
        _require(isinstance(self.packed_cache, str), f"packed_cache: expected a directory path string, got "
                 f"{self.packed_cache!r}")
        _require(is_int(self.copy) and self.copy >= 0, f"copy: expected an integer >= 0, got {self.copy!r}")
        _require(isinstance(self.resources, tuple)
                 and all(isinstance(pair, tuple) and len(pair) == 2 for pair in self.resources),
                 f"resources: expected (name, amount) pairs, got {self.resources!r}")
        for name, amount in self.resources:
            _require(isinstance(name, str) and name != "",
                     f"resources: a name must be a non-empty string, got {name!r}")
            _require(name not in ("CPU", "GPU", "memory", "object_store_memory"),
                     f"resources: {name} is asked for with num_cpus / num_gpus, not as a custom resource")
            _require(isinstance(amount, (int, float)) and not isinstance(amount, bool) and math.isfinite(amount)
                     and amount > 0, f"resources: {name}: expected a number > 0, got {amount!r}")
        _require(self.linear_backend in ("auto", "aten", "onednn", "packed"),
                 f"linear_backend: expected auto, aten, onednn or packed, got {self.linear_backend!r}")
        _require(isinstance(self.layers, tuple) and len(self.layers) == 2
                 and all(is_int(x) for x in self.layers),
                 f"layers must be [start, end] integers, got {self.layers!r}")
        _require(0 <= self.layers[0] < self.layers[1], f"layers: need 0 <= start < end, got {list(self.layers)}")
        _require(self.device == "cpu" or self.device.startswith("cuda"),
                 f"device: expected 'cpu' or 'cuda[:N]', got {self.device!r}")
        _require(self.dtype in SUPPORTED_DTYPES, f"dtype: expected one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        _require(isinstance(self.kv_bytes, int) and self.kv_bytes > 0, f"kv_bytes must be > 0, got {self.kv_bytes!r}")
        for name in ("num_gpus", "num_cpus"):
            v = getattr(self, name)
            _require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
                     f"{name}: expected a finite number >= 0, got {v!r}")

    @property
    def part_rows(self) -> int:
        """The rows of a relayed wave's part at least (`relay_part_rows`, or the device's; 0: never cut)."""
        if self.relay_part_rows is not None:
            return self.relay_part_rows
        return CPU_PART_ROWS if self.device == "cpu" else 0

    @property
    def start(self) -> int:
        """First layer held (inclusive)."""
        return self.layers[0]

    @property
    def end(self) -> int:
        """One past the last layer held."""
        return self.layers[1]

    def check_against(self, model: ModelConfig) -> None:
        """Refuse a range that runs past the model's layers."""
        _require(self.end <= model.num_hidden_layers,
                 f"layers: end {self.end} exceeds the model's {model.num_hidden_layers} layers")


# how waves are planned and the HTTP surface listens: their own module, named here with the rest of the tree
from mesh.core.serving_config import (CATCHUP_SOURCES, CHAIN_CALL_STEPS, CHAIN_REPLY_STEPS,  # noqa: E402
                                      HIDDEN_PATHS, LONE_CALL_STEPS, MAX_DECODE_STEPS, ROUTE_SWITCHES, ApiConfig,
                                      SchedulerConfig)

__all__ = ["ARCH_CLASSES", "SUPPORTED_ARCHS", "DTYPE_BYTES", "SUPPORTED_DTYPES", "ConfigError", "is_int",
           "RopeScaling", "ModelConfig", "StationSpec", "MAX_DECODE_STEPS", "CHAIN_CALL_STEPS", "CHAIN_REPLY_STEPS",
           "LONE_CALL_STEPS", "HIDDEN_PATHS", "ROUTE_SWITCHES", "CATCHUP_SOURCES", "SchedulerConfig", "ApiConfig"]
