"""The allocator setting of the compute thread, the station server and the station client: waves of changing
size, and the wire's MiB payloads, reuse freed memory instead of faulting in fresh pages (mesh/core/allocator.py)."""
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


WIRE_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from types import SimpleNamespace
    from mesh.core.config import StationSpec
    from mesh.core.hostinfo import minor_faults
    from mesh.core.proto import station_pb2 as pb
    from mesh.core.wire_tensor import proto_to_tensor, tensor_to_proto
    if sys.argv[1] == "client":
        from station.client import StationClient
        StationClient("127.0.0.1:1")  # the orchestrator's side; a channel dials lazily: nothing is called
    elif sys.argv[1] == "server":
        from station.server import start_server
        shape = SimpleNamespace(hidden_size=8192, num_key_value_heads=1, head_dim=8)
        start_server(SimpleNamespace(config=shape, spec=StationSpec(layers=(0, 1)))).stop(0)
    hidden = torch.full((64, 8192), 0.5, dtype=torch.bfloat16)  # one wave's hidden rows: 1 MiB
    faults = []
    for _ in range(4):
        before = minor_faults()
        for _ in range(8):  # encoded, sent as bytes, parsed and decoded, as every hop does
            raw = pb.ForwardRequest(wave_id=1, hidden=tensor_to_proto(hidden)).SerializeToString()
            msg = pb.ForwardRequest.FromString(raw)
            proto_to_tensor(msg.hidden, expect_dtype="bfloat16", expect_shape=(64, 8192), field="hidden")
            del raw, msg
        faults.append(minor_faults() - before)
    print(json.dumps(faults))
""")


def _wire_faults(side: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", WIRE_SCRIPT, side], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc are Linux's")
def test_wire_buffers_are_reused_by_station_servers_and_clients():
    # glibc alone hands each MiB payload fresh pages (thousands of faults per round, ~3-8 us each on the VMs
    # measured); a process that serves a station or calls one keeps freed buffers and faults nothing later
    plain = _wire_faults("none")
    assert min(plain[1:]) > 1000, f"expected fresh pages per round without the setting: {plain}"
    for side in ("client", "server"):
        first, *later = _wire_faults(side)
        assert sum(later) < 256, f"{side}: minor page faults per later round: {later}"
