"""Linear weights kept in GGUF's quantized blocks on the station's packed float32 CPU path.

A station loading a GGUF with the packed backend keeps its Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K, IQ4_NL and
IQ4_XS linear weights as they are in the file: `QuantRows` names a weight's rows of blocks (memory-mapped, nothing
read), `repack` lays them out once for csrc/quant_linear.c (a byte transpose into tiles of 64 output rows, the
float16 scales gathered beside them; the K-quants, Q5_1 and the IQ4s as groups of 32 with their exact float32 scales,
mesh.core.model.quant_kblocks; Q5_0 as the Q8_0 blocks of the same weights), and `quant_linear` computes x W^T from
that layout, dequantizing in registers. Each weight dequantizes to exactly
the float32 the `gguf` package (and mesh.core.model.gguf_dequant) gives it, and each output is the fused
multiply-add chain of the packed float32 kernel, so the station's bits are those of a station holding the
dequantized weights in packed tiles: the same tokens as transformers loading the GGUF, at every batch and thread
count. `QuantEmbedding` is the matching token embedding: it dequantizes only the rows a wave looks up.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from torch import nn

from mesh.core.model.gguf_dequant import dequantize_f32
from mesh.core.model.native import load_native
from mesh.core.model.quant_kblocks import FACTORED, groups_bytes, q5_0_as_q8_0, repack_k

# the types quant_linear.c holds, by its enum (csrc/quant_blocks.h): Q5_0 runs as the Q8_0 of its bytes q - 16,
# Q5_1 and Q5_K as Q5_KF, Q3_K as Q6_KF, Q2_K as Q2_KF, IQ4_NL and IQ4_XS as IQ4F, the lower i-quants as Q6_KF
KERNEL_CODES = {Q.Q8_0: 0, Q.Q4_0: 1, Q.Q4_1: 2, Q.Q4_K: 3, Q.Q6_K: 4, Q.Q5_K: 5, Q.Q5_1: 5, Q.Q5_0: 0,
                Q.Q3_K: 4, Q.Q2_K: 6, Q.IQ4_NL: 7, Q.IQ4_XS: 7, **{q: 4 for q in FACTORED}}
# laid out in Python (quant_kblocks), the rest by csrc/quant_repack.c
PY_LAYOUT = (Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q5_1, Q.Q3_K, Q.Q2_K, Q.IQ4_NL, Q.IQ4_XS, *FACTORED)
GROUP_WEIGHTS = 32  # k per group of the layout, every type
BLOCK_WEIGHTS = {q: GGML_QUANT_SIZES[q][0] for q in KERNEL_CODES}  # weights per block in the file
BLOCK_BYTES = {q: GGML_QUANT_SIZES[q][1] for q in KERNEL_CODES}  # its float16 scale(s) and quants
TILE_ROWS = 64
REPACK_THREADS = 1  # a byte transpose, ~4 G weights/s on one core; a second thread's wake-up costs more where busy
GROUP_BYTES = {Q.Q8_0: 64 * 2 + 32 * 64, Q.Q5_0: 64 * 2 + 32 * 64, Q.Q4_0: 64 * 2 + 16 * 64,
               Q.Q4_1: 64 * 4 + 16 * 64, **{q: groups_bytes(q) for q in PY_LAYOUT}}  # one tile's group


class QuantFormatError(ValueError):
    """A quantized tensor whose bytes do not hold its shape in its type's blocks."""


@dataclass(frozen=True, slots=True, eq=False)
class QuantRows:
    """One linear weight [out_features, in_features] as GGUF blocks: `raw` [rows, in_features / 32 * block bytes]
    uint8, and `order` (int64 [out_features]: HF row r is raw row order[r]) or None when stored in HF order."""

    name: str
    qtype: Q
    raw: np.ndarray
    in_features: int
    order: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.qtype not in KERNEL_CODES:
            raise QuantFormatError(f"{self.name}: type {self.qtype.name} is not one the quantized kernel holds "
                                   f"({', '.join(q.name for q in KERNEL_CODES)})")
        block = BLOCK_WEIGHTS[self.qtype]
        want = self.in_features // block * BLOCK_BYTES[self.qtype]
        if (self.in_features % block or self.raw.dtype != np.uint8 or self.raw.ndim != 2
                or self.raw.shape[1] != want):
            raise QuantFormatError(
                f"{self.name}: {self.qtype.name} rows of {list(self.raw.shape[1:])} {self.raw.dtype} do not hold "
                f"{self.in_features} weights in blocks of {block} ({BLOCK_BYTES[self.qtype]} bytes each)")
        if self.order is not None and (self.order.dtype != np.int64 or self.order.ndim != 1 or len(self.order) == 0
                                       or self.order.min() < 0 or self.order.max() >= self.raw.shape[0]):
            raise QuantFormatError(f"{self.name}: row order is not int64 row indices of its {self.raw.shape[0]} rows")

    @property
    def out_features(self) -> int:
        """The weight's output rows."""
        return self.raw.shape[0] if self.order is None else len(self.order)


def repacked_bytes(parts: Sequence[QuantRows]) -> int:
    """The bytes `repack(parts)` fills: whole tiles of 64 rows, each K / 32 groups."""
    tiles = -(-sum(p.out_features for p in parts) // TILE_ROWS)
    return tiles * (parts[0].in_features // GROUP_WEIGHTS) * GROUP_BYTES[parts[0].qtype]


def repack(parts: Sequence[QuantRows], out: torch.Tensor | None = None) -> torch.Tensor:
    """The parts' rows one after another (all one type and width) in quant_linear.c's tile layout: uint8
    [repacked_bytes(parts)], written into `out` where given (a host_memory.WeightArena's)."""
    qtype, k = parts[0].qtype, parts[0].in_features
    if any(p.qtype != qtype or p.in_features != k for p in parts):
        raise QuantFormatError(f"{', '.join(p.name for p in parts)}: parts of one weight differ in type or width")
    nbytes = repacked_bytes(parts)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.shape != (nbytes,) or not out.is_contiguous():
        raise ValueError(f"repack: out must be contiguous uint8 [{nbytes}], got {out.dtype} {list(out.shape)}")
    if qtype in PY_LAYOUT:
        try:
            repack_k([(p.raw, p.order) for p in parts], qtype, out.numpy())
        except ValueError as err:  # blocks whose weights the layout cannot hold exactly (a corrupt scale)
            raise QuantFormatError(f"{', '.join(p.name for p in parts)}: {err}") from None
        return out
    lib, why = load_native()
    if lib is None:
        raise RuntimeError(why)
    raws = [q5_0_as_q8_0(p.raw) if qtype == Q.Q5_0 else np.ascontiguousarray(p.raw) for p in parts]
    orders = [None if p.order is None else np.ascontiguousarray(p.order) for p in parts]
    n = len(parts)
    lib.quant_repack((ctypes.c_void_p * n)(*(r.ctypes.data for r in raws)),
                     (ctypes.c_int64 * n)(*(p.out_features for p in parts)),
                     (ctypes.c_void_p * n)(*(None if o is None else o.ctypes.data for o in orders)),
                     n, k, KERNEL_CODES[qtype], out.data_ptr(), REPACK_THREADS)
    return out


def linear_operands(x: torch.Tensor, n: int) -> tuple[ctypes.CDLL, torch.Tensor, torch.Tensor]:
    """For a native linear of n outputs: (the library, x [T, K] with unit column stride, the output [T, n])."""
    lib, why = load_native()
    if lib is None:
        raise RuntimeError(why)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return lib, x, torch.empty(x.shape[0], n, dtype=torch.float32)


def quant_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, n: int, qtype: Q) -> torch.Tensor:
    """x [T, K] float32 @ the repacked w (`repack`) of n rows (+ b padded to whole tiles) -> [T, n]."""
    lib, x, out = linear_operands(x, n)
    t, k = x.shape
    lib.quant_linear_f32(x.data_ptr(), t, x.stride(0), k, w.data_ptr(), KERNEL_CODES[qtype], n,
                         None if b is None else b.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


class QuantEmbedding(nn.Module):
    """A token embedding kept as GGUF blocks: a lookup dequantizes only its rows (the float32 of the dense one)."""

    def __init__(self, rows: QuantRows) -> None:
        super().__init__()
        self.rows = rows
        self.num_embeddings, self.embedding_dim = rows.out_features, rows.in_features

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] -> [T, d] float32."""
        ids = token_ids.cpu().numpy()
        if self.rows.order is not None:
            ids = self.rows.order[ids]
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token id outside the vocabulary of {self.num_embeddings}")
        return torch.from_numpy(dequantize_f32(self.rows.raw[ids], self.rows.qtype).reshape(len(ids), -1))
