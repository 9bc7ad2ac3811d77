"""What a 2-stage pipeline can reach on this machine, measured without the network: the ceiling
behind `mesh bench mesh`'s pipelined figure.

    python bench/pipeline_ceiling.py [--model DIR] [--split A] [--rows 16] [--steps 12] [--whole-threads N]
    mesh bench pipeline_ceiling ...  (same arguments)

(1) Step times alone, in this process: the whole model at --rows decode rows on every core (or
--whole-threads; `--rows 32 --whole-threads 1 --split 8` is issue 13's core quota, one 1-core station
against two 1-core stations splitting the bench preset as `balance: compute` does), and
each half of the split [0, A) [A, L) at rows/2 on one thread (a pipeline of two halves a group of
--rows sequences into two waves). Ceiling = whole / (2 x slower half): the ratio two perfectly
overlapped 1-thread stages would reach against that one station.
(2) Memory contention: one thread multiplying by 24 decode-shaped weight matrices (too big for the
cache) alone, then in two processes at once, then with one cached matrix: the cost of two stages
streaming weights from one memory bus. The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


import torch

from mesh.control.cli import resolve_model
from mesh.core.compute import on_compute_thread
from mesh.core.config import ModelConfig, StationSpec
from mesh.core.hostinfo import describe_machine
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.step import Station

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
STREAM = """
import sys, time, torch
torch.set_num_threads(1)
op = torch.ops.mkldnn._linear_pointwise
ws = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(2048, 768), 16) for _ in range(int(sys.argv[2]))]
x = torch.randn(int(sys.argv[1]), 768)
for _ in range(10):
    for w in ws: op(x, w, None, 'none', [], '')
t, n = time.perf_counter(), 200
for _ in range(n):
    for w in ws: op(x, w, None, 'none', [], '')
print((time.perf_counter() - t) / n / len(ws) * 1e6)
"""


def step_ms(model_dir: Path, layers: tuple[int, int], rows: int, threads: int, steps: int) -> float:
    """Median ms of a decode step of `rows` sequences (32-token context) through `layers`."""
    on_compute_thread(torch.set_num_threads, threads)
    st = Station(model_dir, StationSpec(layers=layers))
    sample = GREEDY if st.is_last else None

    def rows_in(n: int) -> dict:
        if st.is_first:
            return {"token_ids": torch.randint(3, st.config.vocab_size, (n,))}
        return {"hidden": torch.randn(n, st.config.hidden_size)}

    st.forward(tuple(WaveEntry(i, 0, 32, sample) for i in range(rows)), **rows_in(32 * rows))
    times = []
    for pos in range(32, 32 + steps):
        times.append(st.forward(tuple(WaveEntry(i, pos, 1, sample) for i in range(rows)), **rows_in(rows)).seconds)
    return statistics.median(times) * 1e3


def linear_us(rows: int, matrices: int, copies: int) -> list[float]:
    """us per decode-shaped matmul on one thread, in `copies` processes at once."""
    procs = [subprocess.Popen([sys.executable, "-c", STREAM, str(rows), str(matrices)], stdout=subprocess.PIPE,
                              text=True) for _ in range(copies)]
    return [float(p.communicate(timeout=600)[0]) for p in procs]


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table, end with one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF checkpoint dir (default: the built-in `bench` preset)")
    p.add_argument("--split", type=int, help="first layer of the second stage (default: half)")
    p.add_argument("--rows", type=int, default=16, help="concurrent sequences")
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per measurement")
    p.add_argument("--whole-threads", type=int, help="threads of the whole-model station (default: every core; 1 is "
                   "the core quota's lone 1-core station against two 1-core stages)")
    args = p.parse_args(argv)
    model_dir = resolve_model(args.model, "bench")
    layers = ModelConfig.from_dir(model_dir).num_hidden_layers
    split = args.split or layers // 2
    cores = os.cpu_count() or 1
    whole_threads = args.whole_threads or cores
    whole = step_ms(model_dir, (0, layers), args.rows, whole_threads, args.steps)
    halves = [step_ms(model_dir, r, args.rows // 2, 1, args.steps) for r in ((0, split), (split, layers))]
    ceiling = whole / (2 * max(halves))
    streamed_alone = linear_us(max(2, args.rows // 2), 24, 1)[0]
    streamed_two = statistics.mean(linear_us(max(2, args.rows // 2), 24, 2))
    cached = linear_us(max(2, args.rows // 2), 1, 1)[0]
    print(f"whole model, {args.rows} rows, {whole_threads} threads: {whole:.2f} ms/step")
    print(f"[0,{split}) and [{split},{layers}), {args.rows // 2} rows, 1 thread each, alone: "
          f"{halves[0]:.2f} / {halves[1]:.2f} ms/step")
    print(f"ceiling of two perfectly overlapped stages vs the whole: {ceiling:.2f}x")
    print(f"one thread, 2048x768 matmul at {max(2, args.rows // 2)} rows: {streamed_alone:.0f} us streaming 24 "
          f"matrices alone, {streamed_two:.0f} us with a second process doing the same, {cached:.0f} us cached")
    mach = describe_machine()
    print(f"machine: {mach['cpu']}, {mach['cores']} cores, torch {mach['torch']}, load {mach['loadavg_1m']}")
    print(json.dumps({"whole_ms": whole, "whole_threads": whole_threads, "halves_ms": halves, "split": split, "rows": args.rows,
                      "ceiling": ceiling, "linear_us": {"streamed_alone": streamed_alone,
                                                        "streamed_two_processes": streamed_two,
                                                        "cached": cached}, "machine": mach}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
