"""Growth while decoding: how long `mesh scale` 1 -> 2 -> 1 holds live streams (issue 14's measure).

    mesh bench growth [--model DIR] [--streams 16] [--context 1000] [--tokens-between 24] [--quick]

N greedy streams (prompt --context random ids, ignore_eos) decode on an Engine over one in-process full-model
station; once every stream has --tokens-between tokens the route switches to two stations (the layers split in
half, loaded beside), then after as many more tokens back to one. Each stream's tokens are timestamped as they
arrive. Per switch: the longest gap between two tokens of any stream across the switch, the engine's own pause
figure (wavemesh_route_switch_pause_seconds: the longest wait of a stream for its next token), the median gap of
the tokens before the switch, the switch call's duration, and longest gap / median gap (issue 14's target: at
most 3x). The switch today is pause-and-re-prefill: planning stops, the pipeline empties and every live
sequence is prefilled again on the new route before any stream sees its next token. In-process stations share
this machine's cores (a measure of the pause, not of a scaled-out speed). The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time

from mesh.control.cli import resolve_model
from mesh.core.config import ModelConfig, SchedulerConfig, StationSpec
from mesh.core.hostinfo import describe_machine
from mesh.core.params import SamplingParams
from orchestrator.engine import Engine
from orchestrator.pipeline import LocalLink
from station.step import Station

TARGET_GAP_RATIO = 3.0


def _wait_tokens(times: list[list[float]], n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while min(len(t) for t in times) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"streams did not reach {n} tokens within {timeout:.0f} s")
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    """Run 1 -> 2 -> 1 under decoding streams and print the pause of each switch."""
    p = argparse.ArgumentParser(prog="mesh bench growth", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF checkpoint dir or .gguf file (default: the built-in `bench` preset)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--tokens-between", type=int, default=24, help="tokens each stream decodes between switches")
    p.add_argument("--max-wave-tokens", type=int, default=512)
    p.add_argument("--quick", action="store_true", help="4 streams of 64 tokens, 6 tokens between switches")
    a = p.parse_args(argv)
    if a.quick:
        a.streams, a.context, a.tokens_between = 4, 64, 6
    model_dir = resolve_model(a.model, "bench")
    cfg = ModelConfig.from_dir(model_dir)
    layers, half = cfg.num_hidden_layers, cfg.num_hidden_layers // 2
    kv = (a.context + 4 * a.tokens_between) * a.streams * 2 * layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 2
    one = [LocalLink(Station(model_dir, StationSpec(layers=(0, layers), kv_bytes=kv)))]
    engine = Engine(one, cfg, SchedulerConfig(max_seqs=a.streams, max_wave_tokens=a.max_wave_tokens), None)
    rng = random.Random(3)
    times: list[list[float]] = [[] for _ in range(a.streams)]
    params = SamplingParams(max_tokens=6 * a.tokens_between + 16, ignore_eos=True)
    streams = [engine.submit([rng.randrange(3, cfg.vocab_size) for _ in range(a.context)], params)
               for _ in range(a.streams)]

    def follow(i: int) -> None:
        for ev in streams[i]:
            if ev.token_ids:
                times[i].append(time.monotonic())

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(a.streams)]
    for t in threads:
        t.start()
    switches = []
    try:
        for step, ranges in enumerate((((0, half), (half, layers)), ((0, layers),))):
            _wait_tokens(times, (step + 1) * a.tokens_between, 600)
            links = [LocalLink(Station(model_dir, StationSpec(layers=r, kv_bytes=kv))) for r in ranges]
            t0 = time.monotonic()
            engine.switch_route(links)
            t_end = time.monotonic()
            call_s = t_end - t0
            deadline = t_end + 600
            while not all(any(x >= t_end for x in t) for t in times) and time.monotonic() < deadline:
                time.sleep(0.01)
            across, gaps_before = [], []
            for t in times:
                last = max(i for i, x in enumerate(t) if x < t_end)
                across.append(t[last + 1] - t[last])
                window = t[max(0, last - a.tokens_between // 2):last + 1]
                gaps_before += [y - x for x, y in zip(window, window[1:]) if y <= t0]
            median = statistics.median(gaps_before)
            switches.append({"to_stations": len(ranges), "longest_gap_s": max(across), "median_gap_before_s": median,
                             "gap_ratio": max(across) / median, "switch_call_s": call_s,
                             "engine_pause_s": (engine.stats().route_switch_pauses or (None,))[-1],
                             "live_context_tokens": sum(a.context + sum(x < t0 for x in t) for t in times)})
        for t in threads:  # each follower reads its stream to the end (the stream's one consumer)
            t.join(timeout=600)
    finally:
        engine.close()
    print(f"\nSWITCH (pause-and-re-prefill) {a.streams} streams x {a.context}-token contexts, model {model_dir.name}")
    print(f"{'to':>3} {'longest gap s':>14} {'engine pause s':>15} {'median gap s':>13} {'ratio':>7} {'switch call s':>14} "
          f"{'live tokens':>12}")
    for s in switches:
        print(f"{s['to_stations']:>3} {s['longest_gap_s']:>14.3f} {s['engine_pause_s'] or 0:>15.3f} "
              f"{s['median_gap_before_s']:>13.4f} "
              f"{s['gap_ratio']:>6.1f}x {s['switch_call_s']:>14.3f} {s['live_context_tokens']:>12}")
    worst = max(s["gap_ratio"] for s in switches)
    print(f"target: longest gap <= {TARGET_GAP_RATIO:.0f}x the median gap before: {worst:.1f}x "
          f"({'met' if worst <= TARGET_GAP_RATIO else 'NOT met'})")
    mach = describe_machine()
    print(f"machine: {mach['cpu']}, {mach['cores']} cores, load {mach['loadavg_1m']}")
    print(json.dumps({"mode": "pause-and-re-prefill", "switches": switches, "streams": a.streams,
                      "context": a.context, "model": str(model_dir), "machine": mach}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
