"""GGUF's K-quants and 5-bit blocks laid out for csrc/quant_linear.c (no torch).

A K-quant super-block holds 256 weights: Q4_K eight sub-blocks of 32, each a 6-bit scale and minimum under the
block's float16 d and dmin, 4-bit quants; Q6_K sixteen sub-blocks of 16, each an int8 scale under the block's d,
6-bit quants. The gguf package (and so transformers) dequantizes them in float32 as

    Q4_K: w = (d * sc) * q - dmin * m        Q6_K: w = (d * sc) * (q - 32)

where d * sc and dmin * m are exact (an 11-bit float16 significand times a 6- or 8-bit integer) and so is
(d * sc) * q for Q4_K's 4-bit q: one rounding each. Here each group of 32 k gets those exact products as float32
(csrc/quant_blocks.h's Q4_KF: the scale and the negated minimum, w = q * D + M in one fused multiply-add; Q6_KF: the
scales of its two sub-blocks, w = (q - 32) * D), so the kernel computes the package's float32 of every weight and
the station keeps the bits of one holding the dequantized weights. Q5_K is Q4_K with a fifth bit (its q * D is
exact too) and Q5_1 is d * q + m with a 5-bit q: both become Q5_KF, unsigned bytes with a float32 scale and
minimum. Q3_K, sixteen sub-blocks of 16 with 6-bit scales and 3-bit quants, w = (d * (sc - 32)) * q with q in -4..3
(both products exact), is a Q6_KF group of signed bytes q under its two sub-blocks' scales; Q2_K, sixteen sub-blocks
of 16 with 4-bit scales and minimums and 2-bit quants, w = (d * sc) * q - dmin * m, a Q2_KF group: Q4_KF's nibbles
with a scale and a negated minimum for each sub-block (four float32 vectors, `VECTORS`). IQ4_NL (blocks of 32,
w = d * value[q] with 16 fixed values of at most 7 bits) and IQ4_XS (super-blocks of 256, a 6-bit scale per 32,
w = (d * (ls - 32)) * value[q], at most 23 significant bits) are IQ4F groups: one float32 scale, then the nibbles
as Q4_1's, which the kernel looks up. Q5_0, (q - 16) * d, is exactly a Q8_0 block of the bytes q - 16
(`q5_0_as_q8_0`). The layout is
quant_blocks.h's: tiles of 64 output rows, each group the 64 rows' float32 scales, minimums or second scales, then
the quants transposed [byte row][64 rows] (Q4_KF as Q4_1 keeps them: byte b holds k = b low and k = b + 16 high;
Q6_KF signed bytes, Q5_KF unsigned ones).
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from mesh.core.model.gguf_dequant import dequantize_f32

# the i-quants below IQ4, whose weights are a scale per 16 times grid values (small integers, signs, IQ1's eighths):
# held as Q6_KF groups of signed bytes, factored out of the package's float32 (`_factored`)
FACTORED = (Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S)
SUPER_BYTES = {q: GGML_QUANT_SIZES[q][1] for q in (Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q3_K, Q.Q2_K, Q.IQ4_XS, *FACTORED)}
GROUP, TILE = 32, 64
QUANT_ROWS = {Q.Q4_K: 16, Q.Q6_K: 32, Q.Q5_K: 32, Q.Q5_1: 32, Q.Q3_K: 32, Q.Q2_K: 16, Q.IQ4_NL: 16,
              Q.IQ4_XS: 16, **{q: 32 for q in FACTORED}}  # byte rows of a group's quants
VECTORS = {Q.Q2_K: 4, Q.IQ4_NL: 1, Q.IQ4_XS: 1}  # float32 vectors of 64 ahead of a group's quants (else 2)
# one 32-weight block's bytes (IQ4_NL: a float16 d, 16 bytes of nibbles)
IQ4_NL_BYTES, Q5_1_BYTES, Q5_0_BYTES, Q8_0_BYTES = (GGML_QUANT_SIZES[q][1] for q in (Q.IQ4_NL, Q.Q5_1, Q.Q5_0, Q.Q8_0))


def _half(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 (little-endian float16) -> [...] float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of Q4_K super-blocks -> (scales D, minimums M [rows, groups] float32, quant bytes [rows, groups, 16])."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, SUPER_BYTES[Q.Q4_K])
    scale, minimum = _scale_min(b)  # [rows, supers, 8] exact; the minimum negated: w = q * D + M
    qs = b[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    q = (qs & 0x0F).reshape(rows, -1, GROUP)  # [rows, groups, 32] in k order: sub-block 2c low, 2c + 1 high
    quants = q[..., :16] | (q[..., 16:] << 4)  # as Q4_1 holds a group: byte b = k b low, k b + 16 high
    return scale.reshape(rows, -1), minimum.reshape(rows, -1), quants


def _scale_min(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks [rows, supers, bytes] -> their sub-blocks' exact scales d * sc and negated minimums
    -(dmin * m), float32 [rows, supers, 8]."""
    rows = b.shape[0]
    d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])  # [rows, supers]
    s = b[..., 4:16].reshape(rows, -1, 3, 4)  # the 12 bytes of 6-bit scales and minimums
    sc = np.concatenate([s[..., 0, :] & 0x3F, (s[..., 2, :] & 0x0F) | ((s[..., 0, :] >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([s[..., 1, :] & 0x3F, (s[..., 2, :] >> 4) | ((s[..., 1, :] >> 2) & 0x30)], axis=-1)
    return d[..., None] * sc.astype(np.float32), -(dmin[..., None] * mn.astype(np.float32))


def _q5_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of Q5_K super-blocks -> (scales D, minimums M [rows, groups] float32, quant bytes 0..31
    [rows, groups, 32])."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, SUPER_BYTES[Q.Q5_K])
    scale, minimum = _scale_min(b)
    low = (b[..., 48:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    high = (b[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 0x01
    q = low.reshape(rows, -1, GROUP) | (high.reshape(rows, -1, GROUP) << 4)
    return scale.reshape(rows, -1), minimum.reshape(rows, -1), q


def _fifth_bits(b: np.ndarray, at: int) -> np.ndarray:
    """A Q5_0 / Q5_1 block's [rows, blocks, bytes] 5-bit quants (the nibbles from byte `at` + 4, the fifth bits from
    the 32-bit word at `at`), uint8 [rows, blocks, 32] in k order."""
    high = np.ascontiguousarray(b[..., at:at + 4]).view("<u4") >> np.arange(32, dtype=np.uint32)
    nibbles = b[..., at + 4:at + 20]
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    return low | ((high & 1).astype(np.uint8) << 4)


def _q5_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of Q5_1 blocks -> (scales, minimums [rows, groups] float32 from their float16, quant bytes 0..31)."""
    b = raw.reshape(raw.shape[0], -1, Q5_1_BYTES)
    return _half(b[..., 0:2]), _half(b[..., 2:4]), _fifth_bits(b, 4)


def q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """Rows of Q5_0 blocks as rows of Q8_0 blocks of the same weights: the float16 d, then the bytes q - 16."""
    b = raw.reshape(raw.shape[0], -1, Q5_0_BYTES)
    out = np.empty((*b.shape[:2], Q8_0_BYTES), np.uint8)
    out[..., 0:2] = b[..., 0:2]
    out[..., 2:] = (_fifth_bits(b, 2).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    return out.reshape(raw.shape[0], -1)


def _q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of Q6_K super-blocks -> (first and second sub-blocks' scales [rows, groups] float32, signed quant bytes
    [rows, groups, 32])."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, SUPER_BYTES[Q.Q6_K])
    ql, qh = b[..., :128], b[..., 128:192]
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)  # [rows, supers, 16]
    scale = (_half(b[..., 208:210])[..., None] * sc).reshape(rows, -1, 2)  # [rows, groups, (k < 16, k >= 16)] exact
    low = (ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    q = (low.reshape(rows, -1, GROUP) | (high.reshape(rows, -1, GROUP) << 4)).astype(np.int8) - np.int8(32)
    return scale[..., 0], scale[..., 1], q.view(np.uint8)


def _q3_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of Q3_K super-blocks -> (first and second sub-blocks' scales [rows, groups] float32, signed quant bytes
    -4..3 [rows, groups, 32]): Q6_KF's layout, the same weights (d * (sc - 32)) * q, each product exact."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, SUPER_BYTES[Q.Q3_K])
    hmask, qs, packed = b[..., :32], b[..., 32:96], b[..., 96:108]
    low = (packed[..., None, :8] >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F  # scale s < 8: byte s low
    high = (packed[..., None, 8:12] >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03  # 2 bits of byte s % 4
    sc = (low.reshape(rows, -1, 16) | (high.reshape(rows, -1, 16) << 4)).astype(np.int8) - np.int8(32)
    scale = (_half(b[..., 108:110])[..., None] * sc.astype(np.float32)).reshape(rows, -1, 2)  # [rows, groups, 2]
    ql = (qs.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    qh = (hmask.reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 0x01
    # k = 128 half + 32 shift + l for the low bits, 32 bit + l for the high one; a clear high bit subtracts 4
    q = ql.reshape(rows, -1, GROUP).astype(np.int8) - ((qh.reshape(rows, -1, GROUP) ^ 1) << 2).astype(np.int8)
    return scale[..., 0], scale[..., 1], q.view(np.uint8)


def _q2_k(raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """Rows of Q2_K super-blocks -> (first sub-blocks' scales, their negated minimums, second sub-blocks' scales,
    their negated minimums [rows, groups] float32, the 2-bit quants as Q4_1's nibbles [rows, groups, 16]): the
    package's dl * q - ml with dl = d * sc and ml = dmin * m exact, as q * D + M in one fused multiply-add."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, SUPER_BYTES[Q.Q2_K])
    packed, qs = b[..., :16], b[..., 16:80]  # a scale (low nibble) and a minimum (high) per sub-block of 16
    scale = _half(b[..., 80:82])[..., None] * (packed & 0x0F).astype(np.float32)  # [rows, supers, 16] exact
    minimum = -(_half(b[..., 82:84])[..., None] * (packed >> 4).astype(np.float32))
    q = (qs.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    q = q.reshape(rows, -1, GROUP)  # k = 128 half + 32 shift + l: sub-block k // 16
    first, second = scale.reshape(rows, -1, 2), minimum.reshape(rows, -1, 2)
    return first[..., 0], second[..., 0], first[..., 1], second[..., 1], q[..., :16] | (q[..., 16:] << 4)


def _iq4_nl(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of IQ4_NL blocks -> (scales [rows, groups] float32 from their float16, the nibbles [rows, groups, 16] as
    in the block: byte b holds k = b low, k = b + 16 high, each an index into IQ4_NL's table of 16 values)."""
    b = raw.reshape(raw.shape[0], -1, IQ4_NL_BYTES)
    return _half(b[..., 0:2]), b[..., 2:]


def _iq4_xs(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of IQ4_XS super-blocks -> (each sub-block of 32's exact scale d * (ls - 32) [rows, groups] float32, its
    nibbles [rows, groups, 16] as IQ4_NL's)."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, SUPER_BYTES[Q.IQ4_XS])
    high = np.ascontiguousarray(b[..., 2:4]).view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)  # [rows, supers, 8]
    low = b[..., 4:8, None] >> np.array([0, 4], np.uint8)  # [rows, supers, 4, 2]: sub-block 2i low nibble, 2i + 1 high
    ls = (low.reshape(rows, -1, 8) & 0x0F) | ((high & 0x03).astype(np.uint8) << 4)
    scale = _half(b[..., 0:2])[..., None] * (ls.astype(np.int8) - np.int8(32)).astype(np.float32)
    return scale.reshape(rows, -1), b[..., 8:].reshape(rows, -1, 16)


def factor_sixteens(w: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float32 weights [rows, K] whose every 16 are one float32 scale times integers of at most 7 bits -> (the first and
    second sixteen's scales of each group of 32 [rows, groups], the integers as signed bytes [rows, groups, 32]), each
    product exactly the weight (checked; ValueError naming `name` where a sixteen is not so). Each sixteen's scale is
    the largest that divides all of its weights: the gcd of their significands at a common exponent."""
    rows = w.shape[0]
    sub = w.reshape(rows, -1, 16)
    if not np.isfinite(sub).all():
        raise ValueError(f"{name}: its weights are not one float32 scale times integers (a NaN or infinite weight)")
    mantissa, exponent = np.frexp(sub)
    significand = np.ldexp(mantissa.astype(np.float64), 24).astype(np.int64)  # w = significand * 2^(exponent - 24)
    exponent = np.where(significand != 0, exponent - 24, np.iinfo(np.int32).max)
    low = exponent.min(axis=-1, keepdims=True)  # the smallest weight's exponent (all zero: none)
    low = np.where(low == np.iinfo(np.int32).max, 0, low)
    spread = np.where(significand != 0, exponent - low, 0)
    if spread.max(initial=0) > 38:
        raise ValueError(f"{name}: weights within a sixteen span more than 2^38; not a scale times small integers")
    whole = significand << spread  # every weight as an integer at the sixteen's smallest exponent
    unit = np.gcd.reduce(whole, axis=-1, keepdims=True)
    q = whole // np.maximum(unit, 1)
    scale = np.ldexp(unit.astype(np.float64), low).astype(np.float32)  # [rows, sixteens, 1]
    if np.abs(q).max(initial=0) > 127 or not np.array_equal(q.astype(np.float32) * scale, sub):
        raise ValueError(f"{name}: its weights are not one float32 scale times integers of at most 7 bits in every 16")
    scale = scale.reshape(rows, -1, 2)
    return scale[..., 0], scale[..., 1], q.astype(np.int8).reshape(rows, -1, GROUP).view(np.uint8)


def _factored(qtype: Q):
    """The layout converter of a FACTORED type: the package's float32 of its rows, factored (`factor_sixteens`)."""
    def convert(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return factor_sixteens(dequantize_f32(raw, qtype), f"{qtype.name} rows")
    return convert


def groups_bytes(qtype: Q) -> int:
    """Bytes of one group of a 64-row tile: its float32 vectors (two; Q2_K four, IQ4 one), then the quants."""
    return TILE * 4 * VECTORS.get(qtype, 2) + QUANT_ROWS[qtype] * TILE


def repack_k(parts: list[tuple[np.ndarray, np.ndarray | None]], qtype: Q, out: np.ndarray) -> None:
    """The parts' rows (raw super-blocks [rows, bytes], HF row order or None) one after another into `out` (uint8,
    tiles x groups x groups_bytes(qtype), zero rows past the last)."""
    convert = {Q.Q4_K: _q4_k, Q.Q6_K: _q6_k, Q.Q5_K: _q5_k, Q.Q5_1: _q5_1, Q.Q3_K: _q3_k, Q.Q2_K: _q2_k,
               Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs, **{q: _factored(q) for q in FACTORED}}[qtype]
    pieces = [convert(raw if order is None else raw[order]) for raw, order in parts]
    *vectors, quants = (np.concatenate([p[i] for p in pieces]) for i in range(len(pieces[0])))
    n, groups = vectors[0].shape
    tiles = -(-n // TILE)
    layout = out.reshape(tiles, groups, groups_bytes(qtype))  # every byte written below (padded rows zero)
    for i, values in enumerate(vectors):
        at = i * TILE * 4
        padded = np.zeros((tiles * TILE, groups), np.float32)
        padded[:n] = values
        layout[..., at:at + TILE * 4].view(np.float32)[:] = padded.reshape(tiles, TILE, groups).transpose(0, 2, 1)
    padded = np.zeros((tiles * TILE, groups, QUANT_ROWS[qtype]), np.uint8)
    padded[:n] = quants
    layout[..., TILE * 4 * len(vectors):].reshape(tiles, groups, QUANT_ROWS[qtype], TILE)[:] = (
        padded.reshape(tiles, TILE, groups, QUANT_ROWS[qtype]).transpose(0, 2, 3, 1))
