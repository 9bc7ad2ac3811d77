"""`mesh bench scale`: does adding stations add throughput? Hub vs direct transfer (issue 13 items 2 and 4).

    mesh bench scale [--stations 1,2,4,8] [--paths hub,direct] [--wave-ms 64] [--k 64] [--hidden 8192]
                     [--tokens 128] [--min-tokens N] [--rounds 1] [--real-stations 2,3] [--real-k 16,32] [--real-device cpu] [--real-dtype float32]
                     [--real-threads 0] [--real-balance layers] [--real-wave-tokens 0] [--skip-sim] [--skip-real] [--quick]

SIMULATED part (bench/sim_station.py): P evenly split stations, each a real gRPC server in its own process
with the cluster token, whose step is a sleep of f * T (T = --wave-ms for the whole model at K = --k rows,
f = its share of the layers) and whose hidden rows are the model's width in bfloat16 (1 MiB per hop at
K=64, width 8192). Everything else is the real code: the engine's wave loop, scheduler and KV ledger in
this process, the wire encoding and validation, relays, sampled ids coming back. K*P requests (prompt of
one token, --tokens decode steps, ignore_eos; with --min-tokens M each request's max_tokens drawn from [M, --tokens],
one seeded draw for every P and round, a workload the targets are not set for) keep P waves of K rows in flight.
Reported per P and path: throughput and its ratio to P=1 (target: direct >= 0.9 x P for P <= 4, >= 0.7 x P at P = 8), this process's
CPU per step and share of one core (the orchestrator: stations are other processes), per-hop transfer cost p50/p99 (a call's
wall time minus the callee's own time in it, per decode step of the call: hub = orchestrator <-> station i,
direct = station i-1 -> station i, hop 0 = orchestrator -> first station) and the Forward bytes through the
orchestrator per step; each station process's CPU per step, the machine's CPU in use (every process of the
run over all cores), and the limit (`sim_limit`): the busiest of the wave's path (P waves in flight, each step
the modelled device time plus the hops), the machine's cores, the orchestrator's thread and the busiest station
process, with how busy it was. A step is one K-row wave's step (requests x tokens / K of them); once only decodes
run, a wave call runs up to --decode-steps of them (the lone station, or the first station of a direct chain, feeds each
step's samples into the next; by default 4 on one station, 16 streamed every 4 on a chain), so "wave calls" counts
fewer. `--rounds N` runs the whole sweep N times, P=1 first in each, and keeps for each point the round with the
median ratio to its own round's P=1 (every round's ratio is shown): on a machine whose speed drifts within minutes,
a point is then not weighed against a P=1 run at another moment.

Real part: the `bench` preset over N = 2 and 3 real station processes (torch threads = cores // N; with
--real-threads C each station has C threads and is pinned to C cores of its own, as a station actor with
num_cpus = C: the core-quota comparison), K concurrent greedy requests (prompt 32, --tokens): tok/s, wall time
and bytes through the orchestrator per wave, hub vs direct, and the tokens' digest (the same on both paths,
and across N). Prints the command and the load; the last line is JSON.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

from call_shape import add_call_shape_args, min_tokens_problem, mixed_lengths
from scale_figures import even_split, merge_rounds, scaling_verdict, sim_limit
from scale_points import TOKEN, log, relay_flags, run_point, start_stations, stop_stations  # noqa: F401 (TOKEN: tests)
from sim_station import SimModel

from mesh.core.config import ModelConfig

def sim_model_config(sim: SimModel) -> ModelConfig:
    """The orchestrator's view of the SIMULATED model (shape only; nothing loads it)."""
    return ModelConfig(arch="llama", vocab_size=sim.vocab_size, hidden_size=sim.hidden_size,
                       intermediate_size=4 * sim.hidden_size, num_hidden_layers=sim.num_layers,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=sim.hidden_size // 64,
                       max_position_embeddings=8192)


def sim_lengths(args, n: int) -> int | list[int]:
    """The SIMULATED requests' max_tokens: --tokens for all, or (--min-tokens) n seeded draws from [min, --tokens],
    the first K*P' of the same list for a smaller P' (so every P serves requests of the same spread)."""
    if args.min_tokens is None:
        return args.tokens
    return mixed_lengths(max(args.stations) * args.k, args.tokens, args.min_tokens, seed=3000)[:n]


def simulated(args) -> list[dict]:
    """The SIMULATED table: P stations x paths, P waves of K rows in flight; with --rounds N, N whole sweeps, each
    point's ratio taken against its own round's P=1, and the median round of each point kept (merge_rounds)."""
    rounds = []
    for n in range(args.rounds):
        if args.rounds > 1:
            log(f"SIMULATED round {n + 1} of {args.rounds}")
        rounds.append(_simulated_round(args))
    return merge_rounds(rounds)


def _simulated_round(args) -> list[dict]:
    """One sweep of the SIMULATED points, P=1 first (the base of this round's ratios)."""
    sim = SimModel(num_layers=args.num_layers, hidden_size=args.hidden, wave_s=args.wave_ms / 1000, k_rows=args.k)
    rows, base = [], None
    for p in args.stations:
        ranges = even_split(sim.num_layers, p)
        device_ms = 1000 * sum(sim.station_seconds(b - a, args.k) for a, b in ranges)  # a K-row step, every station
        procs, addresses = start_stations(ranges, ["--wave-ms", str(args.wave_ms), "--hidden", str(args.hidden),
                                                   "--num-layers", str(args.num_layers),
                                                   "--workers", str(2 * p + 8), *relay_flags(args)])
        try:
            prompts = [[1 + i % 1000] for i in range(args.k * p)]
            tokens = sim_lengths(args, len(prompts))
            for path in (["hub"] if p == 1 else args.paths):
                r = run_point(addresses, sim_model_config(sim), path, prompts, tokens, args.k, args.decode_steps,
                              tuple(proc.pid for proc in procs), reply_steps=args.reply_steps)
                r.pop("tokens")
                r["limit"], r["limit_busy_pct"] = sim_limit(r, device_ms)
                base = base or r["tok_s"]
                r["x_p1"], r["target_x"], r["met"] = scaling_verdict(p, r["tok_s"], base)
                r["hop_mib"] = sim.hop_bytes(args.k) / 2**20
                rows.append(r)
                log(f"SIMULATED P={p} {r['path']}: {r['tok_s']:.0f} tok/s, {r['x_p1']:.2f}x P=1")
        finally:
            stop_stations(procs)
    return rows


def real(args) -> list[dict]:
    """Hub vs direct on real compute (the `bench` preset) over N = each of --real-stations stations, K concurrent
    requests each of --real-k; with --real-threads every station is pinned to cores of its own."""
    from mesh.control.cli import resolve_model

    model_dir = resolve_model(None, "tiny" if args.quick else "bench")
    with tempfile.TemporaryDirectory(prefix="wavemesh-bench-cores-") as claims:
        return [r for n in args.real_stations for r in _real_chain(args, model_dir, n, claims)]


def _real_chain(args, model_dir, n: int, claims: str) -> list[dict]:
    """Start n real station processes, run every K on every path, stop them; one row per (K, path)."""
    from mesh.control.layer_plan import plan_layers, split_weights

    cfg = ModelConfig.from_dir(model_dir)
    weights = None if args.real_balance == "layers" else split_weights(cfg, args.real_dtype, args.real_balance)
    threads = args.real_threads or max(1, (os.cpu_count() or 1) // n)
    pin = ["--cpus", str(threads), "--claim-dir", claims] if args.real_threads else []
    procs, addresses = start_stations(plan_layers(cfg.num_hidden_layers, n, weights),
                                      ["--model", str(model_dir), "--threads", str(threads), *pin, "--device",
                                       args.real_device, "--dtype", args.real_dtype, *relay_flags(args)])
    rows = []
    try:
        warm = [[1] + [(7 * j) % (cfg.vocab_size - 3) + 3 for j in range(31)]] * 2
        run_point(addresses, cfg, args.paths[-1], warm, 4, 2, args.decode_steps,
                  reply_steps=args.reply_steps)  # untimed: first-call costs
        for k in args.real_k:
            prompts = [[1] + [(97 * i + 13 * j) % (cfg.vocab_size - 3) + 3 for j in range(31)] for i in range(k)]
            got = {path: run_point(addresses, cfg, path, prompts, args.tokens, k, args.decode_steps,
                                   tuple(proc.pid for proc in procs),
                                   args.real_wave_tokens or max(k, 64 * max(args.real_stations)),
                                   reply_steps=args.reply_steps)
                   for path in args.paths}
            digests = {path: hashlib.sha256(json.dumps(r.pop("tokens")).encode()).hexdigest()[:12]
                       for path, r in got.items()}
            for path, r in got.items():
                r["tokens_identical"], r["tokens_sha256"] = len(set(digests.values())) == 1, digests[path]
                rows.append(r)
            log(f"real N={n} K={k}: " + ", ".join(f"{p} {r['wall_ms_per_step']:.1f} ms/step" for p, r in got.items()))
    finally:
        stop_stations(procs)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the SIMULATED table and the real hub-vs-direct table; print both and one JSON line."""
    ints = lambda s: [int(x) for x in s.split(",")]
    p = argparse.ArgumentParser(prog="mesh bench scale", description=__doc__.split("\n")[0])
    p.add_argument("--stations", type=ints, default=[1, 2, 4, 8])
    p.add_argument("--paths", type=lambda s: s.split(","), default=["hub", "direct"])
    p.add_argument("--wave-ms", type=float, default=64.0, help="SIMULATED whole-model wave at K rows")
    p.add_argument("--k", type=int, default=64, help="rows per wave (SIMULATED)")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--num-layers", type=int, default=80)
    p.add_argument("--tokens", type=int, default=128, help="tokens per request (128: the steady state outweighs the pipeline's fill and drain)")
    p.add_argument("--min-tokens", type=int, help="SIMULATED mixed lengths: max_tokens drawn from [N, --tokens] per "
                   "request (seeded; not the workload the targets are set for)")
    add_call_shape_args(p)
    p.add_argument("--real-stations", type=ints, default=[2, 3])
    p.add_argument("--real-k", type=ints, default=[16, 32])
    p.add_argument("--real-device", default="cpu", help="the real stations' device (cuda: every station on one GPU)")
    p.add_argument("--real-dtype", default="float32", help="the real stations' dtype")
    p.add_argument("--real-threads", type=int, default=0,
                   help="torch threads of each real station, each pinned to that many cores of its own (0: cores // N, unpinned)")
    p.add_argument("--real-balance", choices=("layers", "memory", "compute"), default="layers",
                   help="how the real stations split the layers: evenly, or as stations.balance does")
    p.add_argument("--real-wave-tokens", type=int, default=0,
                   help="scheduler.max_wave_tokens of the real points (0: max(K, 64 per station of the largest "
                        "chain), the same for every chain, so one station is not given smaller waves than several)")
    p.add_argument("--relay", choices=("link", "tcp", "grpc"), default="link",
                   help="how the direct path's hops travel: relay links (station/relay_link.py) with rows through "
                        "shared memory where stations share a host (station/link_shm.py), relay links by TCP only, "
                        "or gRPC calls")
    p.add_argument("--rounds", type=int, default=1,
                   help="SIMULATED sweeps, one after another; each point against its own round's P=1, the median kept")
    p.add_argument("--skip-sim", action="store_true")
    p.add_argument("--skip-real", action="store_true")
    p.add_argument("--quick", action="store_true", help="a smoke run: small shapes, the tiny model")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.quick:
        args.stations, args.k, args.hidden, args.tokens, args.real_k = [1, 2], 8, 256, 4, [4]
    if (problem := min_tokens_problem(args.min_tokens, args.tokens)) is not None:
        p.error(problem)
    print(f"command: mesh bench scale {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"load at start: {os.getloadavg()}  cores: {os.cpu_count()}")
    sim_rows = [] if args.skip_sim else simulated(args)
    if sim_rows:
        print(f"\nSIMULATED GPU stations: T={args.wave_ms} ms per whole-model wave at K={args.k}, hidden {args.hidden} "
              f"bfloat16 ({sim_rows[0]['hop_mib']:.2f} MiB per hop), "
              + (f"{args.tokens} decode steps" if args.min_tokens is None else
                 f"max_tokens {args.min_tokens}-{args.tokens} by request (mixed lengths: the target and met "
                 "columns are the equal-length targets', for reference only)")
              + ", P waves in flight"
              + (f", the median of {args.rounds} rounds" if args.rounds > 1 else ""))
        print("| P | path | tok/s | x P=1 | target | met | orchestrator CPU ms/step | orchestrator core % "
              "| x P=1 by round | hop p50 ms | hop p99 ms | hop p50 by station ms | turn p50 by station ms "
              "| KiB through orchestrator/step "
              "| ms/step | wave calls "
              "| station CPU ms/step | machine CPU % | limit (busy %) |")
        print("|---:|---|---:|---:|---:|---|---:|---:|---|---:|---:|---|---|---:|---:|---:|---|---:|---|")
        for r in sim_rows:
            print(f"| {r['stations']} | {r['path']} | {r['tok_s']:.0f} | {r['x_p1']:.2f} | {r['target_x']:.1f} "
                  f"| {'yes' if r['met'] else 'NO'} | {r['cpu_ms_per_step']:.2f} | {r['orch_core_pct']:.0f} "
                  f"| {r['x_p1_rounds']} | {r['hop_p50_ms']:.2f} "
                  f"| {r['hop_p99_ms']:.2f} | {r['hop_p50_ms_by_station']} | {r['turn_p50_ms_by_station'] or '-'} "
                  f"| {r['orch_kib_per_step']:.1f} "
                  f"| {r['wall_ms_per_step']:.1f} | {r['waves']} | {r['station_cpu_ms_per_step']} "
                  f"| {r['machine_cpu_pct']:.0f} | {r['limit']} ({r['limit_busy_pct']:.0f}) |")
    real_rows = [] if args.skip_real else real(args)
    if real_rows:
        print(f"\nReal compute (`bench` preset, {args.real_dtype} on {args.real_device}), hub vs direct, prompt 32, greedy")
        print("| stations | K | path | tok/s | ms/step | KiB through orchestrator/step | orchestrator CPU ms/step "
              "| hop p50 ms | wave calls | station CPU ms/step | tokens identical | tokens sha256 |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|")
        for r in real_rows:
            print(f"| {r['stations']} | {r['k']} | {r['path']} | {r['tok_s']:.1f} | {r['wall_ms_per_step']:.1f} "
                  f"| {r['orch_kib_per_step']:.1f} | {r['cpu_ms_per_step']:.2f} | {r['hop_p50_ms']:.2f} | {r['waves']} "
                  f"| {r['station_cpu_ms_per_step']} | {r['tokens_identical']} | {r['tokens_sha256']} |")
    print(f"load at end: {os.getloadavg()}")
    print(json.dumps({"simulated": sim_rows, "real": real_rows, "load_end": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
