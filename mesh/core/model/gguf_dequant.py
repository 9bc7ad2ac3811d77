"""GGUF tensor bytes to float32, bit for bit as the `gguf` package computes them, faster for the common types.

The `gguf` package dequantizes with whole-array numpy steps, but for 4-bit blocks each step (split,
shift, mask, cast, multiply, add) makes a new full-size array. Here Q4_0 and Q4_1 write each byte's two
nibbles as float32 straight into the output, then scale and offset it in place; Q8_0 casts and scales
in one multiply. The arithmetic is the package's (float32 product, then float32 sum), so the
weights equal what transformers loads from the same file. Every other type goes to the package.
No torch here.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}  # one block: 32 weights and their fp16 scale (and min)


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as a float32 column [n, 1]."""
    return blocks.view(np.float16)[:, start // 2:start // 2 + 1].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes to [n, 32] float32: the low nibbles, then the high ones (each cast as it is written)."""
    out = np.empty((qs.shape[0], 32), np.float32)
    np.bitwise_and(qs, 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, 16:], casting="unsafe")
    return out


def dequantize_f32(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """Tensor bytes `raw` (rows of blocks, as GGUFHeader.tensor_bytes gives them) as a new float32 array."""
    if qtype not in _BLOCK_BYTES:
        w = dequantize(raw, qtype)
        return np.array(w, dtype=np.float32) if not w.flags.writeable or w.dtype != np.float32 else w
    blocks = np.ascontiguousarray(raw).reshape(-1, _BLOCK_BYTES[qtype])
    d = _fp16(blocks, 0)
    if qtype == Q.Q8_0:
        out = np.multiply(blocks[:, 2:].view(np.int8), d, dtype=np.float32)
    elif qtype == Q.Q4_0:
        out = _nibbles(blocks[:, 2:])
        out -= np.float32(8.0)
        out *= d
    else:  # Q4_1: scale, then the block's minimum
        out = _nibbles(blocks[:, 4:])
        out *= d
        out += _fp16(blocks, 2)
    return out.reshape(*raw.shape[:-1], -1)
