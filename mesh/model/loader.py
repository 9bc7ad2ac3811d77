"""Load a layer range of a Hugging Face safetensors checkpoint, by name, and nothing more.

The range is built on the meta device; each of its parameters is read from the
memory-mapped checkpoint by its HF name (a stacked projection from the HF
tensors it is made of, `checkpoint_layout`) and assigned in place, so a
half-model station holds about half the weights. `lm_head.weight` falls back to the
embedding when the model ties them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from mesh.config import ModelConfig
from mesh.model.llama import LlamaRange, checkpoint_layout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TIED_HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


class CheckpointError(ValueError):
    """The checkpoint directory is missing files or tensors, or a tensor has the wrong shape."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a load read: the checkpoint keys opened and the bytes they hold once cast."""

    keys_read: tuple[str, ...]
    weight_bytes: int


def checkpoint_index(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name of a checkpoint to the safetensors file holding it."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = {name: d / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index}: names shard {f.name}, which does not exist")
        return files
    single = d / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{d}: neither model.safetensors nor model.safetensors.index.json found")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def load_range(model_dir: str | Path, cfg: ModelConfig, start: int, end: int,
               dtype: str = "float32", device: str = "cpu") -> tuple[LlamaRange, LoadReport]:
    """Build layers [start, end) on meta and assign their tensors from the checkpoint."""
    if dtype not in TORCH_DTYPES:
        raise CheckpointError(f"dtype: unsupported {dtype!r}")
    torch_dtype = TORCH_DTYPES[dtype]
    with torch.device("meta"):
        model = LlamaRange(cfg, start, end)
    files = checkpoint_index(model_dir)
    layout = checkpoint_layout(model)  # parameter -> the checkpoint tensors it is made of
    shapes = {src: shape for parts in layout.values() for src, shape in parts}
    sources = {src: _source_name(src, files, cfg) for src in shapes}  # a tied head reads the embedding
    by_file: dict[Path, list[str]] = {}
    for src, key in sources.items():
        by_file.setdefault(files[key], []).append(src)
    loaded: dict[str, torch.Tensor] = {}  # by checkpoint key
    for path, names in sorted(by_file.items()):
        with safe_open(path, framework="pt", device="cpu") as f:
            for src in names:
                key = sources[src]
                if key in loaded:
                    continue
                t = f.get_tensor(key)
                if tuple(t.shape) != shapes[src]:
                    raise CheckpointError(f"{path.name}: tensor {key} has shape {list(t.shape)}, "
                                          f"expected {list(shapes[src])}")
                if not t.is_floating_point():
                    raise CheckpointError(f"{path.name}: tensor {key} has non-float dtype {t.dtype}")
                loaded[key] = t.to(device=device, dtype=torch_dtype)
    weight_bytes = sum(t.numel() * t.element_size() for t in loaded.values())
    state: dict[str, torch.Tensor] = {}
    for name, parts in layout.items():
        if len(parts) == 1:
            state[name] = loaded[sources[parts[0][0]]]
        else:  # stacked projections: one copy, then the parts go (peak: the model plus one stacked tensor)
            state[name] = torch.cat([loaded.pop(sources[src]) for src, _ in parts])
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = model.inv_freq.to(device)
    model.eval().requires_grad_(False)
    return model, LoadReport(tuple(sorted(set(sources.values()))), weight_bytes)


def _source_name(name: str, files: dict[str, Path], cfg: ModelConfig) -> str:
    if name in files:
        return name
    if name == TIED_HEAD and cfg.tie_word_embeddings and EMBED in files:
        return EMBED
    raise CheckpointError(f"checkpoint is missing tensor {name!r}")
