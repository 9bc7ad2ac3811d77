"""The compute thread's allocator setting: waves of changing size reuse freed memory instead of
faulting in fresh pages (mesh/core/allocator.py)."""
from __future__ import annotations

import subprocess
import json
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, threading, torch
    from mesh.core.allocator import keep_large_blocks
    from mesh.core.hostinfo import minor_faults
    print(keep_large_blocks())
    faults = []
    def waves():  # on a thread of its own, as the station's compute thread: glibc gives it its own arena
        w1, w2 = torch.randn(2048, 256), torch.randn(256, 2048)
        for _ in range(4):
            before = minor_faults()
            for rows in (512, 64, 1024, 8):  # waves of different sizes; [rows, 2048] temporaries up to 8 MiB
                x = torch.randn(rows, 256)
                for _ in range(3):
                    x = torch.nn.functional.silu(x @ w1.T) @ w2.T
            faults.append(minor_faults() - before)
    t = threading.Thread(target=waves)
    t.start()
    t.join()
    print(json.dumps(faults))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc are Linux's")
def test_repeated_waves_fault_in_no_new_pages():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    took, faults = out.stdout.split("\n")[:2]
    assert took == "True", out.stdout + out.stderr
    first, *later = json.loads(faults)
    assert first > 1000  # the first round does fault its working set in
    assert sum(later) < 256, f"minor page faults per later round: {later}"
