"""The packed float32 CPU path: the tile layout, its kernel call, and the set-up that moves a model onto it.

`packed_linear` (C in csrc/packed_linear.c, built by mesh.core.model.native) is row-count invariant by
construction and reads the weights at memory speed: each output is one fused multiply-add chain over k in a fixed
order, threads split only the output features, and the weight is packed once into tiles of 64 output features so
one call streams it once whatever the row count. `use_packed_linears` packs every Linear of a model (GGUF blocks the
loader kept go to mesh.core.model.quant_linear's layout instead) into one host_memory.WeightArena, q/k/v and
gate/up fused into one weight each. A weight whose every value bfloat16 (or else float16) holds exactly (a bfloat16
or float16 checkpoint's, read as float32) is packed in that type: half the bytes to hold and to stream each call,
and the same bits, since the kernel widens each weight back to the float32 it was before multiplying.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from mesh.core.model.llama import MLP, Attention, Linear
from mesh.core.model.quant_linear import QuantRows, linear_operands, quant_linear, repack, repacked_bytes
from mesh.core.model.host_memory import WeightArena, aligned, tensor_bytes
from mesh.core.model.packed_cache import PackedCache

PACK_TILE = 64  # output features per packed tile (csrc/packed_linear.c: TILE_N)
FUSED_PROJECTIONS = ((Attention, ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                     (MLP, ("gate_proj", "up_proj"), "gate_up_proj"))  # module type, its parts, the fused Linear
WeightParts = tuple[torch.Tensor, ...] | tuple[QuantRows, ...]  # one weight's rows, part after part


# what a packed tile holds (the narrow types: values they hold exactly), as csrc/register_tile.h's WeightFormat
PACKED_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
PACKED_DTYPES = tuple(PACKED_FORMATS)
SAMPLE_VALUES = 4096  # a weight's first values, checked before all of them: a float32 weight fails there at once


def _bfloat16_bits(w: torch.Tensor) -> bool:
    """w (flat float32): every value's low 16 bits zero (x86 is little-endian: the even int16 halves)."""
    return not bool(w.view(torch.int16)[0::2].any())


def _float16_bits(w: torch.Tensor) -> bool:
    """w (flat float32): every value comes back from float16 with the same bits."""
    return torch.equal(w.half().float().view(torch.int32), w.view(torch.int32))


NARROW_HOLDS = {torch.bfloat16: _bfloat16_bits, torch.float16: _float16_bits}  # in the order narrowest_exact tries


def exact_in(w: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every value of `w` (float32, bfloat16 or float16) is one of `dtype` (bfloat16 or float16): packing it so
    loses nothing. A weight of that type is, without a look (the loader keeps a file's narrow matrices so)."""
    if w.dtype == dtype:
        return True
    if w.dtype not in PACKED_DTYPES:
        return False
    flat = w.contiguous().view(-1)
    if w.dtype != torch.float32:  # the other narrow type: widened (exactly), then checked
        flat = flat.float()
    holds = NARROW_HOLDS[dtype]
    return holds(flat[:SAMPLE_VALUES]) and holds(flat)


def narrowest_exact(parts: Sequence[torch.Tensor]) -> torch.dtype:
    """The packed tile type for these parts (float32, or a file's bfloat16 / float16 kept as such): bfloat16 or
    float16 where every value is exactly one's (bfloat16 first: its widening needs no conversion unit), else
    float32."""
    for dtype in NARROW_HOLDS:
        if all(exact_in(p, dtype) for p in parts):
            return dtype
    return torch.float32


def pack_rows(parts: Sequence[torch.Tensor], out: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float32, checked: bool = False) -> torch.Tensor:
    """The parts' rows one after another, [N, K] in all (float32, bfloat16 or float16) -> packed [ceil(N/64), K, 64]
    of `dtype` (out's where given: float32, or bfloat16 / float16 for values it holds exactly, checked unless
    `checked` says the caller did; in a bfloat16 tile each 64-byte line of 32 columns interleaved, position 2i column
    i and 2i + 1 column 16 + i, as csrc/register_tile.h reads it), the features past N zero; written into `out` where
    given. A part's whole tiles are copied at once, no concatenated copy made (a bfloat16 weight goes through one
    bfloat16 copy in column order)."""
    k, n = parts[0].shape[1], sum(p.shape[0] for p in parts)
    tiles = -(-n // PACK_TILE)
    if out is None:
        out = torch.empty(tiles, k, PACK_TILE, dtype=dtype)
    if out.shape != (tiles, k, PACK_TILE) or out.dtype not in PACKED_DTYPES or not out.is_contiguous():
        raise ValueError(f"pack_rows: out must be contiguous float32, bfloat16 or float16 [{tiles}, {k}, {PACK_TILE}]")
    if out.dtype != torch.float32 and not checked:
        if not all(exact_in(p, out.dtype) for p in parts):
            raise ValueError(f"pack_rows: a {out.dtype} tile takes only weights whose values {out.dtype} holds "
                             "exactly")
    ordered = out if out.dtype != torch.bfloat16 else torch.empty_like(out)  # the columns in order
    row = 0  # the fused weight's row where the part starts
    for part in parts:
        done = 0
        while done < part.shape[0]:
            tile, col = divmod(row + done, PACK_TILE)
            whole = (part.shape[0] - done) // PACK_TILE if col == 0 else 0
            if whole:  # whole tiles: [m, 64, K] rows -> [m, K, 64]
                rows = part[done:done + whole * PACK_TILE].reshape(whole, PACK_TILE, k)
                ordered[tile:tile + whole].copy_(rows.transpose(1, 2))
                done += whole * PACK_TILE
            else:  # the rows that share a tile with the part before or after
                take = min(PACK_TILE - col, part.shape[0] - done)
                ordered[tile, :, col:col + take].copy_(part[done:done + take].T)
                done += take
        row += part.shape[0]
    if n % PACK_TILE:
        ordered[-1, :, n % PACK_TILE:].zero_()
    if ordered is not out:  # the interleave in one strided pass: (line, i, half) <- (line, half, i)
        out.view(tiles, k, PACK_TILE // 32, 16, 2).copy_(
            ordered.view(tiles, k, PACK_TILE // 32, 2, 16).transpose(3, 4))
    return out


def pad_bias(b: torch.Tensor) -> torch.Tensor:
    """b [N] -> [ceil(N/64) * 64], zero past N (the packed kernel reads whole tiles)."""
    out = torch.zeros(-(-b.shape[0] // PACK_TILE) * PACK_TILE, dtype=b.dtype)
    out[: b.shape[0]] = b
    return out


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, n: int) -> torch.Tensor:
    """x [T, K] float32 @ packed w [tiles, K, 64] float32, bfloat16 or float16 (+ padded b) -> [T, n] through
    csrc/packed_linear.c (the same bits whichever for the same values)."""
    lib, x, out = linear_operands(x, n)
    t, k = x.shape
    lib.packed_linear_any(x.data_ptr(), t, x.stride(0), k, w.data_ptr(), PACKED_FORMATS[w.dtype], n,
                          None if b is None else b.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def _weight_parts(linears: Sequence[Linear]) -> WeightParts | None:
    """The rows the Linears' one packed weight is made of: their GGUF blocks (loader-kept) or their dense weights;
    None where they cannot share one (some kept quantized and some not, or of different types)."""
    quant = [q for lin in linears for q in (lin.quant_rows or ())]
    if not quant:
        return tuple(lin.weight.detach() for lin in linears)
    if any(lin.quant_rows is None for lin in linears) or len({q.qtype for q in quant}) > 1:
        return None
    return tuple(quant)


def _packed_shape(parts: WeightParts) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype of the parts' packed weight (narrowest_exact: bfloat16 or float16 where every value is
    exactly one's)."""
    if isinstance(parts[0], QuantRows):
        return (repacked_bytes(parts),), torch.uint8
    return (-(-sum(p.shape[0] for p in parts) // PACK_TILE), parts[0].shape[1], PACK_TILE), narrowest_exact(parts)


def _fill(parts: WeightParts, out: torch.Tensor) -> torch.Tensor:
    """The parts packed into `out`: quant_linear's tiles for GGUF blocks, else packed_linear's float32, bfloat16 or
    float16 tiles (out's dtype, which _packed_shape chose by checking every value)."""
    return repack(parts, out) if isinstance(parts[0], QuantRows) else pack_rows(parts, out, checked=True)


def _point(linear: Linear, parts: WeightParts, weight: torch.Tensor) -> None:
    """Move `linear` onto the packed path with `weight`, the parts packed (`_fill`); weight_layout says which."""
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if isinstance(parts[0], QuantRows):
        linear.kernel = partial(quant_linear, n=linear.out_features, qtype=parts[0].qtype)
        linear.weight_layout = parts[0].qtype.name.lower()
    else:
        linear.kernel = partial(packed_linear, n=linear.out_features)
        linear.weight_layout = "packed"
    linear.quant_rows = None
    if linear.bias is not None:
        linear.bias = nn.Parameter(pad_bias(linear.bias.detach()), requires_grad=False)


def _fused_linear(parts: Sequence[Linear]) -> Linear:
    """One Linear, its weight on meta, computing the parts' outputs side by side (a part without a bias gets zeros:
    x + 0 is x): nn.Linear's set-up without its random initialization."""
    fused = Linear.__new__(Linear)
    nn.Module.__init__(fused)
    fused.in_features, fused.out_features = parts[0].in_features, sum(p.out_features for p in parts)
    fused.weight = nn.Parameter(torch.empty(fused.out_features, fused.in_features, device="meta"),
                                requires_grad=False)
    fused.register_parameter("bias", None)
    if any(p.bias is not None for p in parts):
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() if p.bias is not None else torch.zeros(p.out_features)
                                             for p in parts]), requires_grad=False)
    return fused


def _drop_weights(linear: Linear) -> None:
    """Free a Linear whose work a fused one took over (its shapes stay for the split)."""
    if linear.weight.device.type != "meta":  # one kept quantized holds a meta weight already
        linear.weight = nn.Parameter(torch.empty(linear.weight.shape, device="meta"), requires_grad=False)
    linear.quant_rows = None
    if linear.bias is not None:
        linear.bias = nn.Parameter(torch.empty(linear.bias.shape, device="meta"), requires_grad=False)


def _cache_group(name: str) -> str:
    """The cache entry a module's packed weight goes in: its layer ("layer12") or, outside the layers, its name."""
    match = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", name)
    return f"layer{match.group(1)}" if match else name.replace(".", "_")


@dataclass(frozen=True, slots=True)
class PackedLoad:
    """Where a model's packed weights came from, by cache group (layer12, lm_head): mapped from the packed cache or
    packed at this load."""

    mapped: tuple[str, ...] = ()
    packed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class _PackJob:
    """One packed weight to make: the rows of `linears` (one Linear, or the parts the fused Linear
    `owner`.`fused_attr` replaces) and the cache group it belongs to."""

    group: str
    linears: tuple[Linear, ...]
    parts: WeightParts
    owner: nn.Module | None = None
    fused_attr: str = ""


def _pack_jobs(model: nn.Module) -> list[_PackJob]:
    """The packed weights `model` needs, in module order, nothing changed yet: q/k/v and gate/up as one weight each
    where their rows can share one, then every other Linear holding a weight (or blocks the loader kept)."""
    jobs: list[_PackJob] = []
    fused: set[int] = set()  # ids of the Linears a fused weight takes over
    for name, module in model.named_modules():  # a module comes before its parts
        if isinstance(module, Linear):
            if id(module) not in fused and module.kernel is None and (
                    module.weight.device.type != "meta" or module.quant_rows is not None):
                jobs.append(_PackJob(_cache_group(name), (module,), _weight_parts([module])))
            continue
        for kind, names, attr in FUSED_PROJECTIONS:
            if isinstance(module, kind):
                linears = tuple(getattr(module, part) for part in names)
                if (parts := _weight_parts(linears)) is not None:
                    jobs.append(_PackJob(_cache_group(name), linears, parts, module, attr))
                    fused.update(map(id, linears))
    return jobs


def _fused(job: _PackJob) -> Linear:
    """The fused Linear of `job`, set on its owner in place of the parts (which keep only their shapes)."""
    linear = _fused_linear(job.linears)
    setattr(job.owner, job.fused_attr, linear)
    for part in job.linears:
        _drop_weights(part)
    return linear


def use_packed_linears(model: nn.Module, cache: PackedCache | None = None, huge_pages: bool = True) -> PackedLoad:
    """Point every Linear of `model` at packed_linear (or quant_linear, for weights the loader kept quantized), its
    weight replaced by the packed copy in one WeightArena (a weight shared with the embedding is copied: the
    embedding keeps reading the dense one). q/k/v and gate/up run as one fused packed Linear each (one weight
    stream, one call); their own modules keep only their shapes.

    With `cache` (a GGUF's mesh.core.model.packed_cache), a layer whose packed weights are cached is mapped from
    there instead, and the layers packed here are stored on a thread (packed_cache.wait_for_stores waits for it).
    Answers which groups were mapped and which packed."""
    jobs = _pack_jobs(model)
    groups: dict[str, list[int]] = {}  # the jobs of each cache group, in order
    for i, job in enumerate(jobs):
        groups.setdefault(job.group, []).append(i)
    shapes = [_packed_shape(job.parts) for job in jobs]
    weights: list[torch.Tensor | None] = [None] * len(jobs)
    for group, idx in groups.items():
        cached = cache.load(group, [shapes[i] for i in idx]) if cache is not None else None
        for i, w in zip(idx, cached or ()):
            weights[i] = w
    packed = [group for group, idx in groups.items() if weights[idx[0]] is None]  # the groups not in the cache
    to_pack = [i for group in packed for i in groups[group]]
    # the arena first: its pages fault in on another thread while the modules are rewired, then filled
    arena = WeightArena(sum(aligned(tensor_bytes(*shapes[i])) for i in to_pack), huge_pages)
    try:
        for i in to_pack:
            weights[i] = arena.take(*shapes[i])
        for job, weight in zip(jobs, weights):
            _point(_fused(job) if job.owner is not None else job.linears[0], job.parts, weight)
        for i in to_pack:
            _fill(jobs[i].parts, weights[i])
    finally:
        arena.close()
    if cache is not None and packed:
        cache.store_in_background({group: [weights[i] for i in groups[group]] for group in packed})
    return PackedLoad(tuple(g for g in groups if g not in packed), tuple(packed))
