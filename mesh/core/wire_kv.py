"""KV copies between stations <-> ExportKV / ImportKV messages (station.proto), checked like every wave.

A copy carries K and V as two tensors [layers, rows, kv_heads, head_dim] in the station's dtype, rows in entry
order (an entry's positions [start_pos, end_pos)); the checks of `mesh.core.wire` apply (dtype, exact byte size,
finite values), with the entry and row limits of a Forward.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from mesh.core.proto import station_pb2 as pb
from mesh.core.wave import WaveEntry, wave_rows
from mesh.core.wire import entries_to_proto, proto_to_entries
from mesh.core.wire_tensor import WireError, all_finite, dtype_itemsize, proto_to_tensor, tensor_to_proto

MAX_COPY_BYTES = 32 << 20  # K and V of one copy call at most (the orchestrator cuts larger copies; servers accept it)
MAX_COPY_ROWS = 4096  # positions of one copy call at most (within a station server's default max_rows)


def _entries(msgs, max_entries: int, max_rows: int) -> tuple[WaveEntry, ...]:
    if not msgs:
        raise WireError("entries: a KV copy needs at least one entry")
    if len(msgs) > max_entries:
        raise WireError(f"entries: {len(msgs)} entries exceeds max_entries {max_entries}")
    entries = proto_to_entries(msgs)
    if wave_rows(entries) > max_rows:
        raise WireError(f"entries: {wave_rows(entries)} rows (sum of n_tokens) exceeds max_rows {max_rows}")
    return entries


def kv_rows_from_proto(k: pb.Tensor, v: pb.Tensor, *, dtype: str,
                       shape: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode K and V, each `shape` [layers, rows, kv_heads, head_dim] of `dtype`, finite."""
    limit = dtype_itemsize(dtype) * shape[0] * shape[1] * shape[2] * shape[3]
    out = []
    for name, msg in (("k", k), ("v", v)):
        t = proto_to_tensor(msg, expect_dtype=dtype, expect_shape=shape, max_bytes=limit, field=name)
        if not all_finite(t):
            raise WireError(f"{name}: holds NaN or infinite values; copied KV must be finite")
        out.append(t)
    return out[0], out[1]


def encode_export(entries: Sequence[WaveEntry], layer_start: int, layer_end: int) -> pb.ExportKVRequest:
    """An ExportKVRequest for the entries' positions in model layers [layer_start, layer_end)."""
    return pb.ExportKVRequest(entries=entries_to_proto(entries), layer_start=layer_start, layer_end=layer_end)


def decode_export(msg: pb.ExportKVRequest, *, max_entries: int,
                  max_rows: int) -> tuple[tuple[WaveEntry, ...], int, int]:
    """(entries, layer_start, layer_end) of an ExportKVRequest; the station checks the range."""
    if msg.layer_end <= msg.layer_start:
        raise WireError(f"layer_end: {msg.layer_end} must exceed layer_start {msg.layer_start}")
    return _entries(msg.entries, max_entries, max_rows), msg.layer_start, msg.layer_end


def encode_import(entries: Sequence[WaveEntry], k: torch.Tensor, v: torch.Tensor) -> pb.ImportKVRequest:
    """An ImportKVRequest: K, V [layers, rows, kv_heads, head_dim] for the entries' positions."""
    rows = wave_rows(tuple(entries))
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4 or t.shape[1] != rows:
            raise WireError(f"{name}.shape: expected [layers, {rows}, kv_heads, head_dim], got {list(t.shape)}")
    return pb.ImportKVRequest(entries=entries_to_proto(entries), k=tensor_to_proto(k), v=tensor_to_proto(v))


def decode_import(msg: pb.ImportKVRequest, *, dtype: str, layers: int, kv_heads: int, head_dim: int,
                  max_entries: int, max_rows: int) -> tuple[tuple[WaveEntry, ...], torch.Tensor, torch.Tensor]:
    """(entries, k, v) of an ImportKVRequest for a station of `layers` layers; K/V [layers, rows, KVH, D]."""
    entries = _entries(msg.entries, max_entries, max_rows)
    k, v = kv_rows_from_proto(msg.k, msg.v, dtype=dtype, shape=(layers, wave_rows(entries), kv_heads, head_dim))
    return entries, k, v
