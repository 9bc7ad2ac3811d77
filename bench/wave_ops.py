"""`python bench/wave_ops.py`: how many torch calls one wave makes on the torch path, and what a wave costs.

    python bench/wave_ops.py [--model bench] [--device cuda] [--dtype bfloat16] [--rows 64] [--repeats 7]

A station on the torch path (bfloat16, CUDA) launches its work op by op from Python: when the device is fast,
the host's time per call, not the device, sets a wave's time. For three waves of --rows decode rows (all at one
length; at lengths spanning several KV block counts; the second plus one 8-token prompt chunk) it prints the
median wall time of the wave (the device synchronised), the number of torch operator calls (views included)
and, on CUDA, of device kernels, both counted by torch.profiler. The last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from mesh.control.cli import resolve_model
from mesh.core.config import ModelConfig, StationSpec
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.step import Station

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)


def build_wave(station: Station, kind: str, rows: int) -> tuple[tuple[WaveEntry, ...], torch.Tensor]:
    """Prefill `rows` sequences (untimed) and return one decode wave over them (+ a prompt chunk for "mixed")."""
    lens = [32] * rows if kind == "uniform" else [17 + (i * 3) % 60 for i in range(rows)]
    for i, n in enumerate(lens):
        station.forward((WaveEntry(i, 0, n, None),), token_ids=torch.randint(3, 500, (n,)))
    entries = [WaveEntry(i, n, 1, GREEDY) for i, n in enumerate(lens)]
    if kind == "mixed":
        station.forward((WaveEntry(rows, 0, 8, None),), token_ids=torch.randint(3, 500, (8,)))
        entries.append(WaveEntry(rows, 8, 8, GREEDY))
    return tuple(entries), torch.randint(3, 500, (sum(e.n_tokens for e in entries),))


def measure(station: Station, kind: str, rows: int, repeats: int, cuda: bool) -> dict:
    """Time the same wave `repeats` times (its KV cut back after each), then count its calls once."""
    entries, ids = build_wave(station, kind, rows)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    run = lambda: station._forward(entries, ids, None, False)  # this thread, so the profiler sees every call
    undo = lambda: [station.kv.truncate(e.seq_id, e.start_pos) for e in entries]
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
        undo()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        run()
        sync()
    undo()
    station.release([e.seq_id for e in entries])
    events = prof.events()
    calls = sum(1 for e in events if e.name.startswith("aten::") and
                (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA) if cuda else None
    ms = 1000 * statistics.median(times[1:] if len(times) > 1 else times)
    return {"wave": kind, "entries": len(entries), "rows": int(ids.shape[0]), "ms": ms, "torch_calls": calls,
            "kernels": kernels}


def main(argv: list[str] | None = None) -> int:
    """Print one line per wave kind and a JSON line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bench", help="a preset name or a checkpoint directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    model_dir = resolve_model(None, args.model)
    cfg = ModelConfig.from_dir(model_dir)
    station = Station(model_dir, StationSpec(layers=(0, cfg.num_hidden_layers), device=args.device, dtype=args.dtype))
    cuda = args.device.startswith("cuda")
    print(f"model {model_dir} ({cfg.num_hidden_layers} layers, {args.dtype} on {args.device}), {args.rows} decode rows")
    rows = [measure(station, kind, args.rows, args.repeats, cuda) for kind in ("uniform", "varied", "mixed")]
    for r in rows:
        print(f"{r['wave']:8s} {r['entries']:3d} entries {r['rows']:3d} rows: {r['ms']:7.2f} ms a wave, "
              f"{r['torch_calls']} torch calls" + (f", {r['kernels']} kernels" if cuda else ""))
    print(json.dumps({"model": str(model_dir), "device": args.device, "dtype": args.dtype, "waves": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
