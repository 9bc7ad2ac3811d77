"""One relay-link hop alone (station/relay_link.py): a MiB of hidden rows to a station process on this host and its
empty answer, with the rows through shared memory (station/link_shm.py) or by TCP, alternated in one run.

The station side answers at once (no step), so what is timed is the carriage: the client's send, the station's
read of the frame and its rows, the answer's way back. Reported per mode: the round trip's median and p90 and the
CPU seconds both processes spent per hop (getrusage of this process; /proc of the station's).

    python bench/link_hop.py [--mib 1] [--hops 400] [--rounds 4]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mesh.core.proto import station_pb2 as pb  # noqa: E402
from station.interceptors import WireBytes  # noqa: E402
from station.relay_link import RelayLinkServer  # noqa: E402
from station.relay_link_client import RelayLinkClient  # noqa: E402

TOKEN = "link-hop-bench"
LIMIT = 64 << 20


def serve() -> int:
    """The station side: answer every request with an empty reply until stdin closes; print the port first."""
    server = RelayLinkServer("127.0.0.1", lambda request, time_left, rows, prepared: pb.ForwardReply(), token=TOKEN,
                             tls=None, max_message_bytes=LIMIT, wire=WireBytes())
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()
    return 0


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_mode(port: int, station_pid: int, shm: bool, rows: memoryview, hops: int) -> dict:
    """`hops` calls of one client (rows through its segment where `shm`); latency and CPU per hop."""
    client = RelayLinkClient("127.0.0.1", port, token=TOKEN, tls=None, max_message_bytes=LIMIT, wire=WireBytes(),
                             shm_bytes=rows.nbytes if shm else 0)
    request = pb.ForwardRequest(wave_id=1)
    try:
        client.forward(request, 10, rows=rows)  # connect (and offer the segment) outside the timed hops
        own0 = resource.getrusage(resource.RUSAGE_SELF)
        station0 = cpu_seconds(station_pid)
        latencies = []
        for _ in range(hops):
            t0 = time.perf_counter()
            client.forward(request, 10, rows=rows)
            latencies.append(time.perf_counter() - t0)
        own1 = resource.getrusage(resource.RUSAGE_SELF)
        station = cpu_seconds(station_pid) - station0
        through_segment = any(segment is not None for _, segment in client._idle)  # the pooled connection's
    finally:
        client.close()
    own = own1.ru_utime + own1.ru_stime - own0.ru_utime - own0.ru_stime
    latencies.sort()
    if through_segment != shm:
        raise RuntimeError(f"rows {'by TCP' if shm else 'through shared memory'} where {'shm' if shm else 'tcp'} "
                           "was asked for")
    return {"mode": "shm" if shm else "tcp", "p50_ms": statistics.median(latencies) * 1e3,
            "p90_ms": latencies[int(0.9 * len(latencies))] * 1e3, "client_cpu_ms": own / hops * 1e3,
            "station_cpu_ms": station / hops * 1e3}


def main(argv: list[str] | None = None) -> int:
    """Alternate shared memory and TCP over one station process; print each round and the medians."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=1.0, help="rows per hop, MiB (1: 64 rows of 8192 bfloat16)")
    p.add_argument("--hops", type=int, default=400)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve()
    station = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        port = int(station.stdout.readline())
        rows = memoryview(bytearray(int(args.mib * (1 << 20))))
        results = []
        for r in range(args.rounds):
            for shm in ((True, False) if r % 2 == 0 else (False, True)):
                got = run_mode(port, station.pid, shm, rows, args.hops)
                results.append(got)
                print(f"round {r + 1} {got['mode']}: round trip p50 {got['p50_ms']:.3f} ms, p90 {got['p90_ms']:.3f} "
                      f"ms; CPU per hop: client {got['client_cpu_ms']:.3f} ms, station {got['station_cpu_ms']:.3f} ms",
                      flush=True)
    finally:
        station.stdin.close()
        station.wait(10)
    print(f"\n{args.mib:g} MiB per hop, {args.hops} hops a round, medians of {args.rounds} rounds:")
    print("| rows by | round trip p50 ms | p90 ms | client CPU ms/hop | station CPU ms/hop |")
    print("|---|---:|---:|---:|---:|")
    for mode in ("shm", "tcp"):
        rs = [r for r in results if r["mode"] == mode]
        med = {k: statistics.median(r[k] for r in rs) for k in ("p50_ms", "p90_ms", "client_cpu_ms", "station_cpu_ms")}
        print(f"| {mode} | {med['p50_ms']:.3f} | {med['p90_ms']:.3f} | {med['client_cpu_ms']:.3f} | "
              f"{med['station_cpu_ms']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
