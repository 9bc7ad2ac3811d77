"""The arithmetic of `mesh bench scale` (bench/scale.py): layer splits, percentiles, the issue's scaling targets,
what limits a SIMULATED point, and the median of several rounds. Pure Python on the rows run_point returns."""
from __future__ import annotations

import itertools
import math
import os

TARGETS = {1: 0.9, 2: 0.9, 4: 0.9, 8: 0.7}  # direct throughput >= TARGETS[P] * P * (P=1's)


def even_split(num_layers: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous layer ranges covering [0, num_layers), sizes differing by at most one."""
    if not 1 <= parts <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {parts} stations")
    bounds = [round(i * num_layers / parts) for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, nearest rank; NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def scaling_verdict(p: int, throughput: float, base: float) -> tuple[float, float, bool]:
    """(throughput / P=1's, the target ratio for P, whether it is met); P beyond the table takes P=8's target."""
    ratio = throughput / base
    target = TARGETS.get(p, TARGETS[8]) * p
    return ratio, target, ratio >= target


def sim_limit(r: dict, device_ms_per_step: float) -> tuple[str, float]:
    """What bounds a SIMULATED point, and how busy it was (%): the busiest of
    - the wave's path: with P waves in flight (one per station), a wave's step takes the modelled device time of
      every station (`device_ms_per_step`, T at K rows) plus every hop on the way and, on the direct path, every
      station's own turn (p50s), so a K-row step needs at least (device + hops + turns) / P of wall time ("device"
      where hops and turns are under 5% of it, else "hops", with the turns where there are any);
    - the machine's cores (every process's CPU over all of them), the orchestrator's one Python thread, and the
      busiest station process (its Python runs on one core at most)."""
    hops, turns = sum(r["hop_p50_ms_by_station"]), sum(r.get("turn_p50_ms_by_station", ()))
    path = 100 * (device_ms_per_step + hops + turns) / r["stations"] / r["wall_ms_per_step"]
    on_path = (f"hops on the wave's path ({hops:.1f} ms a step)" if not turns else
               f"hops ({hops:.1f} ms) and station turns ({turns:.1f} ms) on the wave's path, a step")
    station_core = [c / r["wall_ms_per_step"] * 100 for c in r["station_cpu_ms_per_step"]]
    busiest = max(range(len(station_core)), key=station_core.__getitem__)
    candidates = {("device (modelled step)" if hops + turns < 0.05 * (device_ms_per_step + hops + turns) else
                   on_path): path,
                  f"machine CPU ({os.cpu_count()} cores)": r["machine_cpu_pct"],
                  "orchestrator CPU": r["orch_core_pct"],
                  f"station {busiest} CPU": station_core[busiest]}
    name = max(candidates, key=candidates.__getitem__)
    return name, candidates[name]


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per point: the round whose ratio to its own P=1 is the median of the point's rounds (the lower
    median for an even count), so every figure of the row comes from one run; `x_p1_rounds` lists each round's
    ratio in round order. A machine that drifts during a sweep then moves a point's P=1 with it."""
    merged = []
    for runs in zip(*rounds):
        ranked = sorted(runs, key=lambda r: r["x_p1"])
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["x_p1_rounds"] = [round(r["x_p1"], 2) for r in runs]
        merged.append(row)
    return merged
