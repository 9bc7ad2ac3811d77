"""CUDA graphs against the eager torch path on one device: the same waves through two stations, one replaying decode
waves as graphs (station.decode_graphs) and one eager, every step's logits compared bit for bit and each side's
decode waves timed. `python bench/decode_graphs_check.py --device cuda` (bench/device_check.sh's `graphs` part).

Two wave kinds per batch: `uniform` (every prompt the same length: every decode wave is one group, replayed) and
`varied` (prompt lengths spread over two KV blocks: a wave of several block counts runs eagerly on both sides until
the rows share one count). On the CPU nothing is captured: the graph side runs its recorded input tensors eagerly
(a check of this script, not a speed figure).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from mesh.control.cli import resolve_model
from mesh.core.config import ModelConfig, StationSpec
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.decode_graphs import DecodeGraphs
from station.step import Station

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def _stations(model: str, device: str, dtype: str) -> tuple[Station, Station]:
    layers = ModelConfig.from_dir(model).num_hidden_layers
    spec = dict(layers=(0, layers), device=device, dtype=dtype, kv_bytes=2**30, linear_backend="aten")
    eager, graphs = Station(model, StationSpec(**spec, cuda_graphs=False)), Station(model, StationSpec(**spec))
    if graphs.graphs is None:  # the CPU: the recorded input tensors, run eagerly (no capture)
        graphs.graphs = DecodeGraphs(graphs.model, graphs.kv, graphs.device, capture=False)
    return eager, graphs


def _timed(st: Station, entries, token_ids):
    if st.device.type == "cuda":
        torch.cuda.synchronize(st.device)
    t0 = time.perf_counter()
    out = st.forward(entries, token_ids=token_ids, want_logits=True)  # sampling reads the tokens back: synchronous
    return out, time.perf_counter() - t0


def compare(eager: Station, graphs: Station, lengths: list[int], steps: int, vocab: int, base: int) -> dict:
    """Prefill prompts of `lengths`, then `steps` decode waves through both stations; bit-equal steps and timings."""
    g = torch.Generator().manual_seed(base)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    seqs = [base + i for i in range(len(lengths))]
    prefill = tuple(WaveEntry(s, 0, n, GREEDY) for s, n in zip(seqs, lengths))
    ids = torch.cat(prompts)
    a, b = (st.forward(prefill, token_ids=ids, want_logits=True) for st in (eager, graphs))
    equal, same_tokens = [torch.equal(a.logits, b.logits)], a.samples == b.samples
    t_eager, t_graph = [], []
    replays0 = graphs.graphs.replays
    for k in range(steps):
        decode = tuple(WaveEntry(s, n + k, 1, GREEDY) for s, n in zip(seqs, lengths))
        token_ids = torch.tensor([t.token_id for t in a.samples])
        (a, ta), (b, tb) = _timed(eager, decode, token_ids), _timed(graphs, decode, token_ids)
        equal.append(torch.equal(a.logits, b.logits))
        same_tokens &= a.samples == b.samples
        t_eager.append(ta)
        t_graph.append(tb)
    for st in (eager, graphs):
        st.release(seqs)
    half = len(t_eager) // 2  # the later half: capture costs and lazy set-ups are in the first waves
    return {"waves_bit_equal": f"{sum(equal)}/{len(equal)}", "tokens_equal": same_tokens,
            "eager_ms": 1000 * statistics.median(t_eager[half:]), "graph_ms": 1000 * statistics.median(t_graph[half:]),
            "replayed": graphs.graphs.replays - replays0, "captured_total": graphs.graphs.captures}


def main(argv: list[str] | None = None) -> int:
    """Compare the two paths per preset, dtype, batch and wave kind; one line each."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--presets", default="tiny:float32,bench:bfloat16,bench:float32")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device {args.device}; {args.steps} decode waves per batch; wave times are the medians of the later half"
          + ("" if args.device.startswith("cuda") else " (CPU: no capture, a check of the script only)"))
    for item in args.presets.split(","):
        preset, dtype = item.split(":")
        model = resolve_model(None, preset)
        eager, graphs = _stations(model, args.device, dtype)
        vocab = eager.config.vocab_size
        for batch in (int(b) for b in args.batches.split(",")):
            for kind, lengths in (("uniform", [64] * batch), ("varied", [40 + (7 * i) % 24 for i in range(batch)])):
                r = compare(eager, graphs, lengths, args.steps, vocab, 1000 * batch + (kind == "varied") * 500)
                print(f"{preset} {dtype} batch {batch:>2} {kind:>7}: logits bit-equal in {r['waves_bit_equal']} waves, "
                      f"tokens equal {r['tokens_equal']}; decode wave eager {r['eager_ms']:.2f} ms, graphs "
                      f"{r['graph_ms']:.2f} ms ({r['eager_ms'] / r['graph_ms']:.1f}x); {r['replayed']} waves replayed, "
                      f"{r['captured_total']} shapes captured so far", flush=True)
        if graphs.graphs.failed:
            print(f"{preset} {dtype}: capture FAILED, the graph side ran eagerly: {graphs.graphs.failed}")
        del eager, graphs
    return 0


if __name__ == "__main__":
    sys.exit(main())
