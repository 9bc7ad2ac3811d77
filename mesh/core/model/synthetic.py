"""Synthetic Hugging Face checkpoints with deterministic random weights.

No model can be downloaded, so the project writes its own: config.json,
model.safetensors (or shards + index), tokenizer.json and tokenizer_config.json.
Weights are scaled so each layer moves the residual stream and logits are peaked
enough that greedy decoding wanders over many tokens instead of repeating one.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from mesh.core.config import SUPPORTED_ARCHS, ModelConfig, RopeScaling
from mesh.core.model.llama import LlamaRange
from mesh.core.model.tokenizer_gen import write_tokenizer

# how a checkpoint's weights are stored
CHECKPOINT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

PRESETS = {
    # name: (hidden, layers, heads, kv_heads, ffn, vocab, context)
    "tiny": (64, 6, 4, 2, 160, 512, 1024),
    "small": (256, 8, 8, 4, 688, 4096, 2048),
    "bench": (768, 12, 12, 4, 2048, 32000, 4096),
}


def preset_config(preset: str, arch: str = "llama") -> ModelConfig:
    """The ModelConfig of a named preset in one of the supported architectures."""
    if preset not in PRESETS:
        raise ValueError(f"preset: unknown {preset!r}; choose from {', '.join(PRESETS)}")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: unknown {arch!r}; choose from {', '.join(SUPPORTED_ARCHS)}")
    hidden, layers, heads, kv_heads, ffn, vocab, ctx = PRESETS[preset]
    common = dict(arch=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=hidden // heads, max_position_embeddings=ctx, bos_token_id=1, eos_token_ids=(2,))
    if arch == "llama":  # Llama 3.1 style: GQA, large theta, llama3 rope scaling, untied head
        return ModelConfig(**common, rms_norm_eps=1e-5, rope_theta=500000.0,
                           rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    if arch == "mistral":
        return ModelConfig(**common, rms_norm_eps=1e-5, rope_theta=1000000.0)
    return ModelConfig(**common, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, qkv_bias=True)


def random_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights for every checkpoint key of `cfg`, by HF name."""
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in LlamaRange(cfg, 0, cfg.num_hidden_layers).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name == "model.norm.weight" and cfg.tie_word_embeddings:
            # a tied head scores rows against the embedding itself: a signed, scrambling final norm keeps
            # the current token's own embedding (still in the residual) from always winning
            t = torch.randn(shape, generator=g) * (2.0 / math.sqrt(cfg.hidden_size))
        elif name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=g)
        else:  # projections and lm_head: unit-variance outputs, a little peaked for the head
            gain = 2.0 if name == "lm_head.weight" else 1.0
            t = torch.randn(shape, generator=g) * (gain / math.sqrt(shape[1]))
        state[name] = t.contiguous()
    return state


def write_checkpoint(out_dir: str | Path, cfg: ModelConfig, seed: int = 0, shards: int = 1,
                     dtype: str = "float32") -> Path:
    """Write a complete HF checkpoint directory for `cfg` (weights, config, tokenizer), its weights stored as
    `dtype` (bfloat16 or float16: random_state's values rounded to it, as published checkpoints are stored)."""
    if dtype not in CHECKPOINT_DTYPES:
        raise ValueError(f"dtype: unknown {dtype!r}; choose from {', '.join(CHECKPOINT_DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.to(CHECKPOINT_DTYPES[dtype]) for name, t in random_state(cfg, seed).items()}
    (out / "config.json").write_text(json.dumps({**cfg.to_hf(), "torch_dtype": dtype}, indent=2) + "\n")
    if shards <= 1:
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    else:
        names = sorted(state)
        per = math.ceil(len(names) / shards)
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: state[n] for n in names[i * per:(i + 1) * per]}
            save_file(part, out / fname, metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_tokenizer(out, cfg.vocab_size, cfg.arch)
    return out


def init_model(out_dir: str | Path, preset: str = "tiny", arch: str = "llama", seed: int = 0, shards: int = 1,
               dtype: str = "float32") -> Path:
    """`mesh init-model`: write the named preset's checkpoint to `out_dir`, its weights stored as `dtype`."""
    return write_checkpoint(out_dir, preset_config(preset, arch), seed=seed, shards=shards, dtype=dtype)


def builtin_model(cache_dir: str | Path, preset: str = "tiny", arch: str = "llama", dtype: str = "float32") -> Path:
    """The embedded default model: a preset checkpoint written once under `cache_dir` and reused (stored as
    `dtype`; a bfloat16 one in a directory of its own)."""
    final = Path(cache_dir) / (f"{preset}-{arch}-seed0" + ("" if dtype == "float32" else f"-{dtype}"))
    if (final / "tokenizer_config.json").is_file():
        return final
    tmp = Path(cache_dir) / f".{final.name}.{os.getpid()}"
    init_model(tmp, preset, arch, dtype=dtype)
    try:
        tmp.rename(final)  # atomic: a concurrent writer either wins or finds the finished directory
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
