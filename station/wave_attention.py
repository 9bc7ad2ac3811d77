"""The torch path's attention over one wave (bf16, CUDA, any backend but the native float32 kernels).

A row's result never depends on the rest of its wave: decode rows are batched only with rows whose
sequences span the same number of KV blocks, prompt chunks attend one by one (station/step.py's Station
builds one per wave; station/native_attention.py is the float32 kernels' counterpart).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mesh.core.wave import WaveEntry
from station.kv import KVPool


class WaveAttention:
    """AttentionContext for one wave: writes each layer's new K/V, then attends per sequence.

    Every row's attention is computed the same way whatever else is in the wave, so its
    bits never depend on its company: a prompt chunk attends alone over exactly its
    sequence's keys; decode rows are batched only with rows whose sequences span the
    same number of KV blocks (the same padded key length), through batched matmuls
    against each gathered block (never copied into one contiguous run of keys), one
    softmax over all the keys and a sum over blocks, whose per-row results do not change
    with the batch or the thread count (torch's fused CPU kernel for a single query row
    changes both, and is slower here).
    """

    def __init__(self, kv: KVPool, first_layer: int, entries: tuple[WaveEntry, ...], device: torch.device,
                 window: int | None) -> None:
        self.kv, self.first_layer = kv, first_layer
        bt, row = kv.block_tokens, 0
        blocks, offsets = [], []  # KV slot of every row: block index, offset in the block
        by_blocks: dict[int, list[tuple[int, list[int], int]]] = {}  # block count -> (row, table, length)
        self.chunks = []  # (rows slice, block table [nb], mask [n, S]) for n > 1
        for e in entries:  # plain ints here, one tensor per field below: a wave's set-up stays cheap at any K
            table = kv.table(e.seq_id)
            positions = range(e.start_pos, e.end_pos)
            blocks.extend(table[p // bt] for p in positions)
            offsets.extend(p % bt for p in positions)
            nb = -(-e.end_pos // bt)
            if e.n_tokens == 1:
                by_blocks.setdefault(nb, []).append((row, table[:nb], e.end_pos))
            else:
                q_pos = torch.arange(e.start_pos, e.end_pos)[:, None]  # [n, 1]
                k_pos = torch.arange(e.end_pos)[None, :]  # [1, S]
                mask = _visible(k_pos, q_pos, window)  # [n, S]
                self.chunks.append((slice(row, row + e.n_tokens), torch.tensor(table[:nb], device=device),
                                    mask.to(device)))
            row += e.n_tokens
        self.blocks = torch.tensor(blocks, device=device)  # [T]
        self.offsets = torch.tensor(offsets, device=device)  # [T]
        self.whole = not self.chunks and len(by_blocks) == 1  # one group of decode rows holds every row, in order
        self.decode_groups = []  # (rows [B] (None when whole), block tables [B, nb], hidden key positions [B, 1, 1, S])
        for nb, group in by_blocks.items():
            lens = torch.tensor([length for _, _, length in group])[:, None]  # [B, 1]
            k_pos = torch.arange(nb * bt)[None, :]  # [1, S]
            mask = (k_pos < lens) & _visible(k_pos, lens - 1, window)  # [B, S]
            self.decode_groups.append((None if self.whole else torch.tensor([r for r, _, _ in group], device=device),
                                       torch.tensor([t for _, t, _ in group], device=device),
                                       ~mask[:, None, None, :].to(device)))

    @classmethod
    def one_group(cls, kv: KVPool, first_layer: int, blocks: torch.Tensor, offsets: torch.Tensor,
                  tables: torch.Tensor, masked: torch.Tensor) -> WaveAttention:
        """The context of a wave of decode rows over one block count, on tensors given (a CUDA graph's inputs,
        station/decode_graphs.py): blocks / offsets [T] each row's KV slot, tables [T, nb], masked [T, 1, 1, S]
        the keys each row may not see."""
        ctx = cls.__new__(cls)
        ctx.kv, ctx.first_layer = kv, first_layer
        ctx.blocks, ctx.offsets, ctx.chunks, ctx.whole = blocks, offsets, [], True
        ctx.decode_groups = [(None, tables, masked)]
        return ctx

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]; stores k/v first."""
        local = layer - self.first_layer
        self.kv.write(local, self.blocks, self.offsets, k, v)
        if self.whole:  # the wave is one group of decode rows: its result is the output, no gather or scatter
            _, tables, hidden = self.decode_groups[0]
            return self._decode_group(local, q, tables, hidden)
        out = torch.empty_like(q)  # [T, H, D]
        for rows, tables, hidden in self.decode_groups:
            out.index_copy_(0, rows, self._decode_group(local, q.index_select(0, rows), tables, hidden))
        for rows, table, mask in self.chunks:
            blocks = self.kv.gather(local, table[None])  # [1, nb, KVH, blk, D] each
            keys, values = (t[0].transpose(0, 1).flatten(1, 2) for t in blocks)  # [KVH, S', D]
            s = mask.shape[1]
            qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            oc = F.scaled_dot_product_attention(qc, keys[None, :, :s], values[None, :, :s], attn_mask=mask,
                                                enable_gqa=True)
            out[rows] = oc[0].transpose(0, 1)  # [n, H, D]
        return out

    def _decode_group(self, local: int, q: torch.Tensor, tables: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One decode group's attention: q [B, H, D] over its block tables [B, nb] -> [B, H, D]."""
        keys, values = self.kv.gather(local, tables)  # [B, nb, KVH, blk, D] each
        b, nb, kvh, blk, d = keys.shape  # the matmuls' shapes depend on nb, never on B
        qd = q.reshape(b, 1, kvh, -1, d)  # [B, 1, KVH, G, D]: query heads by KV head
        scores = torch.matmul(qd, keys.transpose(-1, -2))  # [B, nb, KVH, G, blk]
        scores = scores.permute(0, 2, 3, 1, 4).reshape(b, kvh, -1, nb * blk) * d**-0.5  # [B, KVH, G, S]
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)  # [B, KVH, G, S]
        probs = probs.view(b, kvh, -1, nb, blk).permute(0, 3, 1, 2, 4)  # [B, nb, KVH, G, blk]
        return torch.matmul(probs, values).sum(1).view(b, -1, d)  # [B, H, D]


def _visible(k_pos: torch.Tensor, q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility of key positions from query positions."""
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
