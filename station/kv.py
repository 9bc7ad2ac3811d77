"""Per-sequence key/value storage for a station's layers, in fixed-size blocks under a byte budget.

Layout: one pool per K and V, [layers, blocks, KVH, block_tokens, D]. A sequence
owns a block table (a list of block indices); position p lives in block
table[p // block_tokens] at offset p % block_tokens. Paged blocks make the
budget exact (a sequence of t tokens holds ceil(t / block_tokens) blocks, the
same arithmetic the scheduler does), let every sequence grow without copying,
and free memory the moment a sequence ends. A sequence reads only the blocks of
its table; the orchestrator may hand several sequences the same full blocks of a
shared prompt prefix (reference counted here), which they read and never write.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mesh.core.config import DTYPE_BYTES, ModelConfig, StationSpec
from mesh.core.model.host_memory import populate_in_background, zero_pages
from mesh.core.model.loader import TORCH_DTYPES
from mesh.core.wave import WaveEntry

DEFAULT_BLOCK_TOKENS = 16


class KVBudgetError(RuntimeError):
    """The KV budget cannot hold what a wave asks for."""


class StepError(ValueError):
    """A wave (or a KV copy) is malformed: the message names the entry and field."""


@dataclass(frozen=True, slots=True)
class KVStats:
    """Occupancy of a station's KV pool."""

    bytes_used: int
    bytes_total: int
    blocks_used: int
    blocks_total: int
    block_tokens: int
    sequences: int


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str, huge_pages: bool) -> torch.Tensor:
    """Zeros; on CPU as pages the OS maps zeroed (nothing written at start: host_memory.zero_pages), huge where
    asked."""
    if torch.device(device).type == "cpu":
        return zero_pages(shape, dtype, huge_pages)
    return torch.zeros(shape, dtype=dtype, device=device)


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
        self.k = _zeros(shape, TORCH_DTYPES[spec.dtype], spec.device, spec.huge_pages)
        self.v = _zeros(shape, TORCH_DTYPES[spec.dtype], spec.device, spec.huge_pages)
        self._k_layers, self._v_layers = self.k.unbind(0), self.v.unbind(0)  # per-layer views, taken once
        self.populating = (populate_in_background((self.k, self.v), "kv-populate") if self.k.device.type == "cpu"
                           else None)  # the budget's pages faulted in beside the first waves, not inside them
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low indices first (may hold stale ids)
        self._refs = [0] * self.num_blocks  # sequences holding each block (a shared prefix block: several)
        self._used = 0  # blocks some sequence holds
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
        return self.num_blocks - self._used

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._used += 1
        self._refs[block] += 1

    def _drop(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._used -= 1
                self._free.append(block)

    def _pop_free(self) -> int:
        while True:  # skip ids a given table took while they sat in the free list
            block = self._free.pop()
            if self._refs[block] == 0:
                self._hold(block)
                return block

    def reserve(self, growth: dict[int, int]) -> None:
        """Grow each sequence to hold `new_length` positions ({seq_id: new_length}), all or nothing."""
        need = {s: blocks_for(n, self.block_tokens) - len(self._tables.get(s, ())) for s, n in growth.items()}
        total = sum(max(0, b) for b in need.values())
        if total > self.free_blocks():
            raise KVBudgetError(f"KV budget exhausted: the wave needs {total} more blocks, "
                                f"{self.free_blocks()} of {self.num_blocks} are free")
        for s, n in growth.items():
            table = self._tables.setdefault(s, [])
            table.extend(self._pop_free() for _ in range(max(0, need[s])))
            self._lengths[s] = max(self._lengths.get(s, 0), n)

    def check_table(self, seq_id: int, start: int, end: int, blocks: tuple[int, ...]) -> str | None:
        """Why `blocks` cannot be `seq_id`'s table for positions [0, end) when it holds [0, start); None if it can.

        The table must cover exactly [0, end) with distinct ids inside the pool, keep the blocks the sequence
        already holds, and every block it writes ([start, end)) must be held by no other sequence: blocks of a
        shared prefix are read, never written."""
        if len(blocks) != blocks_for(end, self.block_tokens):
            return f"{len(blocks)} block ids for {end} positions of {self.block_tokens} (needs {blocks_for(end, self.block_tokens)})"
        if max(blocks) >= self.num_blocks or len(set(blocks)) != len(blocks):
            return f"block ids must be distinct and below {self.num_blocks}"
        held = self._tables.get(seq_id, [])
        if list(blocks[:len(held)]) != held:
            return "the table does not keep the blocks the sequence holds"
        if start % self.block_tokens and start // self.block_tokens >= len(held):
            return f"starts mid-block at {start} without holding that block"
        for i in range(start // self.block_tokens, len(blocks)):
            others = self._refs[blocks[i]] - (1 if i < len(held) else 0)
            if others:
                return f"block {blocks[i]} (positions from {i * self.block_tokens}) is written but held by another sequence"
        return None

    def check_wave(self, entries: tuple[WaveEntry, ...], max_positions: int) -> None:
        """StepError unless each of a wave's entries continues its sequence where this pool's KV of it ends, with a
        table it may write (check_table), below `max_positions` (the model's context), and no block one entry
        writes is read by another."""
        if not entries:
            raise StepError("entries: a wave needs at least one entry")
        seen = set()
        for i, e in enumerate(entries):
            if not isinstance(e, WaveEntry):
                raise StepError(f"entries[{i}]: expected a WaveEntry, got {type(e).__name__}")
            if e.seq_id in seen:
                raise StepError(f"entries[{i}].seq_id: {e.seq_id} appears twice in one wave")
            seen.add(e.seq_id)
            held = self.length(e.seq_id)
            if e.blocks:
                why = self.check_table(e.seq_id, e.start_pos, e.end_pos, e.blocks)
                if why is not None:
                    raise StepError(f"entries[{i}].blocks: seq_id {e.seq_id}: {why}")
            if held is None and e.start_pos != 0 and not e.blocks:
                raise StepError(f"entries[{i}].seq_id: unknown seq_id {e.seq_id} (start_pos {e.start_pos} "
                                "but this station holds no KV for it)")
            if held is not None and e.start_pos != held:
                how = "skips ahead" if e.start_pos > held else "goes backwards"
                raise StepError(f"entries[{i}].start_pos: {e.start_pos} {how}; seq_id {e.seq_id} holds {held} positions")
            if e.end_pos > max_positions:
                raise StepError(f"entries[{i}]: position {e.end_pos} exceeds the model context ({max_positions})")
        self._check_writes(entries)

    def _check_writes(self, entries: tuple[WaveEntry, ...]) -> None:
        """No block is written by one entry of the wave and held by another entry's table."""
        bt, writer = self.block_tokens, {}
        for e in entries:
            for block in e.blocks[e.start_pos // bt:]:
                writer[block] = e.seq_id
        written = set(writer)  # one C-level intersection per entry, not a Python loop over every table
        for i, e in enumerate(entries):
            for block in written.intersection(e.blocks):
                if writer[block] != e.seq_id:
                    raise StepError(f"entries[{i}].blocks: block {block} is written by seq_id {writer[block]} "
                                    f"in this wave and read by seq_id {e.seq_id}")

    def assign(self, seq_id: int, end: int, blocks: tuple[int, ...]) -> None:
        """Make `blocks` (checked by check_table) the table of `seq_id`, now holding [0, end)."""
        table = self._tables.setdefault(seq_id, [])
        for block in blocks[len(table):]:
            self._hold(block)
            table.append(block)
        self._lengths[seq_id] = max(self._lengths.get(seq_id, 0), end)

    @contextmanager
    def growing(self, entries) -> Iterator[None]:
        """Hold the positions these wave entries add (blocks reserved here, or the tables they carry, checked by
        check_table) while the body stores their K/V; if the body fails, each sequence rolls back to its length
        before."""
        before = {e.seq_id: self.length(e.seq_id) for e in entries}
        self.reserve({e.seq_id: e.end_pos for e in entries if not e.blocks})
        for e in entries:
            if e.blocks:
                self.assign(e.seq_id, e.end_pos, e.blocks)
        try:
            yield
        except BaseException:
            for seq_id, length in before.items():
                self.truncate(seq_id, length)
            raise

    def release(self, seq_id: int) -> bool:
        """Free a sequence's blocks (a block other sequences hold stays theirs); False when it was not resident."""
        table = self._tables.pop(seq_id, None)
        self._lengths.pop(seq_id, None)
        if table is None:
            return False
        self._drop(table)
        return True

    def truncate(self, seq_id: int, length: int | None) -> None:
        """Roll a sequence back to `length` positions (None: forget it), freeing blocks past the end."""
        if length is None:
            self.release(seq_id)
            return
        table = self._tables[seq_id]
        keep = blocks_for(length, self.block_tokens)
        self._drop(table[keep:])
        del table[keep:]
        self._lengths[seq_id] = length

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows k/v [n, KVH, D] of local `layer` at (blocks, offsets) [n]."""
        self._k_layers[layer][blocks, :, offsets] = k  # [n, KVH, D]
        self._v_layers[layer][blocks, :, offsets] = v

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of sequences by padded block tables [B, nb] -> each [B, nb, KVH, block_tokens, D] (one
        contiguous copy of whole blocks)."""
        b, nb = tables.shape
        flat = tables.reshape(-1)  # [B*nb]
        k = self._k_layers[layer].index_select(0, flat)  # [B*nb, KVH, blk, D]
        v = self._v_layers[layer].index_select(0, flat)
        return k.view(b, nb, *k.shape[1:]), v.view(b, nb, *v.shape[1:])

    def stats(self) -> KVStats:
        """Bytes and blocks in use."""
        used = self._used
        return KVStats(used * self.block_bytes, self.num_blocks * self.block_bytes, used, self.num_blocks,
                       self.block_tokens, len(self._tables))
