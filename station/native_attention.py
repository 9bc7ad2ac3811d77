"""The attention context of a float32 CPU station on the native kernel (mesh/core/model/csrc/paged_attention.c).

One call per layer stores the wave's new keys/values in the paged cache and attends every row, prompt chunk or
decode token alike, to its own sequence's keys up to its position. Each (row, head) is one fixed-order
computation, so a row's bits do not depend on its company, the thread count, or where its prompt's chunks
began and ended.
"""
from __future__ import annotations

import torch

from mesh.core.model.fused import FusedLayers
from mesh.core.model.native import load_native
from mesh.core.wave import WaveEntry
from station.kv import KVPool


class NativeWaveAttention:
    """AttentionContext for one wave: the block tables and positions of its rows, handed to the native kernel."""

    def __init__(self, kv: KVPool, first_layer: int, entries: tuple[WaveEntry, ...], window: int | None) -> None:
        self.kv, self.first_layer, self.window = kv, first_layer, window or 0
        tables, row_table, row_pos = [], [], []
        for e in entries:
            row_table.extend([len(tables)] * e.n_tokens)
            tables.extend(kv.table(e.seq_id))
            row_pos.extend(range(e.start_pos, e.end_pos))
        rows = len(row_pos)
        flat = torch.tensor(row_pos + row_table + tables, dtype=torch.int64)  # one tensor made, three views of it
        self.row_pos = flat[:rows]  # [T] each row's position
        self.row_table = flat[rows:2 * rows]  # [T] where each row's table starts
        self.tables = flat[2 * rows:]  # every entry's block table, concatenated
        self.furthest = max(e.end_pos for e in entries) - 1  # the wave's largest position
        self.lib = load_native()[0]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (rotated, float32, heads contiguous) -> [T, H, D]; stores k/v first."""
        t, h, d = q.shape
        kvh = k.shape[1]
        if not (q.stride(1) == d and k.stride(1) == d and v.stride(1) == d and k.stride(0) == v.stride(0)
                and q.stride(2) == k.stride(2) == v.stride(2) == 1):
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        local = layer - self.first_layer
        kc, vc = self.kv.k[local], self.kv.v[local]  # [blocks, KVH, BT, D]
        out = torch.empty(t, h, d, dtype=torch.float32)  # [T, H, D]
        self.lib.paged_attention_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), t, h, kvh, d,
                                     kc.data_ptr(), vc.data_ptr(), self.kv.block_tokens, self.tables.data_ptr(),
                                     self.row_table.data_ptr(), self.row_pos.data_ptr(), self.window, d ** -0.5,
                                     out.data_ptr(), torch.get_num_threads())
        return out

    def run_layers(self, fused: FusedLayers, hidden: torch.Tensor, seconds: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, d] at the rows' positions through every layer of the station in one native call (the same
        bits as the model's forward with this context): -> hidden [T, d], computed in `out` where given
        (FusedLayers.run)."""
        return fused.run(hidden, self.row_pos, self.kv.k, self.kv.v, self.kv.block_tokens, self.tables,
                         self.row_table, self.row_pos, self.window, seconds, out, self.furthest)
