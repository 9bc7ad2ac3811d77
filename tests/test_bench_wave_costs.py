"""Smoke test: bench/wave_costs.py runs end to end on the tiny checkpoint (no timed assertions)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "wave_costs.py"


def test_bench_wave_costs_runs(tiny_llama):
    """A small run finishes, releases its KV each repeat, and ends with a JSON line of positive wave times."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_llama), "--rows", "3", "--prompt", "5",
                           "--long", "40", "--steps", "3", "--repeats", "2"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["prefill_ms"] > 0 and figures["decode_ms"] > 0 and figures["decode_long_ms"] > 0
    assert figures["prefill_minor_faults"] >= 0
    assert (figures["rows"], figures["prompt"], figures["long"], figures["steps"]) == (3, 5, 40, 3)
