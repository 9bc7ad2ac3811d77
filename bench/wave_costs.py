"""What one station wave costs, by kind: a batch of prompts, a decode step at short and at long context.

    python bench/wave_costs.py [--model DIR] [--rows 16] [--prompt 32] [--long 400] [--steps 31] [--repeats 5]
    mesh bench wave_costs ...  (same arguments)

On one full-model station (the `bench` preset by default), median over repeats of: a prefill wave of
--rows prompts of --prompt tokens each (and the minor page faults the process took during it), then the
median of the --steps decode steps of those --rows rows that follow it; and the same decode figure after
prompts of --long tokens. Each repeat releases its KV, as a served batch ends. Only the Station API is used, so the same file run at an older commit measures that commit's
step (how the README's before/after figures for the step changes were taken). Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


import torch

from mesh.control.cli import resolve_model
from mesh.core.config import ModelConfig, StationSpec
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.step import Station

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)


def minor_faults() -> int:
    """Minor page faults of this process so far (Linux /proc; 0 elsewhere). mesh.core.hostinfo.minor_faults
    does the same; this file keeps its own so that it runs at commits older than that function."""
    try:
        return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[7])
    except OSError:
        return 0


def prompts_then_decode(station: Station, rows: int, prompt: int, steps: int, vocab: int) -> tuple[float, int, float]:
    """Prefill `rows` prompts in one wave, then decode `steps` tokens each (as a served batch does), then
    release: (prefill wave seconds, minor page faults during it, median decode step seconds)."""
    ids = torch.randint(3, vocab, (rows * prompt,), generator=torch.Generator().manual_seed(prompt))
    faults = minor_faults()
    out = station.forward(tuple(WaveEntry(i, 0, prompt, GREEDY) for i in range(rows)), token_ids=ids)
    prefill, faults = out.seconds, minor_faults() - faults
    decode = []
    for k in range(steps):
        toks = torch.tensor([s.token_id for s in out.samples])
        out = station.forward(tuple(WaveEntry(i, prompt + k, 1, GREEDY) for i in range(rows)), token_ids=toks)
        decode.append(out.seconds)
    station.release(list(range(rows)))
    return prefill, faults, statistics.median(decode)


def main(argv: list[str] | None = None) -> int:
    """Measure the three kinds of wave and print them, ending with one JSON line."""
    p = argparse.ArgumentParser(prog="mesh bench wave_costs", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF checkpoint dir (default: the built-in `bench` preset)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--long", type=int, default=400, help="prompt length before the long-context decode step")
    p.add_argument("--steps", type=int, default=31, help="decode steps after each prefill wave")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    model_dir = resolve_model(args.model, "bench")
    cfg = ModelConfig.from_dir(model_dir)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * args.rows * (args.long + 64)
    station = Station(model_dir, StationSpec(layers=(0, cfg.num_hidden_layers), kv_bytes=max(kv, 64 << 20)))
    prompts_then_decode(station, args.rows, args.prompt, args.steps, cfg.vocab_size)  # warm-up
    short = [prompts_then_decode(station, args.rows, args.prompt, args.steps, cfg.vocab_size) for _ in range(args.repeats)]
    long = [prompts_then_decode(station, args.rows, args.long, args.steps, cfg.vocab_size) for _ in range(args.repeats)]
    fig = {"prefill_ms": 1e3 * statistics.median(s[0] for s in short),
           "prefill_minor_faults": statistics.median(s[1] for s in short),
           "decode_ms": 1e3 * statistics.median(s[2] for s in short),
           "decode_long_ms": 1e3 * statistics.median(s[2] for s in long),
           "rows": args.rows, "prompt": args.prompt, "long": args.long, "steps": args.steps, "repeats": args.repeats,
           "model": str(model_dir)}
    print(f"prefill wave, {args.rows} x {args.prompt} tokens: {fig['prefill_ms']:.1f} ms, "
          f"{fig['prefill_minor_faults']:.0f} minor page faults")
    print(f"decode step, {args.rows} rows at {args.prompt + 1} keys: {fig['decode_ms']:.2f} ms")
    print(f"decode step, {args.rows} rows at {args.long + 1} keys: {fig['decode_long_ms']:.2f} ms")
    print(json.dumps(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
