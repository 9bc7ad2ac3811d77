"""Copying sequences' KV from station to station (a route switch moves live sequences: orchestrator/kv_move.py).

Export reads positions [start_pos, end_pos) of resident sequences from some of a station's layers; import stores
rows copied that way into every layer of another station, as a Forward of the same entries would have computed
them: the same checks (the entry continues its sequence where the station's KV ends, with a table it may write)
and the same bookkeeping. A copy has the bits of the KV it came from, whatever kernels either station runs, so a
sequence moved this way decodes on exactly as it would have where it was.
"""
from __future__ import annotations

import torch

from mesh.core.wave import WaveEntry, wave_rows
from station.kv import StepError


def _slots(kv, entries: tuple[WaveEntry, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block index and offset of every row of the entries, by their sequences' tables: each [T]."""
    bt, blocks, offsets = kv.block_tokens, [], []
    for e in entries:
        table = kv.table(e.seq_id)
        blocks.extend(table[p // bt] for p in range(e.start_pos, e.end_pos))
        offsets.extend(p % bt for p in range(e.start_pos, e.end_pos))
    return torch.tensor(blocks, dtype=torch.long), torch.tensor(offsets, dtype=torch.long)


def export_rows(station, entries: tuple[WaveEntry, ...], layer_start: int,
                layer_end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of the entries' positions in model layers [layer_start, layer_end): each [layers, T, KVH, D] on the
    CPU. StepError (the station's) when a layer is not this station's or a range is not held."""
    spec, kv = station.spec, station.kv
    if not spec.start <= layer_start < layer_end <= spec.end:
        raise StepError(f"layers [{layer_start}, {layer_end}) are not within this station's [{spec.start}, {spec.end})")
    if not entries:
        raise StepError("entries: an export needs at least one entry")
    for i, e in enumerate(entries):
        held = kv.length(e.seq_id)
        if held is None:
            raise StepError(f"entries[{i}].seq_id: unknown seq_id {e.seq_id} (this station holds no KV for it)")
        if e.end_pos > held:
            raise StepError(f"entries[{i}]: positions up to {e.end_pos} asked, seq_id {e.seq_id} holds {held}")
    blocks, offsets = _slots(kv, entries)
    blocks, offsets = blocks.to(kv.k.device), offsets.to(kv.k.device)
    lo, hi = layer_start - spec.start, layer_end - spec.start
    k = torch.stack([kv.k[layer][blocks, :, offsets] for layer in range(lo, hi)])  # [L, T, KVH, D]
    v = torch.stack([kv.v[layer][blocks, :, offsets] for layer in range(lo, hi)])
    return k.cpu(), v.cpu()


def import_rows(station, entries: tuple[WaveEntry, ...], k: torch.Tensor, v: torch.Tensor) -> None:
    """Store K, V [station layers, T, KVH, D] (T: the entries' rows, in order) at the entries' positions; the
    entries are checked as a Forward's are. StepError when they or the tensors do not fit."""
    kv, cfg = station.kv, station.config
    kv.check_wave(entries, cfg.max_position_embeddings)
    want = (station.spec.end - station.spec.start, wave_rows(entries), cfg.num_key_value_heads, cfg.head_dim)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != want or t.dtype != station.dtype:
            raise StepError(f"{name}: expected {station.spec.dtype} {list(want)}, got "
                            f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}")
    with kv.growing(entries):
        blocks, offsets = (t.to(kv.k.device) for t in _slots(kv, entries))
        for layer in range(want[0]):
            kv.write(layer, blocks, offsets, k[layer].to(kv.k.device), v[layer].to(kv.k.device))
