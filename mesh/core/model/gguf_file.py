"""A GGUF checkpoint (llama.cpp's single-file format) read as a Hugging Face one, tensor by tensor.

The header is read by mesh.core.model.gguf_header (once per process and file; the tokenizer's string
arrays only when asked for) and the file memory-mapped; nothing is read until a tensor is asked for by its
HF name (`model.layers.17.self_attn.q_proj.weight`), so a station touches only its own layers' pages.
A tensor comes back dequantized to float32 and in the HF layout: llama.cpp's converter renames every
tensor and, for the llama architecture, reorders the rows of q_proj and k_proj within each head (it
interleaves the two rotary halves); both are undone here. Everything a station cannot run (another
architecture, a tensor type outside SUPPORTED_TYPES, a missing or cut-off tensor) is refused when the
file is opened, before anything loads. No torch here: the control plane reads shapes through it.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from mesh.core.model.gguf_dequant import dequantize_f32
from mesh.core.model.gguf_header import HeaderError, TensorInfo, read_header

GGUF_ARCHS = ("llama", "qwen2")  # general.architecture values this runtime runs (mistral GGUFs say llama)
NARROW_TYPES = {Q.F16: np.float16, Q.BF16: np.int16}  # 16-bit float types read_narrow keeps (bfloat16 as its bits)
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                   Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
                   Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_M, Q.IQ1_S)
_SUPPORTED = frozenset(SUPPORTED_TYPES)
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
# llama.cpp writes llama3-style rope scaling as a per-frequency divisor tensor instead of config keys;
# the published Llama 3.1 / 3.2 parameters are recognised from it: (factor, low, high, original context)
_LLAMA3_SCALINGS = ((8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 1.0, 4.0, 8192))
ROPE_FREQS = "rope_freqs.weight"


class GGUFError(ValueError):
    """A GGUF file this runtime cannot run: unreadable, cut off, or of an unsupported architecture or type."""


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a llama.cpp tensor name (None for a tensor with no HF twin)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.KIND.weight|bias (a regex match cost 3x this, per tensor of a file)
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdecimal() or parts[3] not in ("weight", "bias"):
        return None
    kind = _LAYER_NAMES.get(parts[2])
    return None if kind is None else f"model.layers.{parts[1]}.{kind}.{parts[3]}"


def gguf_name(name: str) -> str:
    """The llama.cpp tensor name of a Hugging Face parameter name (the inverse of hf_name)."""
    top = {h: g for g, h in _TOP_NAMES.items()}
    if name in top:
        return top[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(\w+\.\w+|\w+)\.(weight|bias)", name)
    layer = {h: g for g, h in _LAYER_NAMES.items()}
    if m is None or m.group(2) not in layer:
        raise GGUFError(f"{name}: no llama.cpp tensor name for it")
    return f"blk.{m.group(1)}.{layer[m.group(2)]}.{m.group(3)}"


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows (0, D/2, 1, D/2+1, ...) back to (0, 1, ..., D-1)."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])  # [H, D/2, 2, ...]
            .swapaxes(1, 2).reshape(w.shape))  # [H, 2, D/2, ...] -> [rows, ...]


def _shortest(v: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(v)))


def is_gguf(path: str | Path) -> bool:
    """True when `path` names a GGUF file (a file whose name ends in .gguf)."""
    p = Path(path)
    return p.suffix.lower() == ".gguf" and not p.is_dir()


def transformers_source(path: str | Path) -> tuple[Path, dict[str, str]]:
    """`from_pretrained` arguments for a checkpoint: (directory, {}) or, for a GGUF file, (its folder, {gguf_file})."""
    p = Path(path)
    return (p.parent, {"gguf_file": p.name}) if is_gguf(p) else (p, {})


class GGUFCheckpoint:
    """One opened, validated GGUF file: its metadata, its tensors by HF name, and reads of them."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        try:
            self.header = read_header(self.path)
        except (HeaderError, ValueError, OSError) as e:
            raise GGUFError(f"{self.path}: not a complete GGUF file (truncated or corrupt): {e}") from None
        self.arch = self.meta("general.architecture")
        if self.arch not in GGUF_ARCHS:
            raise GGUFError(f"{self.path}: general.architecture: unsupported architecture {self.arch!r}; "
                            f"supported: {', '.join(GGUF_ARCHS)}")
        size = len(self.header.data)
        self.tensors: dict[str, TensorInfo] = {}
        for t in self.header.tensors:
            if t.tensor_type not in _SUPPORTED:
                raise GGUFError(f"{self.path}: tensor {t.name}: unsupported tensor type {t.tensor_type.name}; "
                                f"supported: {', '.join(q.name for q in SUPPORTED_TYPES)}")
            if t.data_offset + t.n_bytes > size:
                raise GGUFError(f"{self.path}: tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, past the "
                                f"end of the file ({size} bytes): truncated")
            name = hf_name(t.name)
            if name is not None:
                self.tensors[name] = t
            elif t.name != ROPE_FREQS:
                raise GGUFError(f"{self.path}: tensor {t.name}: not a tensor of the {self.arch} architecture")

    @property
    def reader(self) -> GGUFReader:
        """The `gguf` package's full reader of the file (every field as numpy parts: slow; for tools and tests)."""
        return GGUFReader(self.path, "r")

    def meta(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key` (a str, number, bool or list), or `default` when absent."""
        try:
            return self.header.value(key, default)
        except HeaderError as e:
            raise GGUFError(f"{self.path}: {e}") from None

    def _arch_meta(self, key: str, default: Any = None) -> Any:
        v = self.meta(f"{self.arch}.{key}", default)
        if isinstance(v, list):
            if len(set(v)) != 1:
                raise GGUFError(f"{self.path}: {self.arch}.{key}: per-layer values {v[:4]}... are not supported")
            v = v[0]
        return v

    def hf_config(self) -> dict[str, Any]:
        """The Hugging Face config.json dict this file's metadata describes."""
        need = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
        for key in need:
            if self.meta(f"{self.arch}.{key}") is None:
                raise GGUFError(f"{self.path}: missing metadata {self.arch}.{key}")
        hidden, heads = self._arch_meta("embedding_length"), self._arch_meta("attention.head_count")
        head_dim = self._arch_meta("attention.key_length", hidden // heads)
        rot = self._arch_meta("rope.dimension_count", head_dim)
        if rot != head_dim:
            raise GGUFError(f"{self.path}: {self.arch}.rope.dimension_count: partial rotary ({rot} of {head_dim}) "
                            "is not supported")
        vocab = self._arch_meta("vocab_size") or self.header.length("tokenizer.ggml.tokens") \
            or int(self._tensor("model.embed_tokens.weight").shape[1])
        eos = [self.meta(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
        d: dict[str, Any] = {
            "model_type": self.arch, "vocab_size": int(vocab), "hidden_size": hidden,
            "intermediate_size": self._arch_meta("feed_forward_length"),
            "num_hidden_layers": self._arch_meta("block_count"), "num_attention_heads": heads,
            "num_key_value_heads": self._arch_meta("attention.head_count_kv", heads), "head_dim": head_dim,
            "rms_norm_eps": _shortest(self._arch_meta("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": _shortest(self._arch_meta("rope.freq_base", 10000.0)),
            "max_position_embeddings": self._arch_meta("context_length", 2048),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "bos_token_id": self.meta("tokenizer.ggml.bos_token_id"),
            "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)),
            "rope_scaling": self._rope_scaling(head_dim),
        }
        if self.arch == "llama":
            d["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in self.tensors
        return d

    def _rope_scaling(self, head_dim: int) -> dict[str, Any] | None:
        kind = self._arch_meta("rope.scaling.type")
        if any(t.name == ROPE_FREQS for t in self.header.tensors):
            return self._llama3_scaling(head_dim)
        if kind in (None, "none"):
            return None
        if kind != "linear":
            raise GGUFError(f"{self.path}: {self.arch}.rope.scaling.type: unsupported {kind!r} (linear)")
        return {"rope_type": "linear", "factor": float(self._arch_meta("rope.scaling.factor", 1.0))}

    def _llama3_scaling(self, head_dim: int) -> dict[str, Any]:
        t = next(t for t in self.header.tensors if t.name == ROPE_FREQS)
        divisors = dequantize_f32(self.header.tensor_bytes(t), t.tensor_type).astype(np.float64).reshape(-1)  # [D/2]
        theta = float(self._arch_meta("rope.freq_base", 10000.0))
        wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)  # [D/2]
        for factor, low, high, orig in _LLAMA3_SCALINGS:
            smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
            expect = 1.0 / ((1 - smooth) / factor + smooth)
            if expect.shape == divisors.shape and np.allclose(expect, divisors, rtol=1e-3):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": orig}
        raise GGUFError(f"{self.path}: tensor {ROPE_FREQS}: rope frequency factors that match no known llama3 "
                        "scaling are not supported")

    def _tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: missing tensor for {name!r}")
        return self.tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The HF shape of tensor `name` (GGUF lists dimensions innermost first)."""
        return self._tensor(name).hf_shape

    def type_name(self, name: str) -> str:
        """The GGML type of tensor `name` (F32, Q4_K, ...)."""
        return self._tensor(name).tensor_type.name

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32, in the Hugging Face layout (q/k rows un-permuted)."""
        t = self._tensor(name)
        w = dequantize_f32(self.header.tensor_bytes(t), t.tensor_type).reshape(t.hf_shape)  # a new array
        order = self.row_order(name)
        return w if order is None else w[order]

    def read_narrow(self, name: str) -> np.ndarray | None:
        """Tensor `name` as stored where it is F16 or BF16 (float16, or bfloat16's bits as int16), in the Hugging Face
        layout: the file's mapped bytes themselves (read-only: nothing is read until used) where it keeps HF's row
        order, else a new array; None for any other type (`read` widens those)."""
        t = self._tensor(name)
        if t.tensor_type not in NARROW_TYPES:
            return None
        w = self.header.tensor_bytes(t).view(NARROW_TYPES[t.tensor_type]).reshape(t.hf_shape)
        order = self.row_order(name)
        return w if order is None else w[order]

    def blocks(self, name: str) -> tuple[Q, np.ndarray]:
        """Tensor `name`'s type and bytes as stored (rows of blocks, memory-mapped, nothing read; see row_order)."""
        t = self._tensor(name)
        return t.tensor_type, self.header.tensor_bytes(t)

    def row_order(self, name: str) -> np.ndarray | None:
        """Where each HF row of tensor `name` is stored (int64: HF row r is stored row order[r]), or None when the
        file keeps HF's order: llama.cpp reorders llama's q_proj and k_proj rows within each head."""
        if self.arch != "llama" or not (".q_proj." in name or ".k_proj." in name):
            return None
        heads = self._arch_meta("attention.head_count")
        if ".k_proj." in name:
            heads = self._arch_meta("attention.head_count_kv", heads)
        return unpermute_rows(np.arange(self.shape(name)[0], dtype=np.int64), heads)
