"""Mesh benchmark: the in-process engine vs 1, 2 and 3 stations over Ray + gRPC, at 1 and 16 concurrent requests.

    python bench/chain.py [--model DIR] [--configs inproc,1,2,3] [--concurrency 1,16] [--prompt 32] [--tokens 32]
                         [--max-seqs 16] [--repeats 3] [--dtype float32] [--hidden-path direct|hub] [--quick]
    mesh bench mesh ...  (same arguments)

Configurations: `inproc` is an Engine over LocalLink(Station(full model)) in this process (torch's default
threads); `N` is a Cluster of N Ray station actors (layer split by --balance, plan_layers) driven over gRPC.
A lone station gets every core (num_cpus = torch threads = cores); in an N-station pipeline each gets
max(1, cores // N), so the stations do not oversubscribe the machine. Every configuration is started once and
kept up; repeats are the outer loop and configurations alternate inside it, so all share the machine's load.

One point: K equal requests (prompt P random ids, T output tokens, greedy, ignore_eos; with --min-tokens M each
request's T drawn from [M, T], the same draw for every config) submitted at once; wall time first submit -> last
result; aggregate tok/s = output tokens / wall (median over repeats). Every station link is
wrapped to record, per forward call, the link's wall time (RPC round trip included), the station's own compute
seconds (reported in each reply) and what crossed the wire (the protobuf ByteSize of each ForwardRequest,
ForwardReply and ReleaseRequest, computed after the timed run; on the direct path, the default as in the YAML, that
is the orchestrator's traffic only: token ids out, samples back, the hidden rows going station to station, and a
relayed station's seconds come from the first station's reply). Per wave: wall / waves, the slowest station's
compute / waves, and orchestration overhead = (wall - max station compute) / waves.
Targets (reported, never asserted): 1 station over gRPC >= 0.9x in-process, and 2 pipelined stations >= 0.9x
1 station, at the largest concurrency (16). The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from call_shape import add_call_shape_args, min_tokens_problem, mixed_lengths  # bench/ is on sys.path
from idle_parts import idle_parts, ring_handoffs
from metered_link import MeteredLink

from mesh.control.cli import resolve_model
from mesh.core.hostinfo import cpu_seconds_by_role, describe_machine
from mesh.core.long_lived import freeze_long_lived
from mesh.control.mesh_config import MeshConfig, ModelSource
from mesh.control.layer_plan import plan_layers, split_weights
from mesh.core.config import SUPPORTED_DTYPES, ModelConfig, SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from orchestrator.engine import Engine
from orchestrator.pipeline import LocalLink
from station.step import Station

TARGET = 0.9  # 1 station over gRPC vs in-process, and 2 stations vs 1 station, at the top concurrency
log = lambda msg: print(msg, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line (`--quick` shrinks it to a smoke test)."""
    p = argparse.ArgumentParser(prog="mesh bench mesh", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF checkpoint dir (default: the built-in `bench` preset; `tiny` with --quick)")
    p.add_argument("--configs", help="comma-separated: inproc and/or station counts (default inproc,1,2,3)")
    p.add_argument("--concurrency", help="comma-separated request counts (default 1,16)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--tokens", type=int, help="output tokens per request (default 32)")
    p.add_argument("--min-tokens", type=int, help="mixed lengths: each request's max_tokens drawn from [N, --tokens] "
                   "(seeded by K: the same workload on every config and run; default: all --tokens)")
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--balance", default="memory", choices=["memory", "compute"],
                   help="how station counts are split (MeshConfig.balance)")
    p.add_argument("--hidden-path", default="direct", choices=["direct", "hub"],
                   help="hidden rows station to station (the YAML default) or through the orchestrator")
    p.add_argument("--max-wave-tokens", type=int, help="rows in one wave (SchedulerConfig.max_wave_tokens; default "
                   "max(512, --max-seqs))")
    p.add_argument("--extra-waves", type=int, default=0,
                   help="waves in flight beyond one per station (SchedulerConfig.extra_waves), every config")
    add_call_shape_args(p)
    p.add_argument("--repeats", type=int, help="repeats of every point, median (default 3)")
    p.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES)
    p.add_argument("--station-cpus", type=float, help="num_cpus of every station (default: cores // stations)")
    p.add_argument("--quick", action="store_true", help="defaults: tiny model, concurrency 1,4, 8 tokens, configs "
                   "inproc,1,2, 1 repeat (explicit flags still win)")
    a = p.parse_args(argv)
    for name, full, quick in (("concurrency", "1,16", "1,4"), ("tokens", 32, 8), ("configs", "inproc,1,2,3",
                                                                                   "inproc,1,2"), ("repeats", 3, 1)):
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    try:
        a.concurrency = [int(k) for k in a.concurrency.split(",") if k.strip()]
        a.configs = [c.strip() for c in a.configs.split(",") if c.strip()]
        bad = [c for c in a.configs if c != "inproc" and not (c.isdigit() and int(c) >= 1)]
    except ValueError:
        p.error("--concurrency: expected comma-separated integers")
    if bad or not a.configs:
        p.error(f"--configs: expected inproc and/or station counts >= 1, got {bad or 'nothing'}")
    if not a.concurrency or min(a.concurrency + [a.prompt, a.tokens, a.max_seqs, a.repeats]) < 1:
        p.error("concurrency, --prompt, --tokens, --max-seqs and --repeats must be >= 1")
    if (problem := min_tokens_problem(a.min_tokens, a.tokens)) is not None:
        p.error(problem)
    return a


def station_specs(cfg: ModelConfig, count: int, dtype: str, balance: str = "memory",
                  cpus: float | None = None) -> tuple[StationSpec, ...]:
    """`count` stations split by `balance`, each with `cpus` (default max(1, cores // count)) CPUs (= its torch
    threads, and its pinned cores where the machine has them free)."""
    cpus = float(max(1, (os.cpu_count() or 1) // count)) if cpus is None else cpus
    ranges = plan_layers(cfg.num_hidden_layers, count, split_weights(cfg, dtype, balance))
    return tuple(StationSpec(layers=r, dtype=dtype, num_cpus=cpus) for r in ranges)


def jobs(k: int, prompt: int, vocab: int) -> list[list[int]]:
    """K distinct prompts of equal length (ids 3.. avoid the special tokens)."""
    rng = random.Random(1000 + k)
    return [[rng.randrange(3, vocab) for _ in range(prompt)] for _ in range(k)]


def lengths(k: int, tokens: int, min_tokens: int | None) -> list[int]:
    """K requests' max_tokens: all `tokens`, or (min_tokens given) each drawn from [min_tokens, tokens], seeded by K."""
    return [tokens] * k if min_tokens is None else mixed_lengths(k, tokens, min_tokens, seed=2000 + k)


def run_point(engine: Engine, links: list[MeteredLink], prompts: list[list[int]], tokens: list[int]) -> dict:
    """Submit every prompt, one after another as fast as this thread can (the wave loop plans from the first, so a
    run may open with a few small prompt waves); wall time first submit -> last result, and where the time went
    per wave. `tokens`: each request's max_tokens."""
    engine.quiesce()
    waves0 = engine.stats().waves
    for link in links:
        link.reset()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in tokens]
    cpu0, t0, wall0 = cpu_seconds_by_role(), time.perf_counter(), time.time()
    streams = [engine.submit(ids, sp) for ids, sp in zip(prompts, params)]
    outs = [s.result(timeout=600)[0] for s in streams]
    wall, cpu, wall1 = time.perf_counter() - t0, cpu_seconds_by_role(), time.time()
    if not engine.quiesce():
        raise RuntimeError("the engine did not go idle after the run")
    waves = engine.stats().waves - waves0
    bad = [o.finish_reason for o in outs if o.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"requests ended with {bad[:3]} instead of 'length'")
    n = sum(len(o.token_ids) for o in outs)
    compute = [link.compute_s for link in links]
    wire = [link.wire_bytes() for link in links]
    total = {key: sum(w[key] for w in wire) for key in ("request", "reply", "release", "hidden_payload")}
    remote = links[0].remote
    ms = lambda s: 1e3 * s / max(waves, 1)  # seconds -> ms per wave
    return {
        "tok_s": n / wall, "tokens": n, "seconds": wall, "waves": waves, "wall_ms_per_wave": ms(wall),
        "station_compute_ms_per_wave": [ms(c) for c in compute],
        "link_call_ms_per_wave": [ms(link.call_s) for link in links],
        "release_ms_total": [1e3 * link.release_s for link in links],
        "max_compute_ms_per_wave": ms(max(compute)),
        "overhead_ms_per_wave": ms(wall - max(compute)),
        "sum_compute_ms_per_wave": ms(sum(compute)),  # with one wave in flight (K=1) the stations run in series
        "serial_overhead_ms_per_wave": ms(wall - sum(compute)),
        "rpc_ms_per_call": ([1e3 * (link.call_s - link.compute_s) / max(link.calls, 1) for link in links]
                            if remote else None),
        "station_busy_fraction": [c / wall for c in compute],
        "cpu_ms_per_wave": {role: ms(cpu[role] - cpu0[role]) for role in cpu},  # where the cores went
        "wire_bytes_per_wave": (total["request"] + total["reply"] + total["release"]) / max(waves, 1) if remote else 0,
        "wire_bytes_per_wave_split": {k: v / max(waves, 1) for k, v in total.items()} if remote else None,
        "wall_window": (wall0, wall1),  # the run on the wall clock, for the stations' step spans (idle_parts)
        "outputs": [o.token_ids for o in outs],
        "outputs_sha256": hashlib.sha256(json.dumps([o.token_ids for o in outs]).encode()).hexdigest(),
    }


def start_configs(args, model_dir: Path, cfg: ModelConfig, sched: SchedulerConfig, up: dict) -> None:
    """Start every configuration into `up`: {name: (engine, metered links, station description, cluster or None)}."""
    counts = [int(c) for c in args.configs if c != "inproc"]
    if counts:
        import ray

        from mesh.control.cluster import Cluster
    if counts and not ray.is_initialized():
        need = sum((os.cpu_count() or 1) if c == 1 else c * max(1, (os.cpu_count() or 1) // c) for c in counts)
        ray.init(num_cpus=max(16, need + 2), include_dashboard=False, namespace="wavemesh-bench",
                 logging_level="ERROR", log_to_driver=False)
    for name in args.configs:
        if name == "inproc":
            spec = StationSpec(layers=(0, cfg.num_hidden_layers), dtype=args.dtype)
            links = [MeteredLink(LocalLink(Station(model_dir, spec)), remote=False)]
            desc = [{"layers": list(spec.layers), "torch_threads": torch.get_num_threads(), "where": "in-process"}]
            up[name] = (Engine(links, cfg, sched, None), links, desc, None)
            continue
        specs = station_specs(cfg, int(name), args.dtype, args.balance, args.station_cpus)
        mesh_cfg = MeshConfig(model=ModelSource(path=str(model_dir)), dtype=args.dtype, stations=specs,
                              scheduler=sched)
        cluster = Cluster(mesh_cfg, model_dir, progress=log)
        cluster.start()
        links = [MeteredLink(link, remote=True) for link in cluster.engine.pipeline.links]
        cluster.engine.switch_route(links)  # same stations, now metered (on the configured hidden path)
        placed = cluster.status()["stations"]
        desc = [{"layers": list(s.layers), "num_cpus": s.num_cpus, "torch_threads": st.get("torch_threads"),
                 "cpu_affinity": st.get("cpu_affinity"), "cpu_pinned": st.get("cpu_pinned"), "where": "ray+grpc"}
                for s, st in zip(specs, placed)]
        for s, st in zip(specs, placed):
            if s.num_cpus >= 1 and not st.get("cpu_pinned"):  # its cores held by a config started before it
                log(f"WARNING: config {name}: station {list(s.layers)} runs unpinned ({st.get('cpu_pinning_note')}); "
                    "its figures are not a core-quota measurement: run such configs in separate commands")
        up[name] = (cluster.engine, links, desc, cluster)
    freeze_long_lived()  # as a serving process does once it is up (mesh/core/long_lived.py)


def stop_configs(up: dict) -> None:
    """Stop every engine and cluster that was started, then the Ray this benchmark started."""
    for engine, _, _, cluster in up.values():
        if cluster is not None:
            cluster.stop()
        else:
            engine.close()
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()


def main(argv: list[str] | None = None) -> int:
    """Start every configuration, run the points, print the table, end with one JSON line."""
    args = parse_args(argv)
    mach = describe_machine()
    model_dir = resolve_model(args.model, "tiny" if args.quick else "bench")
    cfg = ModelConfig.from_dir(model_dir)
    sched = SchedulerConfig(max_seqs=args.max_seqs, max_wave_tokens=args.max_wave_tokens or max(512, args.max_seqs),
                            max_queue=max(256, *args.concurrency), extra_waves=args.extra_waves,
                            hidden_path=args.hidden_path, decode_steps=args.decode_steps,
                            reply_steps=args.reply_steps)
    log(f"model {model_dir} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {args.dtype}, cpu); "
        f"configs {args.configs}; K {args.concurrency}; prompt {args.prompt}, "
        f"{args.tokens if args.min_tokens is None else f'{args.min_tokens}-{args.tokens} (mixed)'} tokens; "
        f"{args.repeats} repeats")
    up: dict[str, tuple] = {}
    runs: dict[str, dict[int, list[dict]]] = {c: {k: [] for k in args.concurrency} for c in args.configs}
    try:
        start_configs(args, model_dir, cfg, sched, up)
        for name, (engine, links, _, _) in up.items():  # warm-up: every wave shape once
            top = max(args.concurrency)
            run_point(engine, links, jobs(top, args.prompt, cfg.vocab_size), [2] * top)
        for rep in range(args.repeats):
            for name, (engine, links, _, _) in up.items():
                for k in args.concurrency:
                    r = run_point(engine, links, jobs(k, args.prompt, cfg.vocab_size),
                                  lengths(k, args.tokens, args.min_tokens))
                    if up[name][3] is not None:  # a Ray mesh: where each station's idle went (bench/idle_parts.py)
                        spans = up[name][3].step_spans()
                        r["idle_parts"] = [idle_parts(s, *r["wall_window"]) for s in spans]
                        r["ring"] = ring_handoffs(spans, *r["wall_window"])
                    runs[name][k].append(r)
                    log(f"[{rep + 1}/{args.repeats}] {name:>6} K={k:<3} {r['tok_s']:8.1f} tok/s "
                        f"({r['waves']} waves, {r['wall_ms_per_wave']:.1f} ms/wave, "
                        f"overhead {r['overhead_ms_per_wave']:.1f} ms/wave)")
    finally:
        stop_configs(up)

    tok_s = {c: {str(k): statistics.median(r["tok_s"] for r in runs[c][k]) for k in args.concurrency}
             for c in args.configs}
    detail = {c: {str(k): {key: v for key, v in sorted(runs[c][k], key=lambda r: r["tok_s"])[len(runs[c][k]) // 2]
                           .items() if key != "outputs"} for k in args.concurrency} for c in args.configs}
    match = {c: (all(r["outputs"] == runs["inproc"][k][0]["outputs"] for k in args.concurrency for r in runs[c][k])
                 if "inproc" in runs else None) for c in args.configs}
    top = str(max(args.concurrency))

    def target(a: str, b: str) -> dict:
        got = tok_s[a][top] / tok_s[b][top] if a in tok_s and b in tok_s else None
        return {"want": TARGET, "at_concurrency": int(top), "got": got, "met": None if got is None else got >= TARGET}

    targets = {"grpc1_vs_inproc": target("1", "inproc"), "pipe2_vs_grpc1": target("2", "1")}

    print(f"\n{'config':>6} {'stations (layers x threads)':<30} {'K':>3} {'tok/s':>8} {'vs inproc':>9} {'waves':>5} "
          f"{'ms/wave':>8} {'max comp':>8} {'sum comp':>8} {'overhead':>8} {'rpc/call':>8} {'wire KiB/w':>10} "
          f"{'cpu ms/wave d/w/o':>18}")
    for c in args.configs:
        st = " ".join(f"{d['layers'][0]}-{d['layers'][1]}x{d['torch_threads']}" for d in up[c][2])
        for k in args.concurrency:
            d, key = detail[c][str(k)], str(k)
            rel = f"{tok_s[c][key] / tok_s['inproc'][key]:.2f}x" if "inproc" in tok_s else "-"
            rpc = "-" if d["rpc_ms_per_call"] is None else f"{max(d['rpc_ms_per_call']):.2f}"
            print(f"{c:>6} {st:<30} {k:>3} {tok_s[c][key]:>8.1f} {rel:>9} {d['waves']:>5} "
                  f"{d['wall_ms_per_wave']:>8.2f} {d['max_compute_ms_per_wave']:>8.2f} "
                  f"{d['sum_compute_ms_per_wave']:>8.2f} {d['overhead_ms_per_wave']:>8.2f} {rpc:>8} "
                  f"{d['wire_bytes_per_wave'] / 1024:>10.1f} "
                  f"{'/'.join(f'{v:.1f}' for v in d['cpu_ms_per_wave'].values()):>18}")
    print("(ms per wave; max comp = the slowest station's own compute, sum comp = all stations' (the floor when "
          "waves cannot overlap, as at K=1); overhead = wall/wave - max comp; rpc/call = link call - station "
          "compute, worst station; wire = protobuf bytes of requests, replies and releases per wave; cpu = CPU ms per "
          "wave of this driver / Ray worker processes (the stations) / every other process, against cores x "
          "ms/wave available)")
    for name, t in targets.items():
        got = "not measured" if t["got"] is None else f"{t['got']:.2f}x ({'met' if t['met'] else 'NOT met'})"
        print(f"target {name} >= {TARGET}x at K={top}: {got}")
    if "inproc" in tok_s:
        print(f"greedy tokens identical to in-process: {match}")
    print(f"machine: {mach['cpu']}, {mach['cores']} cores, torch {mach['torch']} (driver {mach['torch_threads']} "
          f"threads), load {mach['loadavg_1m']} at start, {os.getloadavg()[0]:.2f} at end")
    figures = {
        "tok_s": tok_s, "detail": detail, "targets": targets, "tokens_match_inproc": match,
        "stations": {c: up[c][2] for c in args.configs}, "concurrency": args.concurrency, "prompt": args.prompt,
        "tokens": args.tokens, "min_tokens": args.min_tokens, "max_seqs": args.max_seqs,
        "extra_waves": args.extra_waves,
        "hidden_path": args.hidden_path, "balance": args.balance, "repeats": args.repeats, "dtype": args.dtype,
        "model": str(model_dir), "machine": mach, "loadavg_1m_end": os.getloadavg()[0],
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
