"""Smoke test: bench/step.py runs end to end on the tiny checkpoint (no timed assertions)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "step.py"


def test_bench_step_quick_runs(tiny_llama):
    """`bench/step.py --quick --no-hf` finishes and ends with a JSON line of positive decode rates."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_llama), "--quick", "--no-hf"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(figures["ours_tok_s"]) == {"1", "4"}
    assert all(v > 0 for v in figures["ours_tok_s"].values())
    assert figures["hf_tok_s"] == {} and figures["weight_bytes"] > 0 and figures["bandwidth_gb_s"] > 0


def test_bench_step_profile_splits_the_decode_step(tiny_llama):
    """`--profile` prints, per batch, where a decode step went (marked as a measurement mode), and its
    categories add up to the step; the station ran the native kernels that `auto` picks on float32."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_llama), "--quick", "--no-hf",
                           "--profile"], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("PROFILE (measurement mode)") == 2
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["linear_backend"] in ("packed", "onednn", "aten")
    for batch in ("1", "4"):
        ms = figures["profile_ms"][batch]
        assert ms["linears"] > 0 and ms["attention"] > 0 and ms["sampling"] > 0
        # the timed calls lie inside the step, which also runs norms, RoPE and the embedding outside them
        assert ms["linears"] + ms["attention"] + ms["sampling"] < ms["step"] and ms["other"] > 0
        # a station running its layers in one native call: that call's norms, RoPE and SiLU timed apart from the
        # Python around it
        assert ms["native_other"] >= 0 and sum(ms[k] for k in ("linears", "attention", "native_other", "sampling",
                                                                "other")) == pytest.approx(ms["step"])
        if figures["linear_backend"] == "packed":
            assert ms["native_other"] > 0


def test_bench_step_times_hf_at_the_batches_asked(tiny_llama):
    """`--hf-batches 4` times HF at batch 4 alone (the default would be 1 and 16), so ours has its peer in the same
    run at any batch; a malformed list is refused by name."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_llama), "--quick", "--hf-batches", "4"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(figures["hf_tok_s"]) == {"4"} and set(figures["ours_tok_s"]) == {"1", "4"}
    bad = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_llama), "--quick", "--hf-batches", "x"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--hf-batches" in bad.stderr


def test_a_steps_bytes_are_counted_as_the_station_holds_them(bench_script, tiny_llama, tiny_llama_bf16):
    """The roofline's bytes: bfloat16 tiles count half what float32 tiles of the same shapes do, and the untied
    embedding table (float32 either way) is held but not read whole by a decode step."""
    import torch

    from mesh.core.config import StationSpec
    from station.step import Station

    step = bench_script("step")
    figures = {}
    for name, path in (("float32", tiny_llama), ("bfloat16", tiny_llama_bf16)):
        station = Station(path, StationSpec(layers=(0, 6)))
        table = station.model.model.embed_tokens.weight
        held, read = step.decode_step_bytes(station)
        assert held - read == table.numel() * 4 and table.dtype == torch.float32, name
        figures[name] = read - sum(p.numel() * 4 for n, p in station.model.named_parameters() if "norm" in n)
    assert figures["bfloat16"] * 2 == figures["float32"]
