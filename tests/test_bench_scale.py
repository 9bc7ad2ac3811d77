"""`mesh bench scale` without timed assertions: its arithmetic (bench/scale_figures.py: layer splits, percentiles,
the scaling targets, the limit, the rounds' median), the modelled step and payload, and a simulated chain driven by
the real engine over gRPC (bench/scale.py)."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import scale
import scale_figures
from sim_station import ModelledWait, SimModel, SimulatedStation

from mesh.core.wave import WaveEntry
from station.server import start_server
from station.step import StepError


def test_even_split_covers_every_layer_once():
    assert scale_figures.even_split(80, 1) == [(0, 80)]
    assert scale_figures.even_split(80, 8) == [(i * 10, i * 10 + 10) for i in range(8)]
    assert scale_figures.even_split(10, 3) == [(0, 3), (3, 7), (7, 10)]
    with pytest.raises(ValueError, match="cannot split 4 layers into 5"):
        scale_figures.even_split(4, 5)


def test_percentile_and_targets():
    values = [float(v) for v in range(1, 101)]
    assert (scale_figures.percentile(values, 50), scale_figures.percentile(values, 99), scale_figures.percentile(values, 100)) == (50, 99, 100)
    assert scale_figures.percentile([3.0], 99) == 3.0 and math.isnan(scale_figures.percentile([], 50))
    assert scale_figures.scaling_verdict(4, 3700, 1000) == (3.7, 3.6, True)
    ratio, target, met = scale_figures.scaling_verdict(8, 5000, 1000)
    assert (ratio, round(target, 6), met) == (5.0, 5.6, False)


def test_sim_limit_names_the_busiest_resource():
    """The limit is whichever of the wave's path, the machine, the orchestrator and a station was busiest."""
    row = {"stations": 4, "wall_ms_per_step": 20.0, "hop_p50_ms_by_station": [0.5, 3.0, 3.0, 3.5],
           "station_cpu_ms_per_step": [2.0, 3.0, 4.0, 2.0], "machine_cpu_pct": 30.0, "orch_core_pct": 6.0}
    name, busy = scale_figures.sim_limit(row, 64.0)  # (64 + 10) / 4 waves = 18.5 of 20 ms a step
    assert name == "hops on the wave's path (10.0 ms a step)" and busy == pytest.approx(92.5)
    name, busy = scale_figures.sim_limit({**row, "hop_p50_ms_by_station": [0.5, 0.5, 0.5, 0.5]}, 64.0)
    assert name == "device (modelled step)" and busy == pytest.approx(82.5)  # hops under 5% of the path
    name, busy = scale_figures.sim_limit({**row, "machine_cpu_pct": 97.0}, 64.0)
    assert name.startswith("machine CPU") and busy == 97.0
    name, busy = scale_figures.sim_limit({**row, "station_cpu_ms_per_step": [2.0, 19.8, 4.0, 2.0]}, 64.0)
    assert name == "station 1 CPU" and busy == pytest.approx(99.0)
    # the direct path's station turns count on the wave's path: (64 + 10 + 4) / 4 = 19.5 of 20 ms
    name, busy = scale_figures.sim_limit({**row, "turn_p50_ms_by_station": [1.0, 1.0, 1.0, 1.0]}, 64.0)
    assert name == "hops (10.0 ms) and station turns (4.0 ms) on the wave's path, a step" and busy == pytest.approx(97.5)
    name, busy = scale_figures.sim_limit({**row, "hop_p50_ms_by_station": [0.5, 0.5, 0.5, 0.5],
                                  "turn_p50_ms_by_station": [0.5, 0.5, 0.5, 0.5]}, 64.0)
    assert name.startswith("hops (2.0 ms) and station turns (2.0 ms)")  # together 6% of the path: named


def test_sim_model_defaults_are_the_issue_figures():
    sim = SimModel()
    assert sim.hop_bytes(64) == 2**20  # 64 rows x 8192 x bfloat16 = 1 MiB per hop
    assert sim.station_seconds(80, 64) == pytest.approx(0.064)
    assert sim.station_seconds(10, 64) == pytest.approx(0.008)  # a station holding 1/8 of the layers
    assert sim.station_seconds(10, 128) == pytest.approx(0.016)  # a wave twice as tall
    with pytest.raises(ValueError, match="wave_s"):
        SimModel(wave_s=float("nan"))


def test_a_modelled_step_lasts_its_modelled_time_though_sleeps_wake_late():
    """A clock whose sleeps wake 0.3 ms late: the waits learn it and end on time; a sleep that wakes on time is
    left as it is asked; no sleep is asked to be more than 1 ms short or below zero."""
    now = [0.0]
    asked: list[float] = []

    def late_sleep(s: float) -> None:
        asked.append(s)
        now[0] += s + 0.0003

    wait = ModelledWait(sleep=late_sleep, clock=lambda: now[0])
    took = [wait.wait(0.016) for _ in range(100)]
    assert took[0] == pytest.approx(0.0163) and abs(took[-1] - 0.016) < 1e-5
    assert all(0.015 <= s <= 0.016 for s in asked)
    on_time = ModelledWait(sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])
    assert [on_time.wait(0.004) for _ in range(3)] == pytest.approx([0.004] * 3)
    assert on_time.wait(0.0) == 0.0
    asked.clear()  # work done within the step (the rows written out) counts toward its time
    late = ModelledWait(sleep=late_sleep, clock=lambda: now[0])
    assert late.wait(0.016, work=lambda: now.__setitem__(0, now[0] + 0.002)) == pytest.approx(0.0163)
    assert asked == [pytest.approx(0.014)]


def test_a_simulated_station_writes_its_rows_where_it_is_told():
    """`rows_out` (the successor's shared memory): the modelled rows land there and are the output; a tensor that is
    not this step's rows, or one given to the last station, is refused before the step counts."""
    sim = SimModel(num_layers=4, hidden_size=8, vocab_size=100, wave_s=0.0, k_rows=4)
    first, last = SimulatedStation(sim, (0, 2)), SimulatedStation(sim, (2, 4))
    space = torch.zeros(3, 8, dtype=torch.bfloat16)  # [T, d]
    out = first.forward((WaveEntry(1, 0, 3),), rows_out=space)
    assert out.hidden is space and bool((space == 0.5).all())
    for station, bad in ((first, torch.zeros(2, 8, dtype=torch.bfloat16)), (first, torch.zeros(1, 8)),
                         (last, torch.zeros(1, 8, dtype=torch.bfloat16))):
        with pytest.raises(StepError, match="rows_out"):
            station.forward((WaveEntry(1, 3, 1) if station is first else WaveEntry(1, 0, 1),), rows_out=bad)
    whole = SimulatedStation(sim, (0, 4))
    with pytest.raises(StepError, match="several decode steps"):
        whole.forward((WaveEntry(1, 0, 1),), steps=2, rows_out=torch.zeros(1, 8, dtype=torch.bfloat16))
    assert first.stats().forwards == 1 and last.stats().forwards == 0 and whole.stats().forwards == 0


def test_simulated_chain_serves_through_the_real_engine():
    """Two SIMULATED stations behind real gRPC servers: the engine relays every wave, the sampled ids come back
    (the same on both paths), the station refuses an entry at a position it does not hold, and the KV empties."""
    sim = SimModel(num_layers=4, hidden_size=128, vocab_size=1000, wave_s=0.0, k_rows=4)
    stations = [SimulatedStation(sim, r) for r in ((0, 2), (2, 4))]
    with pytest.raises(StepError, match="start_pos 3 but the station holds 0"):
        stations[0].forward((WaveEntry(1, 3, 1),))
    servers = [start_server(st, token=scale.TOKEN) for st in stations]
    try:
        prompts = [[5 + i] for i in range(8)]
        got = {path: scale.run_point([s.address for s in servers], scale.sim_model_config(sim), path, prompts, 3, 4,
                                     station_pids=(os.getpid(),))  # the stations serve from this process
               for path in ("hub", "direct")}
        assert got["hub"]["tokens"] == got["direct"]["tokens"]
        assert got["direct"]["path"] == "direct" and got["hub"]["path"] == "hub"
        assert got["direct"]["orch_kib_per_step"] < got["hub"]["orch_kib_per_step"]
        turns = got["direct"]["turn_p50_ms_by_station"]  # each station's own time beside its step and its successor
        assert len(turns) == 2 and all(0 <= t < 1000 for t in turns) and got["hub"]["turn_p50_ms_by_station"] == []
        for r in got.values():  # this process's CPU over the run, per step: a figure (not NaN), at most every core's
            (station_ms,) = r["station_cpu_ms_per_step"]
            assert 0 <= station_ms <= r["wall_ms_per_step"] * os.cpu_count() + 10, r
        assert all(st.kv_usage().sequences == 0 for st in stations)
        lengths = [1, 5, 2, 4, 3, 5, 1, 2]  # mixed lengths: each request its own max_tokens
        mixed = scale.run_point([s.address for s in servers], scale.sim_model_config(sim), "direct", prompts,
                                lengths, 4)
        assert [len(t) for t in mixed["tokens"]] == lengths and mixed["steps"] == sum(lengths) / 4
        assert [t[:min(n, 3)] for t, n in zip(mixed["tokens"], lengths)] == [  # the 3-token run's tokens, as far as
            t[:n] for t, n in zip(got["direct"]["tokens"], lengths)]            # both go
        assert all(st.kv_usage().sequences == 0 for st in stations)
    finally:
        for s in servers:
            s.stop(0)


def test_mixed_lengths_are_one_seeded_draw_shared_by_every_p():
    """--min-tokens: n draws in [min, --tokens], the same on every call, a smaller P's requests the first of a larger
    P's; without it, every request gets --tokens."""
    args = SimpleNamespace(min_tokens=16, tokens=128, stations=[1, 2, 4], k=64)
    four = scale.sim_lengths(args, 256)
    assert four == scale.sim_lengths(args, 256) and len(four) == 256 and all(16 <= n <= 128 for n in four)
    assert scale.sim_lengths(args, 64) == four[:64] and len(set(four)) > 50
    assert scale.sim_lengths(SimpleNamespace(min_tokens=None, tokens=128, stations=[1], k=64), 64) == 128


def test_merge_rounds_keeps_each_points_median_round():
    """--rounds: each point's row is the round with its median ratio to that round's own P=1, whole."""
    def rnd(p1: float, p4: float, hop: float) -> list[dict]:
        return [{"stations": 1, "x_p1": 1.0, "tok_s": p1, "hop_p50_ms": 0.1},
                {"stations": 4, "x_p1": p4 / p1, "tok_s": p4, "hop_p50_ms": hop}]
    rounds = [rnd(100.0, 340.0, 1.0), rnd(90.0, 324.0, 2.0), rnd(100.0, 330.0, 3.0)]  # 3.4x, 3.6x, 3.3x
    merged = scale_figures.merge_rounds(rounds)
    assert [r["stations"] for r in merged] == [1, 4]
    assert merged[1]["x_p1"] == pytest.approx(3.4) and merged[1]["hop_p50_ms"] == 1.0  # the median round, whole
    assert merged[1]["x_p1_rounds"] == [3.4, 3.6, 3.3] and merged[0]["x_p1_rounds"] == [1.0, 1.0, 1.0]
    even = scale_figures.merge_rounds(rounds[:2])  # 3.4x and 3.6x: the lower median
    assert even[1]["x_p1"] == pytest.approx(3.4)
    assert scale_figures.merge_rounds(rounds[:1])[1]["x_p1_rounds"] == [3.4]  # one round: the row as it was
