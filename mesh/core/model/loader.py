"""Load a layer range of a Hugging Face safetensors checkpoint (or a GGUF file), by name, and nothing more.

The range is built on the meta device; each of its parameters is read from the
memory-mapped checkpoint by its HF name and assigned in place, so a half-model
station holds about half the weights. `lm_head.weight` falls back to the
embedding when the model ties them. A `.gguf` file is read the same way, through
mesh.core.model.gguf_file (HF names, dequantized to the station's dtype).
"""
from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from mesh.core.config import ModelConfig
from mesh.core.model.gguf_file import GGUFCheckpoint, is_gguf
from mesh.core.model.llama import Linear, LlamaRange
from mesh.core.model.quant_linear import KERNEL_CODES, QuantEmbedding, QuantRows
from mesh.core.torch_dtypes import TORCH_DTYPES

TIED_HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"
NARROW_DTYPES = (torch.bfloat16, torch.float16)  # a file's matrix types the packed tiles hold as they are


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


def load_range(model_dir: str | Path, cfg: ModelConfig, start: int, end: int, dtype: str = "float32",
               device: str = "cpu", for_packed: bool = False) -> tuple[LlamaRange, LoadReport]:
    """Build layers [start, end) on meta and assign their tensors from the checkpoint.

    `for_packed` (float32 on CPU, for the packed backend, which repacks every Linear's weight:
    kernels.use_packed_linears): the Linears' matrices stay in the file's form where the packed kernels read it. A
    GGUF's Q8_0 / Q4_0 / Q4_1 matrices stay as the file's blocks, the Linears' `quant_rows` (their weights stay on
    meta until they are repacked) and the embedding a QuantEmbedding, which dequantizes the rows it looks up; a
    matrix stored in bfloat16 or float16 (a safetensors tensor, a GGUF's BF16 / F16) stays in that type (packed as
    such, every value exactly the float32 it would have been cast to), not cast to float32 first. Everything else is
    cast to `dtype`."""
    if dtype not in TORCH_DTYPES:
        raise CheckpointError(f"dtype: unsupported {dtype!r}")
    torch_dtype = TORCH_DTYPES[dtype]
    with torch.device("meta"):
        model = LlamaRange(cfg, start, end)
    wanted = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    quant: dict[str, QuantRows] = {}
    keep = for_packed and torch_dtype == torch.float32 and device == "cpu"
    matrices = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Linear)} if keep else set()
    if is_gguf(model_dir):
        state, read = _read_gguf(model_dir, cfg, wanted, torch_dtype, device, quant if keep else None, matrices)
    else:
        state, read = _read_safetensors(model_dir, cfg, wanted, torch_dtype, device, matrices)
    result = model.load_state_dict(state, strict=not quant, assign=True)  # weights kept quantized stay on meta
    if quant and (result.unexpected_keys or set(result.missing_keys) != set(quant)):
        raise CheckpointError(f"{model_dir}: the tensors read do not cover the layers' parameters "
                              f"(missing {sorted(set(result.missing_keys) - set(quant))[:4]}, "
                              f"unexpected {result.unexpected_keys[:4]})")
    modules = dict(model.named_modules()) if quant else {}  # one walk: get_submodule per weight cost ~1 ms a load
    for name, rows in quant.items():
        owner = modules[name.rsplit(".", 1)[0]]
        if isinstance(owner, nn.Embedding):
            model.model.embed_tokens = QuantEmbedding(rows)
        else:
            owner.quant_rows = (rows,)
    model.inv_freq = model.inv_freq.to(device)
    model.eval().requires_grad_(False)
    return model, LoadReport(tuple(sorted(read)), sum(read.values()))


def _read_safetensors(model_dir: str | Path, cfg: ModelConfig, wanted: dict[str, tuple[int, ...]],
                      torch_dtype: torch.dtype, device: str, keep_narrow: set[str] = frozenset()
                      ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The wanted tensors (by parameter name) and the bytes of each checkpoint tensor read, once cast (by source
    name); those named in `keep_narrow` stay bfloat16 / float16 where the file holds them so (a tied head shares
    the embedding's cast tensor)."""
    files = checkpoint_index(model_dir)
    sources = {name: _source_name(name, files, cfg) for name in wanted}
    by_file: dict[Path, list[str]] = {}
    for name, src in sources.items():
        by_file.setdefault(files[src], []).append(name)
    state: dict[str, torch.Tensor] = {}
    loaded: dict[str, torch.Tensor] = {}  # by source name: a tied head shares the embedding's storage
    for path, names in sorted(by_file.items()):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in names:
                if sources[name] in loaded:
                    state[name] = loaded[sources[name]]
                    continue
                t = f.get_tensor(sources[name])
                if tuple(t.shape) != wanted[name]:
                    raise CheckpointError(f"{path.name}: tensor {sources[name]} has shape {list(t.shape)}, "
                                          f"expected {list(wanted[name])}")
                if not t.is_floating_point():
                    raise CheckpointError(f"{path.name}: tensor {sources[name]} has non-float dtype {t.dtype}")
                narrow = name in keep_narrow and sources[name] != EMBED and t.dtype in NARROW_DTYPES
                state[name] = loaded[sources[name]] = t.to(device=device, dtype=t.dtype if narrow else torch_dtype)
    return state, {src: t.numel() * t.element_size() for src, t in loaded.items()}


def _read_gguf(path: str | Path, cfg: ModelConfig, wanted: dict[str, tuple[int, ...]], torch_dtype: torch.dtype,
               device: str, quant: dict[str, QuantRows] | None, keep_narrow: set[str] = frozenset()
               ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """As _read_safetensors, from a GGUF file: only the wanted tensors are dequantized (mesh.core.model.gguf_file).
    With `quant`, the matrices quant_linear holds are not: their blocks go into `quant` by parameter name (not into
    the state: their parameters stay on meta) and count with the bytes they hold in the file; those named in
    `keep_narrow` stay float16 / bfloat16 where the file stores them F16 / BF16."""
    ckpt = GGUFCheckpoint(path)  # refuses an unsupported architecture or tensor type before any read
    state: dict[str, torch.Tensor] = {}
    loaded: dict[str, torch.Tensor] = {}
    read: dict[str, int] = {}
    for name, shape in wanted.items():
        src = _source_name(name, ckpt.tensors, cfg)
        if src not in loaded and ckpt.shape(src) != shape:
            raise CheckpointError(f"{ckpt.path.name}: tensor {src} has shape {list(ckpt.shape(src))}, "
                                  f"expected {list(shape)}")
        qtype, raw = ckpt.blocks(src)
        if quant is not None and len(shape) == 2 and qtype in KERNEL_CODES:
            quant[name] = QuantRows(f"{ckpt.path.name}: tensor {src}", qtype, raw, shape[1], ckpt.row_order(src))
            read[src] = raw.nbytes  # nothing read yet: the blocks stay memory-mapped
            continue
        if src not in loaded:
            narrow = ckpt.read_narrow(src) if name in keep_narrow and src != EMBED else None
            if narrow is None:
                loaded[src] = torch.from_numpy(ckpt.read(src)).to(device=device, dtype=torch_dtype)  # HF layout
            else:  # float16, or bfloat16's bits as int16, maybe the file's read-only mapping: only ever read (packed)
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
                    kept = torch.from_numpy(narrow)
                loaded[src] = kept.view(torch.bfloat16 if narrow.dtype == np.int16 else torch.float16)
            read[src] = loaded[src].numel() * loaded[src].element_size()
        state[name] = loaded[src]
    return state, read


def _source_name(name: str, files: Mapping[str, object], cfg: ModelConfig) -> str:
    if name in files:
        return name
    if name == TIED_HEAD and cfg.tie_word_embeddings and EMBED in files:
        return EMBED
    raise CheckpointError(f"checkpoint is missing tensor {name!r}")
