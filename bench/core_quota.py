"""Issue 13's core quota, alternated: two 1-core stations against one, round by round (a measurement, never serving).

    python bench/core_quota.py [--rounds 5] [--concurrency 32] [--prompt 32] [--tokens 64] [--repeats 3]
                               [--model DIR] [--quick] [--min-tokens N] [--max-wave-tokens N] [--ceiling STEPS]
    mesh bench core_quota ...  (same arguments)

Each round runs bench/chain.py twice, each in a process of its own (a configuration's stations hold their pinned
cores until its Ray stops, so one station and two never share a command): `--configs 1` and `--configs 2`, both
with `--station-cpus 1 --balance compute`, --concurrency greedy requests (max_seqs the same), the one-station run
first in odd rounds and second in even ones, so both meet the machine's drift alike. Per round: both tok/s (chain.py's
median over --repeats), their ratio and the outputs' sha256 prefix. Then the median ratio and how many rounds reached
the target (1.6x), whether every run drew the same tokens, and for the pair's runs the orchestrator's CPU per wave
and each station's busy fraction, with the ratio the pair would make at the same work were its busiest station never
idle (ratio / that station's busy fraction: what the idle costs; the split's own ceiling, `mesh bench
pipeline_ceiling`, measures the same from the other side), and where each station's idle went (before its first
step, its longest gap, the other gaps, after its last step: bench/idle_parts.py, from the stations' step
timelines), with the median of its decode steps, the lone station's too, and the ring's hand-offs (where a station
waited for the other, how long after the other's step ended it began: the hop, the samples' way back). Runs on this
VM type spread +-7%, so a figure is a median of rounds, never one run.
--ceiling STEPS runs bench/pipeline_ceiling.py before the first round and after the last (STEPS interleaved rounds,
the pair's split, --concurrency rows, the lone station's one thread, --contend): the split's ceiling that hour alone
and with the two stages sharing the machine's memory, beside the ratios (on session 52's AMD Zen 3 VM two stages
streaming weights at once slowed each other by up to ~35% in some hours, which no change to the chain can give
back).
--min-tokens (mixed lengths) and --max-wave-tokens measure other workloads the same way; they get no verdict.
The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from call_shape import min_tokens_problem  # bench/ is on sys.path when a bench script runs
from idle_parts import describe, describe_ring

CHAIN = Path(__file__).resolve().parent / "chain.py"
CEILING = Path(__file__).resolve().parent / "pipeline_ceiling.py"
TARGET = 1.6  # issue 13: two 1-core stations reach at least 1.6x one


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (`--quick`: the tiny checkpoint, 4 requests of 8 tokens, one round of one repeat)."""
    p = argparse.ArgumentParser(prog="mesh bench core_quota", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint dir (default: the built-in `bench` preset; `tiny` with --quick)")
    p.add_argument("--rounds", type=int, help="alternated rounds (default 5)")
    p.add_argument("--concurrency", type=int, help="concurrent greedy requests, and max_seqs (default 32)")
    p.add_argument("--prompt", type=int, help="prompt tokens per request (default 32)")
    p.add_argument("--tokens", type=int, help="output tokens per request (default 64)")
    p.add_argument("--repeats", type=int, help="chain.py's repeats per run, median (default 3)")
    p.add_argument("--max-wave-tokens", type=int, help="rows in one wave, both configs (default: chain.py's)")
    p.add_argument("--min-tokens", type=int, help="mixed lengths: max_tokens drawn from [N, --tokens] per request, "
                   "the same draw for both configs (chain.py --min-tokens; default: all --tokens)")
    p.add_argument("--quick", action="store_true", help="a smoke test: tiny model, 4 x 8 tokens, 1 round, 1 repeat")
    p.add_argument("--ceiling", type=int, default=0, metavar="STEPS",
                   help="also measure the split's ceiling (bench/pipeline_ceiling.py, STEPS interleaved rounds) "
                   "before the first round and after the last (default 0: not)")
    a = p.parse_args(argv)
    for name, full, quick in (("rounds", 5, 1), ("concurrency", 32, 4), ("prompt", 32, 8), ("tokens", 64, 8),
                              ("repeats", 3, 1)):
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
        if getattr(a, name) < 1:
            p.error(f"--{name}: must be >= 1, got {getattr(a, name)}")
    if (problem := min_tokens_problem(a.min_tokens, a.tokens)) is not None:
        p.error(problem)
    if a.ceiling < 0:
        p.error(f"--ceiling: must be >= 0, got {a.ceiling}")
    if a.max_wave_tokens is not None and a.max_wave_tokens < a.concurrency:
        p.error(f"--max-wave-tokens: must be >= --concurrency ({a.concurrency}), got {a.max_wave_tokens}")
    return a


def run_script(script: Path, args: argparse.Namespace, *options: str) -> dict:
    """`script` with `options` (and --model where one is given, the tiny checkpoint with --quick), in a process of
    its own: the JSON object its last line prints."""
    cmd = [sys.executable, str(script), *options]
    if args.model or args.quick:
        cmd += ["--model", args.model or "tiny"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_chain(args: argparse.Namespace, stations: int) -> dict:
    """One chain.py run of `stations` 1-core stations: its figures at the one concurrency, and `layers`, the
    stations' layer ranges as it ran them."""
    options = ["--configs", str(stations), "--station-cpus", "1", "--balance", "compute", "--concurrency",
               str(args.concurrency), "--max-seqs", str(args.concurrency), "--prompt", str(args.prompt), "--tokens",
               str(args.tokens), "--repeats", str(args.repeats)]
    if args.max_wave_tokens:
        options += ["--max-wave-tokens", str(args.max_wave_tokens)]
    if args.min_tokens:
        options += ["--min-tokens", str(args.min_tokens)]
    figures = run_script(CHAIN, args, *options)
    layers = [s["layers"] for s in figures["stations"][str(stations)]]
    return {**figures["detail"][str(stations)][str(args.concurrency)], "layers": layers}


def run_ceiling(args: argparse.Namespace, split: int) -> dict:
    """bench/pipeline_ceiling.py at the pair's split, --concurrency rows, the lone station's one thread, contended:
    its JSON figures."""
    return run_script(CEILING, args, "--rows", str(args.concurrency), "--whole-threads", "1", "--split", str(split),
                      "--steps", str(args.ceiling), "--contend", "--no-linears")


def pair_split(args: argparse.Namespace) -> int:
    """The first layer of the pair's second station, as chain.py plans it (`station_specs`, `--balance compute`)."""
    from chain import station_specs  # torch and the engine: imported only for --ceiling
    from mesh.control.cli import resolve_model
    from mesh.core.config import ModelConfig
    cfg = ModelConfig.from_dir(resolve_model(args.model, "tiny" if args.quick else "bench"))
    return station_specs(cfg, 2, "float32", "compute", 1.0)[1].start


def describe_ceiling(when: str, c: dict) -> str:
    """One line: the split's ceiling alone and contended, with their halves."""
    alone, contended = c["halves_ms"], c["halves_contended_ms"]
    return (f"the split's ceiling {when}: {c['ceiling']:.3f}x alone (halves {alone[0]:.1f} / {alone[1]:.1f} ms, the "
            f"whole {c['whole_ms']:.1f} ms), {c['ceiling_contended']:.3f}x with both stages stepping at once (halves "
            f"{contended[0]:.1f} / {contended[1]:.1f} ms)")


def _tokens(args: argparse.Namespace) -> str:
    return str(args.tokens) if args.min_tokens is None else f"{args.min_tokens}-{args.tokens} (mixed)"


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, print each and the summary, end with one JSON line."""
    args = parse_args(argv)
    print(f"core quota: {args.rounds} rounds of `chain.py --configs 1` and `--configs 2` (--station-cpus 1, "
          f"{args.concurrency} requests, prompt {args.prompt}, {_tokens(args)} tokens, {args.repeats} repeats"
          f"{'' if args.max_wave_tokens is None else f', --max-wave-tokens {args.max_wave_tokens}'})",
          file=sys.stderr, flush=True)
    ceilings = []
    if args.ceiling:
        split = pair_split(args)
        ceilings.append(run_ceiling(args, split))
        print(describe_ceiling("before the rounds", ceilings[0]), flush=True)
    rounds = []
    for r in range(args.rounds):
        order = (1, 2) if r % 2 == 0 else (2, 1)
        got = {n: run_chain(args, n) for n in order}
        one, two = got[1], got[2]
        lone = (one.get("idle_parts") or [None])[0]  # the lone station's steps (bench/idle_parts.py)
        ratio = two["tok_s"] / one["tok_s"]
        busiest = max(two["station_busy_fraction"])
        rounds.append({"one_tok_s": one["tok_s"], "two_tok_s": two["tok_s"], "ratio": ratio,
                       "ratio_never_idle": ratio / busiest,  # the same work, its busiest station never idle
                       "one_sha": one["outputs_sha256"], "two_sha": two["outputs_sha256"],
                       "orchestrator_cpu_ms_per_wave": two["cpu_ms_per_wave"]["driver"],
                       "wall_ms_per_wave": two["wall_ms_per_wave"], "busy": two["station_busy_fraction"],
                       "first_station_idle": two["idle_parts"][0], "second_station_idle": two["idle_parts"][1],
                       "lone_station_idle": lone, "pair_ring": two.get("ring"), "pair_layers": two["layers"]})
        print(f"round {r + 1}: one {one['tok_s']:.1f} tok/s, two {two['tok_s']:.1f} tok/s, {ratio:.3f}x, tokens "
              f"{one['outputs_sha256'][:12]} / {two['outputs_sha256'][:12]}, busy "
              f"{[round(b, 3) for b in two['station_busy_fraction']]} (never idle: {ratio / busiest:.3f}x)", flush=True)
        named = [("the lone station", lone)]
        named += [(f"the pair's {name} station", parts) for name, parts in zip(("first", "second"), two["idle_parts"])]
        for name, parts in named:
            if parts is not None:
                print(f"  {name}: {describe(parts)}", flush=True)
        if two.get("ring") is not None:
            print(f"  {describe_ring(two['ring'])}", flush=True)
    if args.ceiling:
        ceilings.append(run_ceiling(args, split))
        print(describe_ceiling("after the rounds", ceilings[1]), flush=True)
    ratios = [x["ratio"] for x in rounds]
    median = statistics.median(ratios)
    identical = len({x[k] for x in rounds for k in ("one_sha", "two_sha")}) == 1
    reached = sum(x >= TARGET for x in ratios)
    never_idle = statistics.median(x["ratio_never_idle"] for x in rounds)
    cpu = statistics.median(x["orchestrator_cpu_ms_per_wave"] for x in rounds)
    wall = statistics.median(x["wall_ms_per_wave"] for x in rounds)
    verdict = "target met at the median" if median >= TARGET else "target NOT met"
    if args.min_tokens is not None or args.max_wave_tokens is not None:
        verdict = "no verdict (not the issue's workload)"
    print(f"two stations / one: median {median:.3f}x over {len(ratios)} rounds ({min(ratios):.3f}-{max(ratios):.3f}x), "
          f"{reached} of {len(ratios)} at {TARGET}x or more: {verdict}; tokens identical in every run: "
          f"{identical}; the pair's orchestrator CPU {cpu:.1f} ms a wave of {wall:.1f} ms (medians); with its busiest "
          f"station never idle (the ratio / its busy fraction, the same work) the pair would make {never_idle:.3f}x "
          "(median): what its idle costs, and the split's ceiling with it")
    print(json.dumps({"rounds": rounds, "median_ratio": median, "median_ratio_never_idle": never_idle,
                      "target": TARGET, "rounds_at_target": reached,
                      "tokens_identical": identical, "concurrency": args.concurrency, "prompt": args.prompt,
                      "tokens": args.tokens, "min_tokens": args.min_tokens, "max_wave_tokens": args.max_wave_tokens,
                      "repeats": args.repeats,
                      "ceilings": [{k: c[k] for k in ("ceiling", "ceiling_contended", "whole_ms", "halves_ms",
                                                      "halves_contended_ms", "split")} for c in ceilings]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
