"""CUDA graphs of decode waves on a GPU station's torch path.

On a GPU the torch path is bound by the host: a 64-row decode wave of the bench preset is ~800 small kernels, each
launched from Python (~15 us apiece on session 27's H200 host, 16 ms a wave for well under a millisecond of device
work). Decode waves are recorded into CUDA graphs and replayed, in two ways:

- **whole**: a wave whose rows all span the same number of KV blocks (WaveAttention's one-group wave, e.g. one
  sequence, or a batch that started together) has every shape set by (rows, blocks). Its layers are one graph per
  (rows, blocks): the wave's inputs (hidden rows, positions, KV slots, block tables, key mask) are copied into the
  graph's own input tensors, one replay launches every kernel, and the output is copied out.
- **pieces**: any other decode wave (rows over several block counts, as continuous batching makes them) has the
  shapes of everything but attention set by its row count alone. The layers between attentions are graphs per row
  count (piece i: the end of layer i-1 and the start of layer i, up to q, k, v), and attention runs eagerly between
  replays, over the wave's own groups (station.wave_attention), its result copied into the next piece's input.

A replay runs the kernels its capture recorded, the eager path's own for those shapes, so a row's bits do not change
(bench/device_check.sh's `graphs` part compares them on the device). Waves with prompt chunks, and the embedding, the
final norm, the head and sampling, run eagerly as before. The graphs share one memory pool: replays never overlap (a
station computes one wave at a time, on its compute thread), and what a later replay reads (input tensors, each
piece's outputs, the output) is held for as long as its graphs are.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mesh.core.model.llama import LlamaRange, RopeRows, rope_cos_sin
from station.kv import KVPool
from station.wave_attention import WaveAttention

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Whole:
    """One (rows, blocks) shape of a one-group wave: its input tensors, the context over them, its output, its graph
    (None where nothing is captured: the layers then run on the input tensors)."""

    hidden: torch.Tensor  # [T, d]
    positions: torch.Tensor  # [T]
    blocks: torch.Tensor  # [T]
    offsets: torch.Tensor  # [T]
    tables: torch.Tensor  # [T, nb]
    masked: torch.Tensor  # [T, 1, 1, nb * block_tokens]
    ctx: WaveAttention
    out: torch.Tensor | None = None  # [T, d]
    graph: torch.cuda.CUDAGraph | None = None


@dataclass(slots=True)
class _Pieces:
    """One row count of the piecewise replay: input tensors, what each piece leaves for the next, and the graphs."""

    hidden: torch.Tensor  # [T, d]
    positions: torch.Tensor  # [T]
    attn: torch.Tensor | None = None  # [T, H, D]: the last attention's result, read by the next piece
    rope: RopeRows | None = None
    xs: list = field(default_factory=list)  # xs[i]: the rows after piece i (xs[0]: the input), [T, d] each
    qkv: list = field(default_factory=list)  # qkv[i]: layer i's q, k, v, left by piece i
    graphs: list = field(default_factory=list)  # one per piece ([] where nothing is captured)


class DecodeGraphs:
    """A station's recorded decode waves (whole by (rows, blocks), in pieces by rows): `run` replays a wave."""

    def __init__(self, model: LlamaRange, kv: KVPool, device: torch.device, max_graphs: int = 64,
                 capture: bool | None = None) -> None:
        """`model`: the station's layers; `max_graphs`: shapes kept (the least recently replayed dropped beyond
        it); `capture`: record CUDA graphs (default: on a CUDA device; False runs the same input tensors and pieces
        eagerly, which is how the CPU tests check this class's plumbing)."""
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.model, self.kv, self.device = model, kv, device
        self._layers = list(model.model.layers.values())  # DecoderLayer each, in order
        self.capture = device.type == "cuda" if capture is None else capture
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._max = max_graphs
        self._recorded: OrderedDict[tuple, _Whole | _Pieces] = OrderedDict()
        self.captures = self.replays = 0  # graphs captured, waves replayed (benchmarks and tests read them)
        self.failed: str | None = None  # why capturing failed (the station then runs every wave eagerly)

    def __len__(self) -> int:
        return len(self._recorded)

    def run(self, ctx: WaveAttention, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The held layers' output [T, d] for a decode wave, by replay; None for a wave with prompt chunks, or after
        a capture failed (the caller runs it eagerly). hidden [T, d], positions [T]: the wave's rows and positions."""
        if ctx.chunks or self.failed is not None:
            return None
        key = ("whole", hidden.shape[0], ctx.decode_groups[0][1].shape[1]) if ctx.whole else ("pieces", hidden.shape[0])
        rec = self._recorded.get(key)
        if rec is None:
            while len(self._recorded) >= self._max:
                self._recorded.popitem(last=False)
            try:
                rec, out = self._record_whole(hidden, positions, ctx) if ctx.whole else self._record_pieces(
                    hidden, positions, ctx)
            except RuntimeError as err:  # a capture the device refused: this station runs eagerly from now on
                log.warning("CUDA graphs off for this station: capturing a decode wave %s failed: %s", key, err)
                self.failed = f"{type(err).__name__}: {err}"
                self._recorded.clear()
                return None
            self._recorded[key] = rec
            return out  # the capture's warm-up ran this wave
        self._recorded.move_to_end(key)
        rec.hidden.copy_(hidden)
        rec.positions.copy_(positions)
        if isinstance(rec, _Pieces):
            return self._replay_pieces(rec, ctx)
        _, tables, masked = ctx.decode_groups[0]
        for dst, src in ((rec.blocks, ctx.blocks), (rec.offsets, ctx.offsets), (rec.tables, tables),
                         (rec.masked, masked)):
            dst.copy_(src)
        if rec.graph is None:
            rec.out = self.model(rec.hidden, rec.positions, rec.ctx)
        else:
            rec.graph.replay()
            self.replays += 1
        return rec.out.clone()  # the next replay overwrites rec.out

    def _record_whole(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: WaveAttention
                      ) -> tuple[_Whole, torch.Tensor]:
        """Input tensors for this wave's (rows, blocks), filled with its own, and (capturing) its graph; the wave
        runs once, as the warm-up, and its output comes back with the record."""
        _, tables, masked = ctx.decode_groups[0]
        rec = _Whole(hidden.clone(), positions.clone(), ctx.blocks.clone(), ctx.offsets.clone(), tables.clone(),
                     masked.clone(), ctx)
        rec.ctx = WaveAttention.one_group(self.kv, self.model.start, rec.blocks, rec.offsets, rec.tables, rec.masked)
        out = self._warm(lambda: self.model(rec.hidden, rec.positions, rec.ctx)).clone()
        if self.capture:
            rec.graph = self._graph(lambda: setattr(rec, "out", self.model(rec.hidden, rec.positions, rec.ctx)))
        return rec, out

    def _record_pieces(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: WaveAttention
                       ) -> tuple[_Pieces, torch.Tensor]:
        """Input tensors for this wave's row count and (capturing) one graph per piece; the wave runs once, its
        pieces eagerly with its attention between them (the warm-up), and its output comes back with the record."""
        rec = _Pieces(hidden.clone(), positions.clone())
        out = self._warm(lambda: self._run_pieces(rec, ctx)).clone()
        if self.capture:
            rec.graphs = [self._graph(lambda i=i: self._piece(rec, i)) for i in range(len(self._layers) + 1)]
        return rec, out

    def _replay_pieces(self, rec: _Pieces, ctx: WaveAttention) -> torch.Tensor:
        out = self._run_pieces(rec, ctx)
        self.replays += bool(rec.graphs)
        return out.clone()  # the next replay overwrites it

    def _run_pieces(self, rec: _Pieces, ctx: WaveAttention) -> torch.Tensor:
        """Every piece in turn (replayed where captured, else run), the wave's attention between them."""
        for i, layer in enumerate(self._layers):
            self._step_piece(rec, i)
            out = ctx.attend(layer.self_attn.layer, *rec.qkv[i])  # [T, H, D], eager: the wave's own groups
            if rec.attn is None:
                rec.attn = torch.empty_like(out)
            rec.attn.copy_(out)
        self._step_piece(rec, len(self._layers))
        return rec.xs[-1]

    def _step_piece(self, rec: _Pieces, i: int) -> None:
        if rec.graphs:
            rec.graphs[i].replay()
        else:
            self._piece(rec, i)

    def _piece(self, rec: _Pieces, i: int) -> None:
        """Piece i: the end of layer i-1 (from rec.attn, its attention's result) and layer i up to its q, k, v; piece
        0 makes the wave's rotary tables, and the last piece ends the last layer. Its outputs stay in rec."""
        layers = self._layers
        if i == 0:
            rec.rope = RopeRows.of(*rope_cos_sin(self.model.inv_freq, rec.positions, rec.hidden.dtype))
            x = rec.hidden
        else:
            x = layers[i - 1].after_attention(rec.xs[i - 1], rec.attn)  # [T, d]
        del rec.xs[i:], rec.qkv[i:]
        rec.xs.append(x)
        if i < len(layers):
            rec.qkv.append(layers[i].before_attention(x, rec.rope))

    def _warm(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """fn() on a side stream where capturing (lazy set-ups happen off the capture), else directly."""
        if not self.capture:
            return fn()
        side, main = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = fn()
        main.wait_stream(side)
        return out

    def _graph(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """fn recorded (not run) into a graph of the shared pool; fn leaves its outputs where replays will write."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: the station's other threads may copy an earlier wave's rows off the GPU meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            fn()
        self.captures += 1
        return graph
