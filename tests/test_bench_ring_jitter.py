"""bench/ring_jitter.py: the ring model over hand-built core traces, and one quick recording on the tiny model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rj(bench_script):
    """The benchmark module (bench/ is not a package)."""
    return bench_script("ring_jitter")


def steady(rj, step_ms: float, layers: int = 8, seconds: float = 60.0):
    """A core whose every recorded step of `layers` layers took step_ms, back to back."""
    n = int(seconds * 1e3 / step_ms)
    return rj.CoreTrace(tuple(i * step_ms for i in range(n)), (step_ms,) * n, layers)


def test_a_layer_takes_its_share_of_the_step_recorded_at_its_time(rj):
    trace = rj.CoreTrace((0.0, 80.0, 120.0), (80.0, 40.0, 40.0), 8)  # slow for 80 ms, then twice as fast
    assert trace.layer_ms(10.0) == 10.0 and trace.layer_ms(100.0) == 5.0 and trace.layer_ms(-5.0) == 10.0
    assert rj.finish_ms(trace, 0.0, 8) == pytest.approx(80.0)
    assert rj.finish_ms(trace, 80.0, 8) == pytest.approx(120.0)
    assert rj.finish_ms(trace, 70.0, 2) == pytest.approx(70.0 + 10.0 + 5.0)  # one layer slow, one fast


def test_a_steady_balanced_ring_waits_only_for_its_hand_offs(rj):
    """8 layers at 5 ms on each side (4 layers + a 4-layer head on the second): a lane's loop is 40 + 1 + 40 + 1 ms,
    and two lanes keep both stations busy but for the hand-offs."""
    core = steady(rj, 40.0)
    for steps in (1, 2, 10):
        out = rj.ring_span(core, core, 0.0, steps, 8, 12, 4.0, 1.0)
        assert out.span_ms == pytest.approx(82.0 * steps + 40.0)
        assert out.busy_ms == pytest.approx((80.0 * steps, 80.0 * steps))


def test_the_elastic_boundary_moves_layers_to_the_faster_core(rj):
    """The second core twice as slow: the static ring runs at its pace; the elastic one gives the first station
    more layers, ending well sooner but never sooner than the two cores' speeds allow."""
    fast, slow = steady(rj, 40.0), steady(rj, 80.0)
    steps = 16
    static = rj.ring_span(fast, slow, 0.0, steps, 8, 12, 4.0, 1.0)
    elastic = rj.ring_span(fast, slow, 0.0, steps, 8, 12, 4.0, 1.0, min_layers=4)
    assert static.span_ms >= 2 * steps * 80.0  # the second station's 8 layer-units at 10 ms, twice a step
    bound = 2 * steps * 16 / (1 / 5 + 1 / 10)  # every layer-unit of both lanes over both cores' speeds together
    assert bound <= elastic.span_ms < 0.8 * static.span_ms
    assert elastic.busy_ms[0] > static.busy_ms[0]  # the first station took layers


def test_the_head_weighs_its_weights_in_layers(rj, tiny_llama):
    from mesh.core.config import ModelConfig

    cfg = ModelConfig.from_dir(tiny_llama)
    d, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = 2 * d * q + 2 * d * kv + 3 * d * cfg.intermediate_size + 2 * d
    assert rj.head_in_layers(cfg) == pytest.approx((cfg.vocab_size * d + d) / layer)


@pytest.mark.parametrize("args, named", [
    (["--seconds", "0"], "--seconds"), (["--steps", "0"], "--steps"), (["--min-layers", "0"], "--min-layers"),
    (["--handoff-ms", "-1"], "--handoff-ms"), (["--rows", "3"], "--rows")])
def test_bad_arguments_are_refused_naming_them(rj, capsys, args, named):
    with pytest.raises(SystemExit) as exit_:
        rj.main(args)
    assert exit_.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="records on cores 0 and 1")
def test_ring_jitter_quick_records_both_cores_and_says_it_is_a_model(tiny_llama):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "ring_jitter.py"), "--quick", "--model",
                          str(tiny_llama), "--seconds", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert "MODEL" in lines[0]
    out = json.loads(lines[-1])
    assert len(out["traces"]) == 2 and all(t["step_ms"] for t in out["traces"])
    assert out["windows"] and out["static_ms"] > 0 and out["elastic_ms"] > 0
    assert 0 < out["static_busy"][0] <= 1 and 0 < out["static_busy"][1] <= 1


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="records on cores 0 and 1")
def test_a_recording_that_fails_stops_the_run_naming_its_core(tiny_llama, tmp_path):
    """A checkpoint whose config reads but whose weights are missing: the recording processes fail to load it, and
    the run ends with an error that says so rather than waiting out its deadline."""
    (tmp_path / "config.json").write_text((Path(tiny_llama) / "config.json").read_text())
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "ring_jitter.py"), "--quick", "--model", str(tmp_path),
                          "--seconds", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "ring_jitter: the recording on core" in run.stderr and "exited with" in run.stderr
