"""Per-sequence key/value storage for a station's layers, in fixed-size blocks under a byte budget.

Layout: one pool per K and V, [layers, blocks, KVH, block_tokens, D]. A sequence
owns a block table (a list of block indices); position p lives in block
table[p // block_tokens] at offset p % block_tokens. Paged blocks make the
budget exact (a sequence of t tokens holds ceil(t / block_tokens) blocks, the
same arithmetic the scheduler does), let every sequence grow without copying,
and free memory the moment a sequence ends. A sequence only ever reads its own
blocks.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mesh.core.config import DTYPE_BYTES, ModelConfig, StationSpec
from mesh.core.model.loader import TORCH_DTYPES

DEFAULT_BLOCK_TOKENS = 16


class KVBudgetError(RuntimeError):
    """The KV budget cannot hold what a wave asks for."""


@dataclass(frozen=True, slots=True)
class KVStats:
    """Occupancy of a station's KV pool."""

    bytes_used: int
    bytes_total: int
    blocks_used: int
    blocks_total: int
    block_tokens: int
    sequences: int


def blocks_for(tokens: int, block_tokens: int) -> int:
    """Blocks needed to hold `tokens` positions."""
    return -(-tokens // block_tokens)


class KVPool:
    """Block-paged K/V for layers [start, end) of one station."""

    def __init__(self, cfg: ModelConfig, spec: StationSpec, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        self.layers = spec.end - spec.start
        self.block_tokens = block_tokens
        token_bytes = 2 * self.layers * cfg.num_key_value_heads * cfg.head_dim * DTYPE_BYTES[spec.dtype]
        self.block_bytes = token_bytes * block_tokens
        self.num_blocks = spec.kv_bytes // self.block_bytes
        if self.num_blocks < 1:
            raise KVBudgetError(f"kv_bytes {spec.kv_bytes} is below one block ({self.block_bytes} bytes)")
        self.spare_block = self.num_blocks  # one block past the budget, lent by `spare` (never in the stats)
        shape = (self.layers, self.num_blocks + 1, cfg.num_key_value_heads, block_tokens, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=TORCH_DTYPES[spec.dtype], device=spec.device)
        self.v = torch.zeros(shape, dtype=TORCH_DTYPES[spec.dtype], device=spec.device)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low indices first
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._spare: dict[int, list[int]] = {}  # a throwaway sequence on the spare block (the health probe)

    def length(self, seq_id: int) -> int | None:
        """Positions stored for `seq_id`, or None when the pool does not know it."""
        return self._lengths.get(seq_id)

    def table(self, seq_id: int) -> list[int]:
        """The block table of a resident sequence."""
        return self._spare.get(seq_id) or self._tables[seq_id]

    @contextmanager
    def spare(self, seq_id: int) -> Iterator[None]:
        """Hold `seq_id`, one block long, on the spare block while the body runs: a throwaway sequence
        that takes nothing from the budget and never shows in the stats."""
        self._spare[seq_id] = [self.spare_block]
        try:
            yield
        finally:
            del self._spare[seq_id]

    def free_blocks(self) -> int:
        """Blocks not held by any sequence."""
        return len(self._free)

    def reserve(self, growth: dict[int, int]) -> None:
        """Grow each sequence to hold `new_length` positions ({seq_id: new_length}), all or nothing."""
        need = {s: blocks_for(n, self.block_tokens) - len(self._tables.get(s, ())) for s, n in growth.items()}
        total = sum(max(0, b) for b in need.values())
        if total > len(self._free):
            raise KVBudgetError(f"KV budget exhausted: the wave needs {total} more blocks, "
                                f"{len(self._free)} of {self.num_blocks} are free")
        for s, n in growth.items():
            table = self._tables.setdefault(s, [])
            table.extend(self._free.pop() for _ in range(max(0, need[s])))
            self._lengths[s] = max(self._lengths.get(s, 0), n)

    def release(self, seq_id: int) -> bool:
        """Free a sequence's blocks; False when it was not resident."""
        table = self._tables.pop(seq_id, None)
        self._lengths.pop(seq_id, None)
        if table is None:
            return False
        self._free.extend(reversed(table))
        return True

    def truncate(self, seq_id: int, length: int | None) -> None:
        """Roll a sequence back to `length` positions (None: forget it), freeing blocks past the end."""
        if length is None:
            self.release(seq_id)
            return
        table = self._tables[seq_id]
        keep = blocks_for(length, self.block_tokens)
        self._free.extend(reversed(table[keep:]))
        del table[keep:]
        self._lengths[seq_id] = length

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows k/v [n, KVH, D] of local `layer` at (blocks, offsets) [n]."""
        self.k[layer][blocks, :, offsets] = k  # [n, KVH, D]
        self.v[layer][blocks, :, offsets] = v

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of sequences by padded block tables [B, nb] -> each [B, nb, KVH, block_tokens, D] (one
        contiguous copy of whole blocks)."""
        b, nb = tables.shape
        k = self.k[layer].index_select(0, tables.reshape(-1))  # [B*nb, KVH, blk, D]
        v = self.v[layer].index_select(0, tables.reshape(-1))
        return k.view(b, nb, *k.shape[1:]), v.view(b, nb, *v.shape[1:])

    def stats(self) -> KVStats:
        """Bytes and blocks in use."""
        used = self.num_blocks - len(self._free)
        return KVStats(used * self.block_bytes, self.num_blocks * self.block_bytes, used, self.num_blocks,
                       self.block_tokens, len(self._tables))
