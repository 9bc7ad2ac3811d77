"""SIMULATED GPU-speed station for `mesh bench scale` (issue 13 item 4): a benchmark mode, never a serving mode.

A SimulatedStation stands where station.step.Station stands behind the real gRPC server (station/server.py):
the wire, the token check, decode and validation of real-size payloads, relays and the KV reports are the
real code. Only the step is modelled: a station holding a fraction f of the layers sleeps f * T * max(1, rows /
K) (T: the whole model's wave at K rows), returns hidden rows of the model's width and dtype, and the last
station returns one sampled id per entry (a fixed function of sequence and position). Its KV bookkeeping
checks every entry's start position against what it holds, as a real station does.

Only this file (bench/) builds one; nothing in the YAML or the serving CLI can. Each station runs in its own
process (`python bench/sim_station.py ...`), prints its address on one line, and serves until stdin closes.
"""
from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from mesh.core.config import StationSpec
from mesh.core.wave import KVUsage, SampledToken, StationOutput, WaveEntry, wave_rows
from station.kv import KVStats
from station.step import StationStats, StepError

BLOCK_TOKENS = 16


class ModelledWait:
    """Waits out a modelled step so that it lasts its modelled time on average: a plain sleep wakes late (the
    kernel's timer slack and the wake-up: a 16 ms sleep 0.17 ms late on this project's VMs at rest, more under load;
    bench/out/bench_scale_sim_s33.txt part 8), which would make every SIMULATED station slower than its model says,
    the more so the more stations a wave passes.
    Each wait sleeps the modelled time less the lateness learned from the waits before it (a running average,
    never more than `max_early_s`); nothing spins."""

    def __init__(self, gain: float = 0.1, max_early_s: float = 0.001, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._gain = gain
        self._max_early_s = max_early_s
        self._early_s = 0.0
        self._sleep = sleep
        self._clock = clock

    def wait(self, seconds: float, work: Callable[[], object] | None = None) -> float:
        """Sleep about `seconds`, counted from before `work()` (what the modelled device does meanwhile, run first);
        returns how long it took."""
        start = self._clock()
        if work is not None:
            work()
        if seconds > 0:
            self._sleep(max(0.0, seconds - self._early_s - (self._clock() - start)))
        took = self._clock() - start
        if seconds > 0:
            self._early_s = min(self._max_early_s, max(0.0, self._early_s + self._gain * (took - seconds)))
        return took


def fine_timer_slack() -> None:
    """Wake this process's sleeps within a microsecond of their deadline rather than the kernel's default 50 us
    (Linux prctl PR_SET_TIMERSLACK; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class SimModel:
    """The SIMULATED model: layers, width, vocabulary, and the whole model's wave time `wave_s` at `k_rows` rows."""

    num_layers: int = 80
    hidden_size: int = 8192
    vocab_size: int = 128256
    dtype: str = "bfloat16"
    wave_s: float = 0.064
    k_rows: int = 64

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "vocab_size", "k_rows"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):
                raise ValueError(f"SimModel.{name} must be a positive integer, got {getattr(self, name)!r}")
        if not (self.wave_s >= 0 and math.isfinite(self.wave_s)):
            raise ValueError(f"SimModel.wave_s must be a finite number >= 0, got {self.wave_s!r}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"SimModel.dtype: {self.dtype!r} is not a hidden-row dtype")

    def station_seconds(self, layers: int, rows: int) -> float:
        """The modelled step of a station holding `layers` layers on a wave of `rows` rows."""
        return self.wave_s * layers / self.num_layers * max(1.0, rows / self.k_rows)

    def hop_bytes(self, rows: int) -> int:
        """Hidden-row bytes of one hop for a wave of `rows` rows."""
        return rows * self.hidden_size * torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()


class SimulatedStation:
    """What the gRPC servicer needs of a station, with the step replaced by a sleep (SIMULATED)."""

    steps_on_compute_thread = False  # the modelled step sleeps on the calling thread

    def __init__(self, model: SimModel, layers: tuple[int, int], kv_blocks: int = 1 << 20) -> None:
        self.sim = model
        self.spec = StationSpec(layers=layers, dtype=model.dtype, relay_part_rows=0)  # a GPU model: whole waves
        self.config = SimpleNamespace(hidden_size=model.hidden_size, vocab_size=model.vocab_size,
                                      num_hidden_layers=model.num_layers,
                                      num_key_value_heads=0, head_dim=0)  # holds no KV: nothing to copy
        self.model_dir = Path(f"SIMULATED-{model.num_layers}L-{model.hidden_size}")
        self.prefill_chunk_invariant = False  # no prefix cache over a simulation: every prompt is computed
        self._dtype = getattr(torch, model.dtype)
        self._rows = torch.zeros(0, model.hidden_size, dtype=self._dtype)  # [R, d], grown on demand
        self._lengths: dict[int, int] = {}
        self._kv_blocks = kv_blocks
        self._changes = self._forwards = self._row_count = 0
        self._seconds = 0.0
        self._lock = threading.Lock()
        self._wait = ModelledWait()

    def forward(self, entries: tuple[WaveEntry, ...], token_ids=None, hidden=None, steps: int = 1,
                rows_out: torch.Tensor | None = None) -> StationOutput:
        """Check positions, sleep the modelled step, return rows (or, at the last station, one id per entry);
        `steps` decode steps (a station holding every layer) one after another, samples step-major. `rows_out`:
        where the rows go (the successor's shared memory), written within the modelled step, as a GPU's copy into a
        pinned host segment is the device's work (its ~40 us over PCIe for 1 MiB is not modelled, as it was not
        when the rows came back as a tensor to be copied in)."""
        if steps == 1:
            return self._step(entries, rows_out)
        if rows_out is not None:
            raise StepError("rows_out: several decode steps return samples, not rows")
        if self.spec.start != 0 or self.spec.end < self.sim.num_layers:
            raise StepError(f"steps: {steps} decode steps need a station holding every layer")
        outs = [self._step(tuple(replace(e, start_pos=e.start_pos + k) for e in entries)) for k in range(steps)]
        return StationOutput(None, [t for out in outs for t in out.samples], sum(out.seconds for out in outs))

    def _step(self, entries: tuple[WaveEntry, ...], rows_out: torch.Tensor | None = None) -> StationOutput:
        rows, last = wave_rows(entries), self.spec.end >= self.sim.num_layers
        for e in entries:
            held = self._lengths.get(e.seq_id, 0)
            if e.start_pos != held:
                raise StepError(f"seq {e.seq_id}: start_pos {e.start_pos} but the station holds {held} positions")
        if rows_out is not None and (last or tuple(rows_out.shape) != (rows, self.sim.hidden_size)
                                     or rows_out.dtype != self._dtype):
            raise StepError(f"rows_out: {list(rows_out.shape)} {rows_out.dtype} is not this step's rows")
        if not last and self._rows.shape[0] < rows:
            self._rows = torch.full((rows, self.sim.hidden_size), 0.5, dtype=self._dtype)
        seconds = self.sim.station_seconds(self.spec.end - self.spec.start, rows)
        self._wait.wait(seconds, None if rows_out is None else lambda: rows_out.copy_(self._rows[:rows]))
        for e in entries:
            self._lengths[e.seq_id] = e.start_pos + e.n_tokens
        self._changes += 1
        self._forwards += 1
        self._row_count += rows
        self._seconds += seconds
        if not last:
            return StationOutput(self._rows[:rows] if rows_out is None else rows_out, None, seconds)  # [T, d]
        samples = [SampledToken((e.seq_id * 7919 + e.start_pos) % self.sim.vocab_size) if e.sample else None
                   for e in entries]
        return StationOutput(None, samples, seconds)

    def release(self, seq_ids) -> int:
        """Forget these sequences' positions."""
        released = sum(self._lengths.pop(s, None) is not None for s in seq_ids)
        self._changes += 1
        return released

    def kv_usage(self) -> KVUsage:
        """Blocks the held positions would take (no memory behind them)."""
        blocks = sum(-(-n // BLOCK_TOKENS) for n in self._lengths.values())
        return KVUsage(blocks * 1024, blocks, len(self._lengths), self._changes)

    def stats(self) -> StationStats:
        """Counters and the modelled KV."""
        u = self.kv_usage()
        kv = KVStats(u.bytes_used, self._kv_blocks * 1024, u.blocks_used, self._kv_blocks, BLOCK_TOKENS, u.sequences)
        return StationStats(self.spec.layers, self._forwards, self._row_count, 0.0, self._seconds, kv)

    def probe(self) -> None:
        """Nothing to prove: the simulated step cannot fail."""


def main(argv: list[str] | None = None) -> int:
    """Serve one SIMULATED station (or, with --model, a real one) until stdin closes; print its address first."""
    p = argparse.ArgumentParser(description="one SIMULATED station server for bench/scale.py")
    p.add_argument("--layers", required=True, help="A-B")
    p.add_argument("--token", required=True)
    p.add_argument("--workers", type=int, default=24)
    p.add_argument("--wave-ms", type=float, default=64.0)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--num-layers", type=int, default=80)
    p.add_argument("--model", help="real compute: a checkpoint dir (the station loads it), not a simulation")
    p.add_argument("--threads", type=int, default=1, help="torch threads of a real station")
    p.add_argument("--device", default="cpu", help="a real station's device (cpu, cuda, cuda:1, ...)")
    p.add_argument("--dtype", default="float32", help="a real station's dtype (float32, bfloat16, float16)")
    p.add_argument("--cpus", type=int, default=0,
                   help="a real station claims and pins this many whole cores among the claims in --claim-dir (0: none)")
    p.add_argument("--claim-dir", help="the core-claim folder the stations of one run share")
    p.add_argument("--no-relay-link", action="store_true", help="relays as gRPC Forward calls (for comparison)")
    p.add_argument("--no-relay-shm", action="store_true",
                   help="relay-link rows by TCP even where stations share a host (for comparison)")
    args = p.parse_args(argv)
    from mesh.core.compute import on_compute_thread
    from mesh.core.long_lived import freeze_long_lived
    from station.server import ServerLimits, start_server

    a, b = (int(x) for x in args.layers.split("-"))
    if args.model:
        from station.step import Station

        if args.cpus:
            from station.cores import claim_cores

            placement = claim_cores(args.cpus, args.claim_dir)
            if not placement.pinned:
                print(f"station {args.layers}: {placement.reason}", file=sys.stderr, flush=True)
        on_compute_thread(torch.set_num_threads, args.threads)
        station = Station(args.model, StationSpec(layers=(a, b), device=args.device, dtype=args.dtype))
    else:
        fine_timer_slack()
        station = SimulatedStation(SimModel(num_layers=args.num_layers, hidden_size=args.hidden,
                                            wave_s=args.wave_ms / 1000), (a, b))
    limits = ServerLimits(max_workers=args.workers, max_pending=args.workers // 2)
    server = start_server(station, limits=limits, token=args.token, relay_link=not args.no_relay_link,
                          relay_shm=not args.no_relay_shm)
    freeze_long_lived()  # as a station actor does once it serves (station/actor.py)
    print(server.address, flush=True)
    sys.stdin.read()  # serve until the benchmark closes our stdin (or dies)
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
