"""Smoke test: bench/serve.py runs end to end on the tiny checkpoint (no timed assertions)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "serve.py"


def test_bench_serve_quick_runs(tiny_llama):
    """`bench/serve.py --quick --no-hf` finishes and ends with a JSON line of positive throughputs."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_llama), "--quick", "--no-hf",
                           "--kv-mib", "8"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(figures["concurrency_tok_s"]) == {"1", "2", "4"}
    assert all(v > 0 for v in figures["concurrency_tok_s"].values())
    assert figures["concurrency_ratio"]["1"] == 1.0
    assert figures["mixed_ours_tok_s"] > 0 and figures["mixed_ours"]["tokens"] > 0
    assert figures["mixed_hf_tok_s"] is None and figures["mixed_ratio"] is None
    assert figures["machine"]["cores"] >= 1
