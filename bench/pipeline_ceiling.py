"""What a 2-stage pipeline can reach on this machine, measured without the network: the ceiling
behind `mesh bench mesh`'s pipelined figure.

    python bench/pipeline_ceiling.py [--model DIR] [--split A] [--rows 16] [--steps 12] [--whole-threads N]
                                     [--[no-]contend] [--no-linears]
    mesh bench pipeline_ceiling ...  (same arguments)

(1) Step times, in this process: the whole model at --rows decode rows on every core (or --whole-threads;
`--rows 32 --whole-threads 1 --split 8` is issue 13's core quota, one 1-core station against two 1-core stations
splitting the bench preset as `balance: compute` does), and each half of the split [0, A) [A, L) at rows/2 on one
thread (a pipeline of two halves a group of --rows sequences into two waves), interleaved step by step over --steps
rounds (a whole step, each half's, a whole step again), so all meet the same hour: on a VM whose host slows a core
~2x for seconds at a time (the AMD Zen 3 type of session 52, bench/out/core_quota_s52.txt), steps timed one
measurement after another compare different phases. Ceiling = whole / (2 x slower half), per round (the mean of its
two whole steps), then the median: the ratio two perfectly overlapped 1-thread stages would reach against that one
station, were each stage's step as fast beside the other as alone. With --contend (the default at --whole-threads 1
where two cores are usable) each round also times each half while a second process pinned to the other core steps
the other half back to back, as a pipeline's other station does (it idles while the whole steps, as the lone
station's second core does): the contended ceiling, what two stages sharing this machine's caches and memory reach.
(2) Memory contention: one thread multiplying by 24 decode-shaped weight matrices (too big for the
cache) alone, then in two processes at once, then with one cached matrix: the cost of two stages
streaming weights from one memory bus (skipped with --no-linears, as `bench/core_quota.py --ceiling` runs it: ~15 s
of four subprocesses it does not read; its JSON's `linear_us` is then null). The last line printed is one JSON object
with every figure.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable


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


PROMPT = 32  # tokens each stepper's sequences hold before their first decode step
WINDOW = 256  # decode steps a stepper runs before it releases its sequences and prompts them afresh (KV bounded)
IDLE = -1  # the contending stage's mode while it steps nothing
START_S = 300.0  # for the contending process to load its two stations
SWITCH_S = 60.0  # for it to finish a step and begin the next under a new mode


def decode_stepper(model_dir: Path, layers: tuple[int, int], rows: int, threads: int) -> Callable[[], float]:
    """A station over `layers` whose `rows` sequences hold a PROMPT-token prompt; each call runs one decode step of
    them on `threads` torch threads (set before every step, as steppers of several thread counts take turns) and
    answers its ms (every WINDOW steps the sequences start again from their prompt first, untimed)."""
    st = Station(model_dir, StationSpec(layers=layers))
    sample = GREEDY if st.is_last else None
    seqs = range(rows)

    def rows_in(n: int) -> dict:
        if st.is_first:
            return {"token_ids": torch.randint(3, st.config.vocab_size, (n,))}
        return {"hidden": torch.randn(n, st.config.hidden_size)}

    def prompt() -> None:
        st.release(list(seqs))
        st.forward(tuple(WaveEntry(i, 0, PROMPT, sample) for i in seqs), **rows_in(PROMPT * rows))

    on_compute_thread(torch.set_num_threads, threads)
    prompt()
    positions = itertools.count(PROMPT)

    def step() -> float:
        nonlocal positions
        on_compute_thread(torch.set_num_threads, threads)
        pos = next(positions)
        if pos == PROMPT + WINDOW:
            prompt()
            positions = itertools.count(PROMPT)
            pos = next(positions)
        return st.forward(tuple(WaveEntry(i, pos, 1, sample) for i in seqs), **rows_in(rows)).seconds * 1e3
    return step


def contend(model_dir: Path, ranges: list[tuple[int, int]], rows: int, core: int, mode, started, stop) -> None:
    """The pipeline's other stage, in a process of its own pinned to `core`: while mode.value is i >= 0 it steps
    ranges[i] at `rows` rows back to back, as the other station computes the other wave while one computes its own;
    at IDLE it waits. started.value says which mode its current step (or wait) began under."""
    os.sched_setaffinity(0, {core})
    steppers = [decode_stepper(model_dir, r, rows, 1) for r in ranges]
    started.value = IDLE
    while not stop.is_set():
        now = mode.value
        started.value = now
        if now == IDLE:
            time.sleep(0.001)
        else:
            steppers[now]()


class Contender:
    """A contend() process and the switch that sets what it runs (`run(i)` returns once a step of ranges[i], or its
    wait at IDLE, has begun there); `close` stops it."""

    def __init__(self, model_dir: Path, ranges: list[tuple[int, int]], rows: int, core: int) -> None:
        ctx = mp.get_context("spawn")
        self.mode, self.started, self.stop = ctx.Value("i", IDLE), ctx.Value("i", -2), ctx.Event()
        self.proc = ctx.Process(target=contend, args=(model_dir, ranges, rows, core, self.mode, self.started,
                                                      self.stop), daemon=True)
        self.proc.start()
        self._wait(IDLE, START_S)

    def _wait(self, mode: int, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while self.started.value != mode:
            if time.monotonic() > deadline or not self.proc.is_alive():
                raise RuntimeError(f"pipeline_ceiling: the contending stage did not reach mode {mode} within "
                                   f"{within_s:.0f} s (alive: {self.proc.is_alive()})")
            time.sleep(0.0005)

    def run(self, i: int) -> None:
        """Have the other core step ranges[i] from now on (IDLE: nothing)."""
        self.mode.value = i
        self._wait(i, SWITCH_S)

    def close(self) -> None:
        """Stop the process and wait for it."""
        self.stop.set()
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


def interleaved_ms(whole: Callable[[], float], halves: list[Callable[[], float]], rounds: int,
                   other: Contender | None) -> list[tuple]:
    """Per round, in ms: the mean of a whole step before and after the rest, each half's step alone, and (with a
    contender) each half's step while the other core steps the other half, as in a pipeline; the other core idles
    while the whole steps (the lone station has its core to itself, the second idle)."""
    out = []
    for _ in range(rounds):
        before = whole()
        alone = tuple(h() for h in halves)
        contended = ()
        if other is not None:
            contended = tuple(_beside(other, 1 - i, h) for i, h in enumerate(halves))
            other.run(IDLE)
        out.append(((before + whole()) / 2, *alone, *contended))
    return out


def _beside(other: Contender, runs: int, step: Callable[[], float]) -> float:
    """One step's ms while the other core steps half `runs`."""
    other.run(runs)
    return step()


def halves_and_ceiling(timed: list[tuple], at: int) -> tuple[list[float], list[float], float]:
    """From interleaved_ms' rounds, the halves' steps at `at`, `at` + 1 (1: alone, 3: contended): their median ms,
    each round's ceiling (its whole step over twice its slower half's) and the median of those."""
    by_round = [t[0] / (2 * max(t[at:at + 2])) for t in timed]
    return [statistics.median(t[at + i] for t in timed) for i in range(2)], by_round, statistics.median(by_round)


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
    p.add_argument("--steps", type=int, default=12, help="interleaved rounds (a whole step, each half's, a whole step)")
    p.add_argument("--whole-threads", type=int, help="threads of the whole-model station (default: every core; 1 is "
                   "the core quota's lone 1-core station against two 1-core stages)")
    p.add_argument("--contend", action=argparse.BooleanOptionalAction, default=None,
                   help="also time each half while a second process on another core steps the other half (default: "
                   "on with --whole-threads 1 where two cores are usable)")
    p.add_argument("--linears", action=argparse.BooleanOptionalAction, default=True,
                   help="also time part (2), the decode-shaped matmuls alone, in two processes and cached (default on)")
    args = p.parse_args(argv)
    model_dir = resolve_model(args.model, "bench")
    layers = ModelConfig.from_dir(model_dir).num_hidden_layers
    split = args.split or layers // 2
    cores = os.cpu_count() or 1
    whole_threads = args.whole_threads or cores
    usable = sorted(os.sched_getaffinity(0))
    contend_on = args.contend if args.contend is not None else (whole_threads == 1 and len(usable) >= 2)
    if contend_on and (whole_threads != 1 or len(usable) < 2):
        p.error("--contend: needs --whole-threads 1 and two usable cores (this process on one, the other stage on "
                "the other)")
    ranges = [(0, split), (split, layers)]
    other = Contender(model_dir, ranges, args.rows // 2, usable[1]) if contend_on else None
    try:
        if other is not None:
            os.sched_setaffinity(0, {usable[0]})
        whole_step = decode_stepper(model_dir, (0, layers), args.rows, whole_threads)
        half_steps = [decode_stepper(model_dir, r, args.rows // 2, 1) for r in ranges]
        timed = interleaved_ms(whole_step, half_steps, args.steps, other)
    finally:
        if other is not None:
            other.close()
    whole = statistics.median(t[0] for t in timed)
    halves, by_round, ceiling = halves_and_ceiling(timed, 1)
    contended, contended_by_round, ceiling_contended = (halves_and_ceiling(timed, 3) if other is not None
                                                        else (None, None, None))
    probe_rows = max(2, args.rows // 2)  # part (2)'s matmuls: a stage's rows
    linears = None
    if args.linears:
        linears = {"streamed_alone": linear_us(probe_rows, 24, 1)[0],
                   "streamed_two_processes": statistics.mean(linear_us(probe_rows, 24, 2)),
                   "cached": linear_us(probe_rows, 1, 1)[0]}
    print(f"whole model, {args.rows} rows, {whole_threads} threads: {whole:.2f} ms/step")
    print(f"[0,{split}) and [{split},{layers}), {args.rows // 2} rows, 1 thread each, alone: "
          f"{halves[0]:.2f} / {halves[1]:.2f} ms/step")
    print(f"ceiling of two perfectly overlapped stages vs the whole: {ceiling:.2f}x (median of {len(by_round)} "
          f"interleaved rounds, {min(by_round):.2f}-{max(by_round):.2f}x)")
    if contended is not None:
        print(f"the same halves while the other core steps the other half (as the pipeline's stations do): "
              f"{contended[0]:.2f} / {contended[1]:.2f} ms/step; ceiling {ceiling_contended:.2f}x "
              f"({min(contended_by_round):.2f}-{max(contended_by_round):.2f}x): what two stages sharing this "
              "machine's memory can reach")
    if linears is not None:
        print(f"one thread, 2048x768 matmul at {probe_rows} rows: {linears['streamed_alone']:.0f} us "
              f"streaming 24 matrices alone, {linears['streamed_two_processes']:.0f} us with a second process doing "
              f"the same, {linears['cached']:.0f} us cached")
    mach = describe_machine()
    print(f"machine: {mach['cpu']}, {mach['cores']} cores, torch {mach['torch']}, load {mach['loadavg_1m']}")
    print(json.dumps({
        "whole_ms": whole, "whole_threads": whole_threads, "halves_ms": halves, "split": split, "rows": args.rows,
        "ceiling": ceiling, "ceiling_by_round": by_round, "halves_contended_ms": contended,
        "ceiling_contended": ceiling_contended,
        "ceiling_contended_by_round": contended_by_round,
        "linear_us": linears,
        "machine": mach}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
