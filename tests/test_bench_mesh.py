"""Smoke test: bench/chain.py runs end to end on the tiny checkpoint over local Ray (no timed assertions)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mesh.core.config import ModelConfig

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "chain.py"


def test_bench_mesh_quick_runs(tiny_llama):
    """`bench/chain.py --quick` (in-process, 1 and 2 stations over gRPC) ends with a JSON line of positive tok/s."""
    pytest.importorskip("ray")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_llama), "--quick"],
                          check=False, capture_output=True, text=True, timeout=230, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(figures["tok_s"]) == {"inproc", "1", "2"}
    assert all(set(by_k) == {"1", "4"} and all(v > 0 for v in by_k.values()) for by_k in figures["tok_s"].values())
    assert all(figures["tokens_match_inproc"].values())
    two = figures["detail"]["2"]["4"]
    assert two["waves"] > 0 and two["wire_bytes_per_wave"] > 0 and len(two["station_compute_ms_per_wave"]) == 2
    assert figures["hidden_path"] == "direct"  # the YAML default: the second station's time comes from relayed reports
    assert all(ms > 0 for ms in two["station_compute_ms_per_wave"])
    assert two["wire_bytes_per_wave_split"]["hidden_payload"] == 0  # the rows went station to station
    assert figures["targets"]["grpc1_vs_inproc"]["got"] > 0 and figures["targets"]["pipe2_vs_grpc1"]["got"] > 0


def test_core_quota_quick_runs(tiny_llama):
    """`bench/core_quota.py` runs one station and two as separate chain.py processes and reports their ratio, the
    tokens of both (identical), the pair's busy fractions and what its ratio would be with its busiest station never
    idle, where each station's idle went and its decode steps' median (the lone station's too), and with --ceiling
    the split's ceiling alone and contended before the first round and after the last, ending with a JSON line."""
    pytest.importorskip("ray")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "core_quota.py"), "--model", str(tiny_llama), "--quick",
                           "--min-tokens", "3", "--ceiling", "1"], check=False, capture_output=True, text=True,
                          timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    (only,) = figures["rounds"]
    assert only["one_tok_s"] > 0 and only["two_tok_s"] > 0
    assert figures["median_ratio"] == pytest.approx(only["two_tok_s"] / only["one_tok_s"])
    assert figures["tokens_identical"] and only["one_sha"] == only["two_sha"]
    assert len(only["busy"]) == 2 and all(0 < b <= 1 for b in only["busy"])
    assert only["ratio_never_idle"] == pytest.approx(only["ratio"] / max(only["busy"]))  # the idle's cost
    assert figures["median_ratio_never_idle"] == pytest.approx(only["ratio_never_idle"])
    for which, printed in (("first", "the pair's first"), ("second", "the pair's second"), ("lone", "the lone")):
        idle = only[f"{which}_station_idle"]  # from the stations' step timelines (bench/idle_parts.py)
        assert idle["steps"] > 0 and 0 < idle["busy_ms"] < idle["window_ms"]
        assert sum(idle[k] for k in ("busy_ms", "before_first_ms", "longest_gap_ms", "other_gaps_ms", "after_last_ms")
                   ) == pytest.approx(idle["window_ms"], abs=0.01)  # wall-clock floats: ~0.2 us apart
        assert 0 < idle["decode_steps"] <= idle["steps"] and 0 < idle["median_decode_step_ms"] < idle["busy_ms"]
        assert f"{printed} station: idle" in proc.stdout
    ring = only["pair_ring"]  # where a station waited for the other, from the same timelines (bench/idle_parts.py)
    assert len(ring["hop_ms"]) == len(ring["hops_waited"]) == 1 and "the ring's hand-offs" in proc.stdout
    assert all(v is None or v >= 0 for v in (*ring["hop_ms"], ring["back_ms"]))
    assert figures["rounds_at_target"] == (figures["median_ratio"] >= figures["target"])
    assert figures["min_tokens"] == 3 and "no verdict (not the issue's workload)" in proc.stdout
    split = only["pair_layers"][1][0]  # where the pair's run split the model (chain.py's stations)
    assert only["pair_layers"] == [[0, split], [split, ModelConfig.from_dir(tiny_llama).num_hidden_layers]]
    assert [c["split"] for c in figures["ceilings"]] == [split, split]  # the ceiling measured at that split
    for c, when in zip(figures["ceilings"], ("before the rounds", "after the rounds")):
        assert c["ceiling"] > 0 and c["ceiling_contended"] > 0 and all(ms > 0 for ms in c["halves_contended_ms"])
        assert f"the split's ceiling {when}: " in proc.stdout


def test_mixed_lengths_are_one_seeded_draw_per_concurrency():
    """chain.py's --min-tokens: every request's max_tokens in [min, max], the same draw on every call (so every config
    and repeat serves one workload), spread rather than equal; without it, all equal."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import chain
    finally:
        sys.path.remove(str(SCRIPT.parent))
    drawn = chain.lengths(32, 64, 8)
    assert drawn == chain.lengths(32, 64, 8) and len(drawn) == 32
    assert all(8 <= n <= 64 for n in drawn) and len(set(drawn)) > 8
    assert chain.lengths(4, 16, None) == [16] * 4


def test_pipeline_ceiling_runs(tiny_llama):
    """`bench/pipeline_ceiling.py` on the tiny checkpoint ends with a JSON line of positive figures; with --no-linears
    (as core_quota's --ceiling runs it) part (2)'s matmuls are neither timed nor printed."""
    script = SCRIPT.parent / "pipeline_ceiling.py"
    proc = subprocess.run([sys.executable, str(script), "--model", str(tiny_llama), "--rows", "4", "--steps", "2",
                           "--whole-threads", "1", "--no-linears"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["whole_ms"] > 0 and len(figures["halves_ms"]) == 2 and figures["ceiling"] > 0
    assert figures["whole_threads"] == 1 and len(figures["ceiling_by_round"]) == 2  # --steps interleaved rounds
    if len(os.sched_getaffinity(0)) >= 2:  # the other half stepped on a second core while each half is timed
        assert len(figures["halves_contended_ms"]) == 2 and all(v > 0 for v in figures["halves_contended_ms"])
        assert len(figures["ceiling_contended_by_round"]) == 2 and figures["ceiling_contended"] > 0
    assert figures["linear_us"] is None and "matmul" not in proc.stdout


def test_pipeline_ceiling_times_decode_shaped_matmuls(bench_script):
    """Part (2)'s probe (on by default): one thread's microseconds per decode-shaped matmul, in each of the processes
    run at once."""
    ceiling = bench_script("pipeline_ceiling")
    (alone,) = ceiling.linear_us(2, 1, 1)
    both = ceiling.linear_us(2, 1, 2)
    assert alone > 0 and len(both) == 2 and all(v > 0 for v in both)
