"""CUDA graphs of decode waves on a GPU station's torch path.

On a GPU the torch path is bound by the host: a 64-row decode wave of the bench preset is ~800 small kernels, each
launched from Python (~15 us apiece on session 27's H200 host, 16 ms a wave for well under a millisecond of device
work). A wave whose rows are all decode rows over the same number of KV blocks (WaveAttention's one-group wave, what
a steady decode wave is) has every shape set by (rows, blocks) alone. Such a wave's layers are recorded once per
(rows, blocks) into a CUDA graph and replayed after: the wave's inputs (hidden rows, positions, KV slots, block
tables, key mask) are copied into the graph's own input tensors, one replay launches every kernel, and the output
is copied out. A replay runs the kernels its capture recorded, the eager path's own for that shape, so a row's bits
do not change (bench/device_check.sh's `graphs` part compares them on the device). Every other wave, and the
embedding, the final norm, the head and sampling, run eagerly as before.

The graphs share one memory pool: replays never overlap (a station computes one wave at a time, on its compute
thread), and what outlives a replay (the input tensors and the output, copied out) is held outside it.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from station.kv import KVPool
from station.wave_attention import WaveAttention

log = logging.getLogger(__name__)
LayersFn = Callable[[torch.Tensor, torch.Tensor, WaveAttention], torch.Tensor]  # (hidden, positions, ctx) -> hidden


@dataclass(slots=True)
class _Recorded:
    """One (rows, blocks) shape: its input tensors, the context over them, its output, and its graph (None: the
    shape is replayed by running the layers on the input tensors, where no graph can be captured)."""

    hidden: torch.Tensor  # [T, d]
    positions: torch.Tensor  # [T]
    blocks: torch.Tensor  # [T]
    offsets: torch.Tensor  # [T]
    tables: torch.Tensor  # [T, nb]
    masked: torch.Tensor  # [T, 1, 1, nb * block_tokens]
    ctx: WaveAttention
    out: torch.Tensor | None = None  # [T, d]
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """A station's recorded decode waves, by (rows, KV blocks): `run` replays the one a wave's shape names."""

    def __init__(self, layers: LayersFn, kv: KVPool, first_layer: int, device: torch.device, max_graphs: int = 64,
                 capture: bool | None = None) -> None:
        """`layers(hidden, positions, ctx)`: the station's held layers (LlamaRange.forward); `max_graphs`: shapes kept
        (the least recently replayed dropped beyond it); `capture`: record CUDA graphs (default: on a CUDA device;
        False runs the same input tensors eagerly, which is how the CPU tests check this class's plumbing)."""
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self._layers, self.kv, self.first_layer, self.device = layers, kv, first_layer, device
        self.capture = device.type == "cuda" if capture is None else capture
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._max = max_graphs
        self._recorded: OrderedDict[tuple[int, int], _Recorded] = OrderedDict()
        self.captures = self.replays = 0  # counters (benchmarks and tests read them)
        self.failed: str | None = None  # why capturing failed (the station then runs every wave eagerly)

    def __len__(self) -> int:
        return len(self._recorded)

    def run(self, ctx: WaveAttention, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The held layers' output [T, d] for a one-group decode wave (`ctx.whole`), by replay; None for any other
        wave, or after a capture failed (the caller runs it eagerly). hidden [T, d], positions [T]: the wave's input
        rows and positions."""
        if not ctx.whole or self.failed is not None:
            return None
        _, tables, masked = ctx.decode_groups[0]
        key = (hidden.shape[0], tables.shape[1])
        rec = self._recorded.get(key)
        fresh = rec is None
        if fresh:
            try:
                rec = self._record(key, hidden, positions, ctx, tables, masked)
            except RuntimeError as err:  # a capture the device refused: this station runs eagerly from now on
                log.warning("CUDA graphs off for this station: capturing a %d-row, %d-block decode wave failed: %s",
                            *key, err)
                self.failed = f"{type(err).__name__}: {err}"
                self._recorded.clear()
                return None
        else:
            self._recorded.move_to_end(key)
            for dst, src in ((rec.hidden, hidden), (rec.positions, positions), (rec.blocks, ctx.blocks),
                             (rec.offsets, ctx.offsets), (rec.tables, tables), (rec.masked, masked)):
                dst.copy_(src)
        if rec.graph is not None:
            if not fresh:  # a fresh capture's warm-up already ran this wave (its KV writes are the same again)
                rec.graph.replay()
            self.replays += 1
        else:
            rec.out = self._layers(rec.hidden, rec.positions, rec.ctx)
        return rec.out.clone()  # the next replay overwrites rec.out

    def _record(self, key: tuple[int, int], hidden: torch.Tensor, positions: torch.Tensor, ctx: WaveAttention,
                tables: torch.Tensor, masked: torch.Tensor) -> _Recorded:
        """Input tensors for the shape `key`, filled with this wave's, and (capturing) its graph; the wave itself
        runs once in the warm-up, so its output is in `out`."""
        while len(self._recorded) >= self._max:
            self._recorded.popitem(last=False)
        rec = _Recorded(hidden.clone(), positions.clone(), ctx.blocks.clone(), ctx.offsets.clone(), tables.clone(),
                        masked.clone(), ctx)
        rec.ctx = WaveAttention.one_group(self.kv, self.first_layer, rec.blocks, rec.offsets, rec.tables, rec.masked)
        if self.capture:
            side, main = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):  # warm-up off the capture (lazy initialisations, cuBLAS handles)
                warm = self._layers(rec.hidden, rec.positions, rec.ctx)
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the station's other threads may copy an earlier wave's rows off the GPU meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                rec.out = self._layers(rec.hidden, rec.positions, rec.ctx)
            rec.out.copy_(warm)  # capture records without running: this wave's output is the warm-up's
            rec.graph = graph
            self.captures += 1
        self._recorded[key] = rec
        return rec
