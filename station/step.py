"""One station: a layer range, its KV, and the batched step over a ragged wave.

A wave is K entries (seq_id, start_pos, n_tokens), prompt chunks and decode
tokens together, T rows in all. Every linear layer runs once over all T rows
(one weight read per wave); attention runs per sequence against its own KV:
decode rows (n == 1) batched by key length, prompt chunks one by one. A row's
result never depends on the rest of its wave (station/wave_attention.py, mesh.core.model.kernels).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mesh.core.compute import on_compute_thread
from mesh.core.config import ModelConfig, StationSpec
from mesh.core.model.fused import fuse_layers
from mesh.core.model.gguf_file import is_gguf
from mesh.core.model.kernels import resolve_linear_backend, use_linear_backend
from mesh.core.model.loader import TORCH_DTYPES, load_range
from mesh.core.model.packed import PackedLoad
from mesh.core.model.packed_cache import PackedCache
from mesh.core.sampling import sample_tokens
from mesh.core.wave import KVUsage, StationOutput, WaveEntry, decode_step_entries, decode_steps_problem, wave_rows
from station.decode_graphs import DecodeGraphs
from station.kv import DEFAULT_BLOCK_TOKENS, KVPool, KVStats, StepError
from station.kv_copy import export_rows, import_rows
from station.native_attention import NativeWaveAttention
from station.timeline import StepTimeline
from station.wave_attention import WaveAttention


PROBE_SEQ_ID = 2**64  # one past the wire's largest seq_id (uint64): no client sequence can be the probe


@dataclass(frozen=True, slots=True)
class StationStats:
    """Counters of one station since it started, and its KV occupancy."""

    layers: tuple[int, int]
    forwards: int
    rows: int
    prefill_seconds: float
    decode_seconds: float
    kv: KVStats
    load_seconds: float = 0.0  # the weights' load and set-up, and the KV pool's
    packed_mapped: int = 0  # layers (and head) whose packed weights were mapped from the packed cache
    packed_at_load: int = 0  # ... and those packed at the load
    graph_waves: int = 0  # decode waves replayed from CUDA graphs (station.decode_graphs; 0 off CUDA)
    graph_captures: int = 0  # CUDA graphs captured (one per whole-wave shape, one per piece of a row count)


class Station:
    """Layers [start, end) of a checkpoint, their KV, and the batched wave step.

    Loading, steps, probes and releases all run on the process's compute thread
    (mesh.core.compute), whichever thread calls them.
    """

    steps_on_compute_thread = True  # so a relay chain's decode steps queue there (station.station_lock's `queued`)

    def __init__(self, model_dir: str | Path, spec: StationSpec, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        self.model_dir = Path(model_dir)
        self.config = ModelConfig.from_dir(model_dir)
        spec.check_against(self.config)
        self.spec = spec
        self.device = torch.device(spec.device)
        self.dtype = TORCH_DTYPES[spec.dtype]
        on_compute_thread(self._load, block_tokens)
        self._forwards = self._rows = 0
        self._kv_changes = 0  # forwards and releases applied: orders the KV reports (KVUsage.changes)
        self._seconds = {"prefill": 0.0, "decode": 0.0}
        self.timeline = StepTimeline()  # the last steps on the wall clock (a benchmark's idle breakdown)

    def _load(self, block_tokens: int) -> None:
        started = time.perf_counter()
        spec = self.spec
        backend = resolve_linear_backend(spec.linear_backend, self.device, self.dtype)
        self.model, self.load_report = load_range(self.model_dir, self.config, spec.start, spec.end, spec.dtype,
                                                  spec.device, for_packed=backend == "packed")
        cache = (PackedCache.for_gguf(spec.packed_cache, self.model_dir)
                 if backend == "packed" and spec.packed_cache and is_gguf(self.model_dir) else None)
        self.packed_cache_dir = None if cache is None else cache.directory
        setup = use_linear_backend(self.model, backend, self.device, self.dtype, packed_cache=cache,
                                   huge_pages=spec.huge_pages)
        self.linear_backend, self.packed_load = setup.backend, setup.packed or PackedLoad()
        self.fused = fuse_layers(self.model)  # every layer in one native call where all run the packed kernels
        self.kv = KVPool(self.config, spec, block_tokens)
        # decode waves replayed as CUDA graphs (station.decode_graphs) on a CUDA device, unless the spec says eager
        self.graphs = (DecodeGraphs(self.model, self.kv, self.device)
                       if self.device.type == "cuda" and spec.cuda_graphs else None)
        self.load_seconds = time.perf_counter() - started

    @property
    def is_first(self) -> bool:
        """Takes token ids (holds the embedding)."""
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        """Returns sampled tokens (holds norm and lm_head)."""
        return self.model.is_last

    def forward(self, entries: tuple[WaveEntry, ...], token_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, want_logits: bool = False, steps: int = 1,
                rows_out: torch.Tensor | None = None) -> StationOutput:
        """Advance every entry of the wave by its rows; raises StepError on a malformed wave, KVBudgetError when full.

        The first station takes token_ids [T], later ones hidden [T, d]. The last station samples one token
        for each entry with `sample` set (and returns those rows' logits when `want_logits`). `steps` > 1
        (a station holding every layer, 1-token entries that all sample) runs that many decode steps, each
        feeding back the tokens the last drew; samples are then step-major, steps x entries. `rows_out`: a CPU
        tensor [T, d] of the station's dtype where a station before the last puts its output rows (its successor's
        shared-memory segment: station.relay_link_client.Announced.rows_space); the output is then that tensor.
        """
        if rows_out is not None and (problem := self._rows_out_problem(rows_out, entries, steps)) is not None:
            raise StepError(problem)
        if steps > 1:
            return on_compute_thread(self._forward_steps, entries, token_ids, hidden, steps)
        return on_compute_thread(self._forward, entries, token_ids, hidden, want_logits, rows_out)

    def _rows_out_problem(self, rows_out: torch.Tensor, entries: tuple[WaveEntry, ...], steps: int) -> str | None:
        """What is wrong with `rows_out` as this step's output rows (None: nothing)."""
        if self.is_last:
            return "rows_out: the last station samples; it puts out no rows"
        if steps > 1:
            return "rows_out: several decode steps return samples, not rows"
        want = (wave_rows(entries), self.config.hidden_size)
        if tuple(rows_out.shape) != want or rows_out.dtype != self.dtype or rows_out.device.type != "cpu":
            return (f"rows_out: expected a CPU {self.spec.dtype} {list(want)} tensor, got "
                    f"{rows_out.device.type} {str(rows_out.dtype).removeprefix('torch.')} {list(rows_out.shape)}")
        return None

    def _forward_steps(self, entries: tuple[WaveEntry, ...], token_ids: torch.Tensor | None,
                       hidden: torch.Tensor | None, steps: int) -> StationOutput:
        if not (self.is_first and self.is_last):
            raise StepError(f"steps: {steps} decode steps need a station holding every layer; this one holds "
                            f"[{self.spec.start}, {self.spec.end})")
        bt = self.kv.block_tokens
        if (problem := decode_steps_problem(entries, steps, bt)) is not None:
            raise StepError(problem)
        held = {e.seq_id: self.kv.length(e.seq_id) for e in entries}
        samples, seconds = [], 0.0
        try:
            for k in range(steps):
                out = self._forward(decode_step_entries(entries, k, bt), token_ids, hidden, False)
                samples.extend(out.samples)
                seconds += out.seconds
                token_ids = torch.tensor([t.token_id for t in out.samples], dtype=torch.long)  # [K]
        except BaseException:
            for seq_id, length in held.items():  # all or nothing: the caller sees one failed wave
                self.kv.truncate(seq_id, length)
            raise
        return StationOutput(None, samples, seconds)

    def _forward(self, entries: tuple[WaveEntry, ...], token_ids: torch.Tensor | None, hidden: torch.Tensor | None,
                 want_logits: bool, rows_out: torch.Tensor | None = None) -> StationOutput:
        wall, t0 = time.time(), time.perf_counter()
        x = self._validate(entries, token_ids, hidden)
        with self.kv.growing(entries), torch.inference_mode():
            out = self._compute(entries, x, want_logits, rows_out)
            if rows_out is not None and out[0] is not rows_out:
                rows_out.copy_(out[0])  # [T, d] into the successor's shared memory (from a GPU: its copy to the host)
                out = (rows_out, None, None)
        seconds = time.perf_counter() - t0
        self._forwards += 1
        self._kv_changes += 1
        self._rows += x.shape[0]
        self._seconds["decode" if all(e.n_tokens == 1 for e in entries) else "prefill"] += seconds
        self.timeline.record(wall, seconds, x.shape[0], len(entries))
        return StationOutput(out[0], out[1], seconds, out[2])

    def _compute(self, entries: tuple[WaveEntry, ...], x: torch.Tensor, want_logits: bool,
                 rows_out: torch.Tensor | None = None):
        if self.linear_backend == "packed":  # the native float32 kernels (mesh.core.model.kernels)
            ctx = NativeWaveAttention(self.kv, self.spec.start, entries, self.config.sliding_window)
            positions = ctx.row_pos  # [T], int64
        else:
            ctx = WaveAttention(self.kv, self.spec.start, entries, self.device, self.config.sliding_window)
            positions = torch.tensor([p for e in entries for p in range(e.start_pos, e.end_pos)],
                                     device=self.device)  # [T], int64
        if self.fused is not None and isinstance(ctx, NativeWaveAttention):
            # the rows computed where they go on (rows_out: the successor's shared memory), the embedding's in place
            hidden = self.model.embed(x, rows_out) if self.is_first else x  # [T, d]
            hidden = ctx.run_layers(self.fused, hidden, out=hidden if self.is_first else rows_out)  # one C call
            return self._head(entries, hidden, want_logits)
        hidden = self.model.embed(x) if self.is_first else x  # [T, d]
        if self.graphs is not None and (replayed := self.graphs.run(ctx, hidden, positions)) is not None:
            hidden = replayed  # [T, d], the eager kernels' bits from one graph replay
        else:
            hidden = self.model(hidden, positions, ctx)  # [T, d]
        return self._head(entries, hidden, want_logits)

    def _head(self, entries: tuple[WaveEntry, ...], hidden: torch.Tensor, want_logits: bool):
        """(hidden, None, None) from a station before the last; the last one's (None, samples, logits or None)."""
        if not self.is_last:
            return hidden, None, None
        last_rows, params, token_pos = [], [], []
        row = 0
        for e in entries:
            row += e.n_tokens
            if e.sample is not None:
                last_rows.append(row - 1)
                params.append(e.sample)
                token_pos.append(e.end_pos)
        drawn, logits = iter(()), None
        if last_rows:
            if len(last_rows) < hidden.shape[0]:  # else every row samples (a decode step): no gather
                hidden = hidden[torch.tensor(last_rows, device=self.device)]  # [R, d]
            logits = self.model.logits(hidden)  # [R, V]
            drawn = iter(sample_tokens(logits, params, token_pos))
        samples = [next(drawn) if e.sample is not None else None for e in entries]
        return None, samples, (logits if want_logits else None)

    def _validate(self, entries: tuple[WaveEntry, ...], token_ids: torch.Tensor | None,
                  hidden: torch.Tensor | None) -> torch.Tensor:
        self.kv.check_wave(entries, self.config.max_position_embeddings)
        rows = wave_rows(entries)
        if self.is_first:
            if token_ids is None or hidden is not None:
                raise StepError("token_ids: the first station takes token ids, not hidden rows")
            if token_ids.dtype not in (torch.int64, torch.int32) or tuple(token_ids.shape) != (rows,):
                raise StepError(f"token_ids: expected int64 [{rows}], got {token_ids.dtype} {list(token_ids.shape)}")
            ids = token_ids.tolist()  # one call, not a reduction or two: a decode step's rows are few
            if rows and (min(ids) < 0 or max(ids) >= self.config.vocab_size):
                raise StepError(f"token_ids: ids must lie in [0, {self.config.vocab_size})")
            if token_ids.dtype == torch.long and token_ids.device == self.device:
                return token_ids
            return token_ids.to(self.device, torch.long)
        if hidden is None or token_ids is not None:
            raise StepError(f"hidden: station [{self.spec.start}, {self.spec.end}) takes hidden rows, not token ids")
        want = (rows, self.config.hidden_size)
        if tuple(hidden.shape) != want or hidden.dtype != self.dtype:
            raise StepError(f"hidden: expected {self.spec.dtype} {list(want)}, got "
                            f"{str(hidden.dtype).removeprefix('torch.')} {list(hidden.shape)}")
        return hidden.to(self.device)

    @property
    def prefill_chunk_invariant(self) -> bool:
        """A prompt's KV has the same bits in one chunk or several (the native kernels' fixed per-row order),
        so cached prefix blocks can stand in for a cold prefill without changing a token."""
        return self.linear_backend == "packed"

    def probe(self) -> None:
        """Run one throwaway row through every layer (the health check's proof that the forward path works),
        on the KV pool's spare block: it takes nothing from the budget and leaves no KV and no counters."""
        on_compute_thread(self._probe)

    def _probe(self) -> None:
        x = (torch.zeros(1, dtype=torch.long) if self.is_first
             else torch.zeros(1, self.config.hidden_size, dtype=self.dtype)).to(self.device)  # [1] or [1, d]
        with self.kv.spare(PROBE_SEQ_ID), torch.inference_mode():
            self._compute((WaveEntry(PROBE_SEQ_ID, 0, 1),), x, want_logits=False)

    def export_kv(self, entries: tuple[WaveEntry, ...], layer_start: int,
                  layer_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start_pos, end_pos) of each entry's resident sequence in model layers
        [layer_start, layer_end): each [layers, rows, KVH, D] (station.kv_copy); StepError when not held."""
        return on_compute_thread(export_rows, self, entries, layer_start, layer_end)

    def import_kv(self, entries: tuple[WaveEntry, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [this station's layers, rows, KVH, D] copied from other stations at the entries' positions,
        as a Forward of those entries would have (checked the same way)."""
        on_compute_thread(self._import_kv, entries, k, v)

    def _import_kv(self, entries: tuple[WaveEntry, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        import_rows(self, entries, k, v)
        self._kv_changes += 1

    def release(self, seq_ids: list[int] | tuple[int, ...]) -> int:
        """Free the KV of these sequences; returns how many were resident."""
        return on_compute_thread(self._release, seq_ids)

    def _release(self, seq_ids: list[int] | tuple[int, ...]) -> int:
        released = sum(self.kv.release(s) for s in seq_ids)
        self._kv_changes += 1
        return released

    def kv_usage(self) -> KVUsage:
        """KV occupancy now, numbered by the forwards and releases applied so far (sent with every reply)."""
        s = self.kv.stats()
        return KVUsage(s.bytes_used, s.blocks_used, s.sequences, self._kv_changes)

    def stats(self) -> StationStats:
        """Counters and KV occupancy."""
        graphs = self.graphs
        return StationStats(self.spec.layers, self._forwards, self._rows, self._seconds["prefill"],
                            self._seconds["decode"], self.kv.stats(), self.load_seconds,
                            len(self.packed_load.mapped), len(self.packed_load.packed),
                            graph_waves=graphs.replays if graphs is not None else 0,
                            graph_captures=graphs.captures if graphs is not None else 0)

