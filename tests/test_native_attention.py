"""The native paged attention's two paths give the same bits.

A row of a prompt chunk (its sequence has other rows in the wave) takes all the query heads of a KV head in one pass
over the keys and values (attend_group); a decode row takes them one by one (attend_one). Each head's arithmetic is
meant to be the same either way, so a row's bits do not depend on whether its prompt came in one chunk or many, nor
on its company. Here the same rows run both ways: once as one chunk (their rows share one block table), once with
each row its own copy of the table (each then a lone row), on the same cache, and must agree exactly.
"""
from __future__ import annotations

import pytest
import torch

from mesh.core.model.native import load_native

LIB, WHY = load_native()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"native kernels unavailable: {WHY}")


def _attend(heads: int, kv_heads: int, dim: int, start: int, rows: int, window: int, threads: int,
            separate_tables: bool, block_tokens: int = 16) -> torch.Tensor:
    """Rows at positions [start, start + rows) of one sequence through paged_attention_f32: out [rows, H, D]."""
    g = torch.Generator().manual_seed(heads * 1000 + dim * 10 + start)
    blocks = -(-(start + rows) // block_tokens)
    table = torch.randperm(blocks + 3, generator=g)[:blocks].to(torch.int64)  # blocks not in order, as in a pool
    kc = torch.randn(blocks + 3, kv_heads, block_tokens, dim, generator=g)  # [blocks, KVH, BT, D]
    vc = torch.randn(blocks + 3, kv_heads, block_tokens, dim, generator=g)
    q = torch.randn(rows, heads, dim, generator=g) * 2  # [T, H, D]
    k = torch.randn(rows, kv_heads, dim, generator=g)  # [T, KVH, D]
    v = torch.randn(rows, kv_heads, dim, generator=g)
    if separate_tables:  # each row its own copy of the table: a lone row of its entry
        tables, row_table = table.repeat(rows), torch.arange(rows, dtype=torch.int64) * blocks
    else:
        tables, row_table = table, torch.zeros(rows, dtype=torch.int64)
    row_pos = torch.arange(start, start + rows, dtype=torch.int64)
    out = torch.empty(rows, heads, dim)
    LIB.paged_attention_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), rows, heads, kv_heads,
                            dim, kc.data_ptr(), vc.data_ptr(), block_tokens, tables.data_ptr(), row_table.data_ptr(),
                            row_pos.data_ptr(), window, dim ** -0.5, out.data_ptr(), threads)
    return out


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (12, 4, 64), (8, 2, 64), (8, 8, 64), (10, 2, 64),
                                                (32, 8, 128), (4, 1, 128), (6, 3, 24)])
def test_a_prompt_chunk_and_lone_rows_give_the_same_bits(heads, kv_heads, dim):
    for start, rows, window, threads in [(0, 37, 0, 1), (5, 40, 0, 2), (17, 9, 0, 2), (250, 33, 0, 1),
                                         (100, 20, 24, 2)]:
        chunk = _attend(heads, kv_heads, dim, start, rows, window, threads, separate_tables=False)
        lone = _attend(heads, kv_heads, dim, start, rows, window, threads, separate_tables=True)
        assert torch.isfinite(chunk).all()
        assert torch.equal(chunk, lone), (heads, kv_heads, dim, start, rows, window, threads,
                                          (chunk - lone).abs().max().item())
