"""The scheduler's KV ledger: block ids every station shares, their reference counts, and the prefix cache (no torch).

The stations' paged KV is counted here, block by block: the ledger hands out block ids and every wave entry
carries its sequence's block table, so block b holds the KV of the same tokens at every station (each station for
its own layers). A sequence holding t tokens holds ceil(t / block_tokens) blocks, exactly as a station counts them.

Prefix cache: once a full block's KV is committed, the block is named by a digest of its tokens and of its
parent block's name (the chain from token 0), so a name stands for a whole prefix. A new sequence whose prompt
starts with named blocks takes references on them and starts with those tokens already computed. A block nobody
references stays cached (its KV is still at the stations) until a reservation needs it, least recently used first;
a referenced block is never evicted, and a block is written only while its one holder computes it. Partial blocks
are never named, and at least one prompt token is always left to compute (the sample comes from it).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from orchestrator.sequence import Sequence

ROOT_NAME = b"wavemesh-kv-root"


def block_name(parent: bytes, tokens: tuple[int, ...] | list[int]) -> bytes:
    """The name of a full block: a 16-byte digest of its parent's name and its token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The named blocks a prompt starts with, and whether the next one is being computed in a wave in flight."""

    blocks: tuple[int, ...]
    names: tuple[bytes, ...]
    next_in_flight: bool  # the next block of this prefix will be named when a wave in flight commits


NO_HIT = PrefixHit((), (), False)


class KVBlockLedger:
    """Block ids of the stations' paged KV: free, referenced by sequences, or cached under a name."""

    def __init__(self, total_blocks: int, block_tokens: int, prefix_cache: bool = False) -> None:
        """Every block free; `prefix_cache` names committed full blocks for reuse."""
        self.total = total_blocks
        self.block_tokens = block_tokens
        self.prefix_cache = prefix_cache
        self.used = 0  # blocks some sequence references
        self._free = list(range(total_blocks - 1, -1, -1))  # unnamed and unreferenced; pop() gives low ids first
        self._refs = [0] * total_blocks
        self._cached: OrderedDict[int, None] = OrderedDict()  # named, unreferenced; least recently used first
        self._by_name: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._computing: dict[bytes, int] = {}  # names of blocks a wave in flight fills -> how many such waves
        self.evictions = 0

    @property
    def free(self) -> int:
        """Blocks a reservation can take: unreferenced ones, cached included (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def cached(self) -> int:
        """Named blocks nobody references, kept for reuse."""
        return len(self._cached)

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` tokens of KV."""
        return -(-tokens // self.block_tokens)

    def capacity(self, seq: Sequence) -> int:
        """Tokens `seq` could add beyond num_computed with its own blocks plus every free or cached block."""
        return (len(seq.table) + self.free) * self.block_tokens - seq.num_computed

    def reserve(self, seq: Sequence, tokens: int) -> bool:
        """Make sure `seq` holds blocks for `tokens` tokens; False (and no change) if too few are free."""
        extra = self.blocks_for(tokens) - len(seq.table)
        if extra <= 0:
            return True
        if extra > self.free:
            return False
        seq.table.extend(self._take() for _ in range(extra))
        return True

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently used cached block
            block, _ = self._cached.popitem(last=False)
            del self._by_name[self._name_of.pop(block)]
            self.evictions += 1
        self._refs[block] = 1
        self.used += 1
        return block

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its named blocks stay cached, the last block first evicted (the chain's
        root is released last, so the longest-lived prefix is the shared beginning)."""
        for block in reversed(seq.table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self.used -= 1
                if block in self._name_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)
        seq.table = []
        seq.block_names = []

    def lookup(self, tokens: tuple[int, ...]) -> PrefixHit:
        """The longest chain of named blocks `tokens` starts with, leaving at least one token to compute."""
        if not self.prefix_cache:
            return NO_HIT
        bt, parent = self.block_tokens, ROOT_NAME
        blocks: list[int] = []
        names: list[bytes] = []
        for i in range((len(tokens) - 1) // bt):
            name = block_name(parent, tokens[i * bt:(i + 1) * bt])
            block = self._by_name.get(name)
            if block is None:
                return PrefixHit(tuple(blocks), tuple(names), name in self._computing)
            blocks.append(block)
            names.append(name)
            parent = name
        return PrefixHit(tuple(blocks), tuple(names), False)

    def acquire(self, seq: Sequence, hit: PrefixHit) -> None:
        """Start `seq` (holding nothing) on the blocks of `hit`: their tokens count as computed."""
        if seq.table or seq.num_computed:
            raise ValueError(f"seq {seq.seq_id} already holds KV")
        for block in hit.blocks:
            if self._refs[block] == 0:
                del self._cached[block]
                self.used += 1
            self._refs[block] += 1
        seq.table = list(hit.blocks)
        seq.block_names = list(hit.names)
        seq.num_computed = len(hit.blocks) * self.block_tokens

    def names_filled(self, seq: Sequence, end_pos: int) -> list[bytes]:
        """Names of `seq`'s blocks that become full once its KV reaches `end_pos` (not yet named by it)."""
        bt = self.block_tokens
        names, parent = [], seq.block_names[-1] if seq.block_names else ROOT_NAME
        for i in range(len(seq.block_names), end_pos // bt):
            parent = block_name(parent, seq.token_slice(i * bt, (i + 1) * bt))
            names.append(parent)
        return names

    def computing(self, names: list[bytes], delta: int) -> None:
        """Mark (delta 1) or unmark (delta -1) names a wave in flight is filling."""
        for name in names:
            left = self._computing.get(name, 0) + delta
            if left > 0:
                self._computing[name] = left
            else:
                self._computing.pop(name, None)

    def name_blocks(self, seq: Sequence, names: list[bytes]) -> None:
        """`seq`'s next blocks are committed full under `names`: cache them (a name already cached keeps its
        block; this copy stays unnamed and is freed with the sequence)."""
        for name in names:
            block = seq.table[len(seq.block_names)]
            seq.block_names.append(name)
            if name not in self._by_name and block not in self._name_of:
                self._by_name[name] = block
                self._name_of[block] = name

    def check(self) -> None:
        """Assert the ledger's invariants (tests): counts add up, no block both free and referenced or cached."""
        refd = {b for b in range(self.total) if self._refs[b] > 0}
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a block is free twice"
        assert self.used == len(refd), f"used {self.used} but {len(refd)} blocks are referenced"
        assert not (free & refd) and not (cached & refd) and not (free & cached), "a block is in two states"
        assert len(free) + len(cached) + len(refd) == self.total, "a block is lost"
        assert cached <= set(self._name_of) and all(self._by_name[n] == b for b, n in self._name_of.items())
        assert not (free & set(self._name_of)), "a free block keeps a name"
