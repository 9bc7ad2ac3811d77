"""Prefix cache on vs off in one run: requests sharing a long system prompt, and a mix that shares nothing.

    mesh bench serve --shared-prefix [--model DIR] [--requests 64] [--system-len 1024] [--question-len 32]
                     [--output-len 64] [--max-seqs 64] [--max-wave-tokens 512] [--repeats 3] [--mixed-requests 64]
                     [--quick]

(a) Shared prefix: N requests = one system prompt of --system-len random token ids + a question of its own
(--question-len ids), --output-len greedy tokens each (ignore_eos), all submitted together to a fresh Engine over
one in-process full-model Station. Throughput = output tokens / (first submit -> last result); time to first
token per request from its submit. (b) The serving benchmark's mixed workload (prompts 16-512, outputs 16-256,
random.Random(0); nothing shared beyond chance), same engine settings. The cache-on and cache-off runs alternate
(on, off, off, on, ...), medians over --repeats; the tokens of every request must be identical on and off.
The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from mesh.control.cli import resolve_model
from mesh.core.config import DTYPE_BYTES, ModelConfig, SchedulerConfig, StationSpec
from mesh.core.hostinfo import describe_machine
from mesh.core.params import SamplingParams
from orchestrator.engine import Engine
from orchestrator.pipeline import LocalLink
from serve import log, mixed_jobs
from station.kv import DEFAULT_BLOCK_TOKENS, blocks_for
from station.step import Station

TARGET_THROUGHPUT = 3.0  # shared prefix: tok/s with the cache over without
TARGET_TTFT = 5.0  # shared prefix: median TTFT without the cache over with


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's command line (`--quick` shrinks it to a smoke test)."""
    p = argparse.ArgumentParser(prog="mesh bench serve --shared-prefix", description=__doc__.split("\n")[0])
    p.add_argument("--shared-prefix", action="store_true", help="(selects this benchmark)")
    p.add_argument("--model", help="HF checkpoint dir or .gguf file (default: the built-in `bench` preset)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--max-wave-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mixed-requests", type=int, default=64, help="requests of the no-sharing mix (0: skip it)")
    p.add_argument("--quick", action="store_true", help="8 requests, system 128, output 8, 1 repeat, mix of 8")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.system_len, a.output_len, a.repeats, a.mixed_requests, a.max_seqs = 8, 128, 8, 1, 8, 8
    if min(a.requests, a.system_len, a.question_len, a.output_len, a.max_seqs, a.repeats) < 1 or a.mixed_requests < 0:
        p.error("counts and lengths must be >= 1 (--mixed-requests >= 0)")
    return a


def shared_jobs(n: int, system_len: int, question_len: int, output_len: int, vocab: int):
    """n prompts: one system prompt, then a question of each request's own (ids 3.. avoid special tokens)."""
    rng = random.Random(7)
    system = [rng.randrange(3, vocab) for _ in range(system_len)]
    return [(system + [rng.randrange(3, vocab) for _ in range(question_len)], output_len) for _ in range(n)]


def run(station: Station, cfg: ModelConfig, jobs, cache: bool, max_seqs: int, max_wave_tokens: int) -> dict:
    """Every job submitted at once to a fresh engine; wall time, throughput, TTFTs, the cache's counters."""
    sched = SchedulerConfig(max_seqs=max_seqs, max_wave_tokens=max(max_wave_tokens, max_seqs),
                            max_queue=max(256, len(jobs)), prefix_cache=cache)
    engine = Engine([LocalLink(station)], cfg, sched, None)
    try:
        t0 = time.perf_counter()
        streams = [engine.submit(ids, SamplingParams(max_tokens=o, ignore_eos=True)) for ids, o in jobs]
        outs = [s.result()[0] for s in streams]
        wall = time.perf_counter() - t0
        stats = engine.stats()
        engine.quiesce()
    finally:
        engine.close()
    ttft = [s.first_token_at - s.arrival for s in streams]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"seconds": wall, "tok_s": tokens / wall, "ttft_median_s": statistics.median(ttft),
            "ttft_p90_s": sorted(ttft)[int(0.9 * (len(ttft) - 1))], "prefill_rows": stats.prefill_tokens,
            "cache_hits": stats.prefix_cache_hits, "cache_queries": stats.prefix_cache_queries,
            "cache_enabled": stats.prefix_cache, "outputs": [o.token_ids for o in outs]}


def alternate(station, cfg, jobs, args, label: str) -> dict:
    """Cache on and off, --repeats each in ABBA order (on, off, off, on, ...): medians, ratios, and whether the
    tokens matched."""
    runs = {True: [], False: []}
    for rep in range(args.repeats):
        for cache in ((True, False) if rep % 2 == 0 else (False, True)):  # ABBA: neither side always goes first
            r = run(station, cfg, jobs, cache, args.max_seqs, args.max_wave_tokens)
            runs[cache].append(r)
            log(f"{label} repeat {rep + 1}/{args.repeats} cache {'on ' if cache else 'off'}: {r['tok_s']:.1f} tok/s, "
                f"median TTFT {r['ttft_median_s']:.2f} s, prefill rows {r['prefill_rows']}")
    same = all(r["outputs"] == runs[False][0]["outputs"] for r in runs[True] + runs[False])
    med = {c: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "tok_s", "ttft_median_s", "ttft_p90_s")}
           for c, rs in runs.items()}
    last = {c: {k: v for k, v in rs[-1].items() if k != "outputs"} for c, rs in runs.items()}
    return {"on": {**med[True], **{k: last[True][k] for k in ("prefill_rows", "cache_hits", "cache_queries")}},
            "off": {**med[False], "prefill_rows": last[False]["prefill_rows"]},
            "throughput_ratio": med[True]["tok_s"] / med[False]["tok_s"],
            "ttft_ratio": med[False]["ttft_median_s"] / med[True]["ttft_median_s"],
            "paired_throughput_ratios": [a["tok_s"] / b["tok_s"] for a, b in zip(runs[True], runs[False])],
            "tokens_identical": same, "cache_enabled": last[True]["cache_enabled"]}


def main(argv: list[str] | None = None) -> int:
    """Run both workloads with the cache on and off, print the table, end with one JSON line."""
    args = parse_args(argv)
    mach = describe_machine()
    model_dir = resolve_model(args.model, "bench")
    cfg = ModelConfig.from_dir(model_dir)
    shared = shared_jobs(args.requests, args.system_len, args.question_len, args.output_len, cfg.vocab_size)
    mixed = mixed_jobs(args.mixed_requests, 1.0, cfg.vocab_size) if args.mixed_requests else []
    longest = max(len(p) + o for p, o in shared + mixed)
    block_bytes = (DEFAULT_BLOCK_TOKENS * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
                   * DTYPE_BYTES["float32"])
    kv_bytes = (max(args.max_seqs, 1) * blocks_for(longest, DEFAULT_BLOCK_TOKENS) + 1) * block_bytes
    station = Station(model_dir, StationSpec(layers=(0, cfg.num_hidden_layers), kv_bytes=kv_bytes))
    log(f"model {model_dir} ({cfg.num_hidden_layers} layers, float32, {station.linear_backend} linears), "
        f"KV {kv_bytes / 2**20:.0f} MiB; prefill chunk-invariant: {station.prefill_chunk_invariant}")
    run(station, cfg, shared_jobs(2, 32, 4, 2, cfg.vocab_size), True, 2, args.max_wave_tokens)  # warm-up
    result = {"shared_prefix": alternate(station, cfg, shared, args, "shared")}
    if mixed:
        result["mixed"] = alternate(station, cfg, mixed, args, "mixed")
    sp = result["shared_prefix"]
    print(f"\n{'workload':<14} {'cache':>5} {'tok/s':>8} {'wall s':>7} {'TTFT p50':>9} {'TTFT p90':>9}")
    for name, r in result.items():
        for side in ("on", "off"):
            d = r[side]
            print(f"{name:<14} {side:>5} {d['tok_s']:>8.1f} {d['seconds']:>7.2f} {d['ttft_median_s']:>9.3f} "
                  f"{d['ttft_p90_s']:>9.3f}")
        print(f"{'':<14} ratio {r['throughput_ratio']:>7.2f}x throughput, {r['ttft_ratio']:.2f}x median TTFT; "
              f"tokens identical on/off: {r['tokens_identical']}")
    met = {"throughput": sp["throughput_ratio"] >= TARGET_THROUGHPUT, "ttft": sp["ttft_ratio"] >= TARGET_TTFT}
    print(f"targets (shared prefix): throughput >= {TARGET_THROUGHPUT:.0f}x: {sp['throughput_ratio']:.2f}x "
          f"({'met' if met['throughput'] else 'NOT met'}); median TTFT >= {TARGET_TTFT:.0f}x: {sp['ttft_ratio']:.2f}x "
          f"({'met' if met['ttft'] else 'NOT met'})"
          + (f"; mixed (no sharing) on/off {result['mixed']['throughput_ratio']:.2f}x" if mixed else ""))
    print(f"machine: {mach['cpu']}, {mach['cores']} cores, torch threads {mach['torch_threads']}, "
          f"load {mach['loadavg_1m']}")
    print(json.dumps({**result, "targets_met": met, "requests": args.requests, "system_len": args.system_len,
                      "question_len": args.question_len, "output_len": args.output_len, "max_seqs": args.max_seqs,
                      "max_wave_tokens": args.max_wave_tokens, "repeats": args.repeats, "model": str(model_dir),
                      "machine": mach}))
    return 0 if sp["tokens_identical"] and (not mixed or result["mixed"]["tokens_identical"]) else 1


if __name__ == "__main__":
    sys.exit(main())
