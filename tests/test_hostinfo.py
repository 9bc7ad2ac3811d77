"""What the benchmarks report about the machine: CPU time by process role, memory bandwidth."""
from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from mesh.core.hostinfo import bandwidth_gb_s, cpu_seconds_by_role, process_cpu_seconds


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_seconds_go_to_the_process_that_used_them():
    before = cpu_seconds_by_role()
    _spin(0.3)
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                              "while time.process_time() < end: pass\nprint('spun', flush=True)\ntime.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spun"
        after = cpu_seconds_by_role()  # the child is alive: its half second counts, as "other"
        assert 0.45 <= process_cpu_seconds(child.pid) < 1.5  # and it is the child's own
    finally:
        child.kill()
        child.wait(timeout=30)
    used = {role: after[role] - before[role] for role in after}
    assert 0.25 <= used["driver"] < 1.5, used
    assert used["other"] >= 0.45, used
    assert used["ray workers"] < 0.45, used  # no Ray in this test: nothing of the above lands there
    assert math.isnan(process_cpu_seconds(child.pid))  # reaped: no such process any more


def test_bandwidth_is_a_plausible_figure():
    assert 0.1 < bandwidth_gb_s(mib=16, repeats=3) < 10_000
