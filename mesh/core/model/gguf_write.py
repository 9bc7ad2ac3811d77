"""A Hugging Face checkpoint written as a GGUF file, the way llama.cpp's converter lays it out.

Tests and benchmarks need GGUF files of the synthetic checkpoints: every tensor is renamed to its
llama.cpp name, q_proj/k_proj rows are put in llama.cpp's per-head order (llama only), 1-D tensors
stay float32 and matrices are stored as `qtype` (quantized by the `gguf` package). The byte-level BPE
tokenizer goes into `tokenizer.ggml.*` with its chat template. No torch here.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from safetensors import safe_open

from mesh.core.config import ModelConfig
from mesh.core.model.gguf_file import gguf_name

FLOAT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the two rotary halves interleaved (inverse of unpermute_rows)."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])  # [H, 2, D/2, ...]
            .swapaxes(1, 2).reshape(w.shape))  # [H, D/2, 2, ...] -> [rows, ...]


def _add_tokenizer(writer: GGUFWriter, model_dir: Path) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        if tcfg.get(key) in vocab:
            add(vocab[tcfg[key]])
    writer.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))
    if tcfg.get("chat_template"):
        writer.add_chat_template(tcfg["chat_template"])


def write_gguf(model_dir: str | Path, out_path: str | Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
               arch: str | None = None, qtype_of: Mapping[str, GGMLQuantizationType] | None = None,
               quantizer: Callable[[np.ndarray, GGMLQuantizationType], np.ndarray] = quantize) -> Path:
    """Write the single-file safetensors checkpoint at `model_dir` (float32 or bfloat16) as GGUF; matrices in
    `qtype` (BF16 among them: a bfloat16 checkpoint's values exactly).

    `arch` overrides general.architecture (to write a file of an architecture this runtime refuses); `qtype_of`
    gives the matrices of some modules another type ({"o_proj": F16}: every layer's o_proj), as quantizers mix them;
    `quantizer` makes a matrix's blocks (the `gguf` package's by default, which has none for the K-quants: a test
    may bring its own).
    """
    model_dir, out = Path(model_dir), Path(out_path)
    cfg = ModelConfig.from_dir(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:  # torch reads bfloat16, numpy cannot
        state = {name: f.get_tensor(name).float().numpy() for name in f.keys()}
    writer = GGUFWriter(out, arch or cfg.arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(writer, model_dir)
    for name in sorted(state):
        w = state[name].astype(np.float32)
        kind = next((t for module, t in (qtype_of or {}).items() if f".{module}." in name), qtype)
        if cfg.arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            w = permute_rows(w, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        if w.ndim == 1 or kind == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), w)
        elif kind in FLOAT_TYPES:
            writer.add_tensor(gguf_name(name), w.astype(FLOAT_TYPES[kind]))
        else:
            writer.add_tensor(gguf_name(name), quantizer(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
