"""Growth while decoding: how long `mesh scale` 1 -> 2 -> 1 holds live streams (issue 14's measure).

    mesh bench growth [--model DIR] [--streams 16] [--context 1000] [--tokens-between 24]
                      [--modes copy,recompute,pause] [--catchup-wave-tokens 256] [--quick]

For each mode in --modes (alternating, one full run each): N greedy streams (prompt --context random ids,
ignore_eos) decode on an Engine over one in-process full-model station; once every stream has --tokens-between
tokens the route switches to two stations (the layers split in half, loaded beside), then after as many more
tokens back to one; after as many more the streams are cancelled. Each stream's tokens are timestamped as they
arrive. Per switch: the longest gap between two tokens of any stream while the switch ran (from the call to the
first token of every stream on the new route: catch-up included), the gap across the swap itself, the engine's
own figure (wavemesh_route_switch_pause_seconds: the longest wait of a stream for its first token on the new
route), the median gap before the switch and after it on the new route, the catch-up time, and longest gap / the
usual gap, the larger of those two medians (issue 14's target: at most 3x). A gap is between two deliveries of a
stream: its tokens that arrive together (within BURST_S, a several-step call's reply) are one delivery, so the
measure is a stream's wait for its next tokens; a route whose calls run several steps delivers less often (a lone
station's 4-step calls against a hub chain's one step a call), so the usual gap is the slower route's.

Modes: `copy` and `recompute` are make before break (the new stations build every live sequence's KV while the old
route decodes, then the route switches): `copy` copies the old stations' KV to the new ones (the default,
`scheduler.catchup_kv: copy`; each sequence switches with its one decode token), `recompute` prefills it on the new
stations in catch-up waves (a short chunk per sequence left at the switch); `pause` is pause-and-re-prefill
(planning stops, the pipeline empties and every live sequence is prefilled again on the new route). In-process stations
share this machine's cores: during a catch-up both routes compute on the same two cores (a measure of the pause,
not of a scaled-out speed). Every route's stations stay referenced to the end of the run: freeing an in-process
station's pages (1.6 GB of KV here) holds Python's GIL for ~0.13 s, a stall of this process that retiring a
station process of its own does not cause. The last line is one JSON object.
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
BURST_S = 1e-3  # a stream's tokens arriving within this of the one before came in one delivery (one call's reply)


def deliveries(times: list[float]) -> list[float]:
    """When a stream's deliveries arrived: the first of each run of tokens each within BURST_S of the one before."""
    out: list[float] = []
    for i, t in enumerate(times):
        if i == 0 or t - times[i - 1] > BURST_S:
            out.append(t)
    return out


def _wait_tokens(times: list[list[float]], n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while min(len(t) for t in times) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"streams did not reach {n} tokens within {timeout:.0f} s")
        time.sleep(0.01)


def run_mode(mode: str, a, model_dir, cfg: ModelConfig) -> list[dict]:
    """One 1 -> 2 -> 1 run in `mode`; one dict per switch."""
    layers, half = cfg.num_hidden_layers, cfg.num_hidden_layers // 2
    budget = cfg.max_position_embeddings  # tokens per stream: decoding goes on through two catch-ups (KV pages are touched as used)
    kv = budget * a.streams * 2 * layers * cfg.num_key_value_heads * cfg.head_dim * 4
    one = [LocalLink(Station(model_dir, StationSpec(layers=(0, layers), kv_bytes=kv)))]
    sched = SchedulerConfig(max_seqs=a.streams, max_wave_tokens=a.max_wave_tokens,
                            route_switch="pause" if mode == "pause" else "catchup",
                            catchup_kv="recompute" if mode == "recompute" else "copy",
                            catchup_wave_tokens=a.catchup_wave_tokens)
    engine = Engine(one, cfg, sched, None)
    rng = random.Random(3)
    times: list[list[float]] = [[] for _ in range(a.streams)]
    params = SamplingParams(max_tokens=budget - a.context, ignore_eos=True)
    streams = [engine.submit([rng.randrange(3, cfg.vocab_size) for _ in range(a.context)], params)
               for _ in range(a.streams)]

    def follow(i: int) -> None:
        for ev in streams[i]:
            if ev.token_ids:
                times[i].append(time.monotonic())

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(a.streams)]
    for t in threads:
        t.start()
    switches, switched = [], []
    routes = [one]
    try:
        for ranges in (((0, half), (half, layers)), ((0, layers),)):
            _wait_tokens(times, min(len(t) for t in times) + a.tokens_between, 900)
            links = [LocalLink(Station(model_dir, StationSpec(layers=r, kv_bytes=kv))) for r in ranges]
            routes.append(links)  # every route's stations live to the end of the run (see the docstring)
            # an in-process station loads on the compute thread the serving one steps on (a stall a station process
            # of its own does not cause): the switch starts once every stream has had two tokens since
            _wait_tokens(times, max(len(t) for t in times) + 2, 900)
            t0 = time.monotonic()
            report = engine.switch_route(links, timeout=900,
                                         progress=lambda msg: print(f"  [{mode}] {msg}", file=sys.stderr, flush=True))
            t_end = time.monotonic()
            deadline = t_end + 900
            while not all(t and t[-1] >= t_end for t in times):  # every stream has had a token on the new route
                if time.monotonic() > deadline:
                    raise TimeoutError("a stream had no token on the new route within 900 s")
                time.sleep(0.01)
            switched.append((t0, t_end, report, len(ranges), (engine.stats().route_switch_pauses or (None,))[-1]))
        _wait_tokens(times, min(len(t) for t in times) + a.tokens_between, 900)
        for t0, t_end, report, stations, engine_pause in switched:
            switches.append(_switch_figures(mode, times, t0, t_end, report, stations, engine_pause, a))
            print(f"  [{mode}] switch to {stations}: {json.dumps(switches[-1])}", file=sys.stderr, flush=True)
    finally:
        engine.close()  # cancels the streams
        for t in threads:
            t.join(timeout=60)
    return switches



def _switch_figures(mode: str, times: list[list[float]], t0: float, t_end: float, report, stations: int,
                    engine_pause: float | None, a) -> dict:
    """One switch's gaps from the streams' arrival times (the call at t0 returning at t_end): during it, in its
    catch-up, across the swap, and each stream's usual gap before it and after it on the new route."""
    during, catching, across, before, after = [], [], [], [], []
    t_pause = t0 + report.catchup_seconds
    keep = max(1, a.tokens_between // 2)
    for t in map(deliveries, times):
        gaps = list(zip(t, t[1:]))
        during += [y - x for x, y in gaps if y > t0 and x < t_end]
        catching += [y - x for x, y in gaps if x >= t0 and y <= t_pause]
        last = max(i for i, x in enumerate(t) if x < t_end)
        across.append(t[last + 1] - t[last])
        before += [y - x for x, y in gaps if y <= t0][-keep:]
        after += [y - x for x, y in gaps if x >= t[last + 1]][:keep]
    usual = max(statistics.median(before), statistics.median(after))
    longest = max(during + across)
    return {"mode": mode if report.mode == "catchup" else report.mode, "to_stations": stations,
            "longest_gap_s": longest, "gap_across_swap_s": max(across),
            "median_gap_before_s": statistics.median(before), "median_gap_after_s": statistics.median(after),
            "longest_gap_catchup_s": max(catching, default=0.0),
            "median_gap_catchup_s": statistics.median(catching) if catching else 0.0,
            "gap_ratio": longest / usual, "catchup_s": report.catchup_seconds,
            "catchup_tokens": report.catchup_tokens, "switch_call_s": t_end - t0,
            "residual_max": max(report.residual.values(), default=0), "engine_pause_s": engine_pause,
            "live_context_tokens": sum(a.context + sum(x < t0 for x in t) for t in times)}

def main(argv: list[str] | None = None) -> int:
    """Run 1 -> 2 -> 1 under decoding streams in each mode and print the pause of each switch."""
    p = argparse.ArgumentParser(prog="mesh bench growth", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF checkpoint dir or .gguf file (default: the built-in `bench` preset)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--tokens-between", type=int, default=24, help="tokens each stream decodes between switches")
    p.add_argument("--max-wave-tokens", type=int, default=512)
    p.add_argument("--catchup-wave-tokens", type=int, default=SchedulerConfig().catchup_wave_tokens)
    p.add_argument("--modes", default="copy,recompute,pause",
                   help="comma-separated: copy, recompute, pause (run in this order)")
    p.add_argument("--quick", action="store_true", help="4 streams of 64 tokens, 6 tokens between switches")
    a = p.parse_args(argv)
    if bad := [m for m in a.modes.split(",") if m.strip() not in ("copy", "recompute", "pause")]:
        p.error(f"--modes: {bad} are not modes (copy, recompute, pause)")
    if a.quick:
        a.streams, a.context, a.tokens_between = 4, 64, 6
    model_dir = resolve_model(a.model, "bench")
    cfg = ModelConfig.from_dir(model_dir)
    switches = [s for mode in a.modes.split(",") for s in run_mode(mode.strip(), a, model_dir, cfg)]
    print(f"\nSWITCH {a.streams} streams x {a.context}-token contexts, model {model_dir.name}, "
          f"catch-up waves of {a.catchup_wave_tokens} rows")
    print(f"{'mode':>8} {'to':>3} {'longest gap s':>14} {'across swap s':>14} {'in catch-up s':>14} "
          f"{'median in c-u s':>16} {'median before s':>16} {'median after s':>15} {'ratio':>7} {'catch-up s':>11} "
          f"{'residual':>9} "
          f"{'live tokens':>12}")
    for s in switches:
        print(f"{s['mode']:>8} {s['to_stations']:>3} {s['longest_gap_s']:>14.3f} {s['gap_across_swap_s']:>14.3f} "
              f"{s['longest_gap_catchup_s']:>14.3f} {s['median_gap_catchup_s']:>16.4f} "
              f"{s['median_gap_before_s']:>16.4f} {s['median_gap_after_s']:>15.4f} {s['gap_ratio']:>6.1f}x "
              f"{s['catchup_s']:>11.2f} {s['residual_max']:>9} {s['live_context_tokens']:>12}")
    for mode in sorted({s["mode"] for s in switches}):
        worst = max(s["gap_ratio"] for s in switches if s["mode"] == mode)
        print(f"{mode}: longest gap <= {TARGET_GAP_RATIO:.0f}x the usual gap (median before or after): {worst:.1f}x "
              f"({'met' if worst <= TARGET_GAP_RATIO else 'NOT met'})")
    mach = describe_machine()
    print(f"machine: {mach['cpu']}, {mach['cores']} cores, load {mach['loadavg_1m']}")
    print(json.dumps({"switches": switches, "streams": a.streams, "context": a.context,
                      "catchup_wave_tokens": a.catchup_wave_tokens, "model": str(model_dir), "machine": mach}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
