"""One point of `mesh bench scale`: station processes started and stopped, and K-per-wave requests run through
an engine over them, with the wall time, CPU, bytes, hops and turns it took (bench/scale.py drives the sweeps)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from scale_figures import percentile

from mesh.core.config import ModelConfig, SchedulerConfig
from mesh.core.hostinfo import process_cpu_seconds
from mesh.core.long_lived import freeze_long_lived
from mesh.core.params import SamplingParams
from orchestrator.engine import Engine
from orchestrator.remote import RemoteLink

TOKEN = "bench-scale"
log = lambda msg: print(msg, file=sys.stderr, flush=True)


class TimedLink(RemoteLink):
    """A RemoteLink that keeps each hub call's transfer cost (wall time minus the station's own time in it)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.hop_seconds: list[float] = []

    def forward(self, wave_id, entries, token_ids, hidden, steps=1):
        """Run the wave (hub path; `steps` decode steps on a lone station) and note the call's transfer cost per step."""
        t0 = time.perf_counter()
        reply = self._wave(lambda: self.client.relay(wave_id, entries, token_ids=token_ids, hidden=hidden,
                                                      steps=steps))
        self.hop_seconds.append((time.perf_counter() - t0 - reply.served_seconds) / steps)
        return reply.output

    def forward_steps(self, wave_id, entries, token_ids, steps, reply_steps):
        """Several decode steps on a lone station, their samples streamed back every `reply_steps` (hub path); each
        part's transfer cost per step noted."""
        t0 = time.perf_counter()
        for reply in self.relay_steps(wave_id, entries, token_ids, steps, reply_steps):
            now = time.perf_counter()
            self.hop_seconds.append((now - t0 - reply.served_seconds) / (len(reply.output.samples) // len(entries)))
            t0 = now
            yield reply.output


def relay_flags(args: argparse.Namespace) -> list[str]:
    """The station processes' relay flags: direct hops over relay links, their rows through shared memory on one
    host (the default), over relay links by TCP only, or as gRPC calls."""
    return {"link": [], "tcp": ["--no-relay-shm"], "grpc": ["--no-relay-link"]}[args.relay]


def start_stations(ranges, extra: list[str]) -> tuple[list[subprocess.Popen], list[str]]:
    """One station process per layer range (bench/sim_station.py); returns the processes and their addresses."""
    script = Path(__file__).resolve().parent / "sim_station.py"
    procs, addresses = [], []
    for a, b in ranges:
        proc = subprocess.Popen([sys.executable, str(script), "--layers", f"{a}-{b}", "--token", TOKEN, *extra],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
    try:
        for proc in procs:
            line = proc.stdout.readline().strip()
            if not line:
                raise RuntimeError(f"a station process exited before serving (rc {proc.poll()})")
            addresses.append(line)
    except BaseException:
        stop_stations(procs)
        raise
    return procs, addresses


def stop_stations(procs: list[subprocess.Popen]) -> None:
    """Close their stdin (they stop serving) and reap them."""
    for proc in procs:
        proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_point(addresses, model: ModelConfig, path: str, prompts, tokens: int | list[int], k: int,
              decode_steps: int = 0, station_pids: tuple[int, ...] = (), wave_tokens: int = 0,
              reply_steps: int = 0) -> dict:
    """K-per-wave requests through an engine over `addresses` on `path`; wall, CPU (this process's and the station
    processes' `station_pids`), bytes, hops, token ids. `tokens`: every request's max_tokens, or one per prompt.
    `wave_tokens` (0: max(K, 64 per station)) is scheduler.max_wave_tokens."""
    lengths = [tokens] * len(prompts) if isinstance(tokens, int) else list(tokens)
    links = [TimedLink(a, timeout_s=120, token=TOKEN) for a in addresses]
    sched = SchedulerConfig(max_seqs=len(prompts), max_wave_tokens=wave_tokens or max(len(prompts), 64 * len(addresses)),
                            max_queue=len(prompts), hidden_path=path, decode_steps=decode_steps,
                            reply_steps=reply_steps)
    engine = Engine(links, model, sched)
    freeze_long_lived()  # as a serving process does once it is up (mesh/core/long_lived.py)
    try:
        station_cpu0 = [process_cpu_seconds(pid) for pid in station_pids]
        cpu0, t0 = time.process_time(), time.perf_counter()
        streams = [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
        results = [s.result(timeout=900)[0] for s in streams]
        errors = [r.error for r in results if r.error]
        if errors:  # a failed request must not count as served tokens
            raise RuntimeError(f"{len(errors)} of {len(results)} requests failed: {errors[0]}")
        outs = [r.token_ids for r in results]
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        station_cpu = [process_cpu_seconds(pid) - c0 for pid, c0 in zip(station_pids, station_cpu0)]
        waves = engine.stats().waves
        pipeline = engine.pipeline
        hops = ([list(h) for h in pipeline.hop_seconds] if pipeline.hidden_path == "direct"
                else [link.hop_seconds for link in links])
        turns = [list(t) for t in pipeline.turn_seconds] if pipeline.hidden_path == "direct" else []
        through = sum(sum(link.client.forward_bytes) for link in links)
    finally:
        engine.close()
        for link in links:
            link.close()
    flat = [s for h in hops for s in h]
    steps = sum(lengths) / k  # K-row steps: a wave call runs one or several (decode_steps)
    return {"path": pipeline.hidden_path, "stations": len(addresses), "k": k, "wall_s": wall, "waves": waves,
            "steps": steps, "tok_s": sum(lengths) / wall, "cpu_ms_per_step": 1000 * cpu / steps,
            "orch_core_pct": 100 * cpu / wall,
            "wall_ms_per_step": 1000 * wall / steps, "orch_kib_per_step": through / steps / 1024,
            "hop_p50_ms": 1000 * percentile(flat, 50), "hop_p99_ms": 1000 * percentile(flat, 99),
            "hop_p50_ms_by_station": [round(1000 * percentile(h, 50), 2) for h in hops],
            "turn_p50_ms_by_station": [round(1000 * percentile(t, 50), 2) for t in turns],
            "station_cpu_ms_per_step": [round(1000 * c / steps, 2) for c in station_cpu],
            "machine_cpu_pct": 100 * (cpu + sum(station_cpu)) / (wall * (os.cpu_count() or 1)), "tokens": outs}
