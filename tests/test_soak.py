"""The short soak: rounds of streaming clients (a third leave mid-stream), a canary, a station killed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_short_soak_survives_station_kills(tiny_llama):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--model", str(tiny_llama), "--rounds", "4",
                        "--clients", "6", "--kill-every", "2", "--max-tokens", "24"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    assert figures["failures"] == 0, figures
    assert figures["kills"] == 1 and len(figures["recovery_seconds"]) >= 1
    assert figures["completed"] > 0 and figures["left"] > 0
    assert figures["canary_mismatches"] == 0
    assert figures["kv_bytes_used_end"] == 0 and figures["running_end"] == 0
    assert figures["tracebacks"] == 0 and figures["exit_code"] == 0
