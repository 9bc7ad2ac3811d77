"""Station step benchmark: decode tok/s of one full-model station vs Hugging Face `generate`, and the roofline.

    python bench/step.py [--model DIR] [--batches 1,4,16,32] [--prompt-len 64] [--steps 32] [--repeats 3]
                         [--dtype float32] [--device cpu] [--threads N] [--no-hf] [--hf-batches 1,16] [--quick]
                         [--profile]
    mesh bench step ...  (same arguments)

Both sides time decode only: our station prefills B prompts in one wave (which yields the first token)
and then N-1 one-token-per-sequence waves are timed; HF's decode time is t(generate N) - t(generate 1),
the same N-1 tokens per sequence. tok/s = B * (N - 1) / seconds, median (and best) over repeats. Repeats
are the outer loop with ours and HF alternating inside it, so both share a noisy machine's load; tok/s
per process-CPU second is reported too (the load-robust figure when run with --threads 1). The roofline
is the memory-bound ceiling: one read of every weight a step uses (of an untied embedding table, only the rows it
looks up) per step at the measured copy bandwidth. The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


import torch

from mesh.control.cli import resolve_model
from mesh.core.compute import on_compute_thread
from mesh.core.hostinfo import bandwidth_gb_s, describe_machine
from mesh.core.config import DTYPE_BYTES, SUPPORTED_DTYPES, ModelConfig, StationSpec
from mesh.core.model.gguf_file import transformers_source
from mesh.core.model.quant_linear import QuantEmbedding
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.kv import DEFAULT_BLOCK_TOKENS, blocks_for
from station.step import Station
from step_profile import format_profile, profile_decode  # bench/ is on sys.path when a bench script runs

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line (`--quick` shrinks it to a smoke test)."""
    p = argparse.ArgumentParser(prog="mesh bench step", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF checkpoint dir or .gguf file (default: the built-in `bench` preset)")
    p.add_argument("--batches", default="1,4,16,32", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="tokens generated per sequence (N >= 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES)
    p.add_argument("--linear-backend", default="auto", choices=["aten", "onednn", "packed", "auto"],
                   help="the station's matmul kernel (StationSpec.linear_backend)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs on a CUDA device (StationSpec.cuda_graphs off)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    p.add_argument("--hf-batches", default="1,16", help="the batches of --batches HF is also timed at")
    p.add_argument("--quick", action="store_true", help="batches 1,4; steps 8; repeats 1")
    p.add_argument("--profile", action="store_true",
                   help="also print where a decode step's time goes (linears, attention, sampling, other ops)")
    a = p.parse_args(argv)
    if a.quick:
        a.batches, a.steps, a.repeats = "1,4", 8, 1
    a.batches = [int(b) for b in a.batches.split(",") if b.strip()]
    try:
        a.hf_batches = [int(b) for b in a.hf_batches.split(",") if b.strip()]
    except ValueError:
        p.error(f"--hf-batches: expected comma-separated integers, got {a.hf_batches!r}")
    if a.steps < 2 or a.prompt_len < 1 or a.repeats < 1 or not a.batches or min(a.batches) < 1:
        p.error("need --steps >= 2, --prompt-len >= 1, --repeats >= 1 and batches >= 1")
    return a


def prompts(batch: int, length: int, vocab: int) -> torch.Tensor:
    """Distinct deterministic prompt ids [B, P] (ids 3.. avoid the special tokens)."""
    g = torch.Generator().manual_seed(1234 + batch)
    return torch.randint(3, vocab, (batch, length), generator=g)


def _sync(device: str) -> None:
    """Wait for queued GPU work so timers see it (no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _clock() -> tuple[float, float]:
    """(wall, process CPU) seconds; CPU time is robust to other processes only at --threads 1."""
    return time.perf_counter(), time.process_time()


def _since(t0: tuple[float, float]) -> tuple[float, float]:
    """(wall, cpu) seconds elapsed since a _clock() reading."""
    now = _clock()
    return now[0] - t0[0], now[1] - t0[1]


def run_ours(station: Station, ids: torch.Tensor, steps: int, device: str) -> tuple[tuple[float, float], list[int]]:
    """Prefill B prompts (untimed, yields token 1), then time steps-1 decode waves; ((wall, cpu) s, seq 0's tokens)."""
    b, p = ids.shape
    seqs = list(range(b))
    out = station.forward(tuple(WaveEntry(s, 0, p, GREEDY) for s in seqs), token_ids=ids.reshape(-1))
    tokens = [[t.token_id] for t in out.samples]
    _sync(device)
    t0 = _clock()
    for step in range(1, steps):
        entries = tuple(WaveEntry(s, p + step - 1, 1, GREEDY) for s in seqs)
        out = station.forward(entries, token_ids=torch.tensor([tok[-1] for tok in tokens]))
        for tok, sample in zip(tokens, out.samples):
            tok.append(sample.token_id)
    _sync(device)
    seconds = _since(t0)
    station.release(seqs)
    return seconds, tokens[0]


def run_hf(model, ids: torch.Tensor, n: int, device: str) -> tuple[tuple[float, float], list[int]]:
    """(wall, cpu) seconds of one greedy HF `generate` of exactly n new tokens per row (no EOS stop), seq 0's tokens."""
    _sync(device)
    t0 = _clock()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    _sync(device)
    return _since(t0), out[0, ids.shape[1]:].tolist()


def bench_decode(station: Station, hf_model, args: argparse.Namespace) -> dict[str, object]:
    """Decode tok/s (median and best of repeats, and per CPU second) for ours at every batch, HF at those of
    --hf-batches (1 and 16 by default).

    Repeats are the outer loop and ours/HF alternate inside it, so on a shared, noisy machine both sides
    see the same load. HF decode seconds = t(generate N) - t(generate 1).
    """
    vocab, n, dev = station.config.vocab_size, args.steps, args.device
    warm = prompts(1, args.prompt_len, vocab)
    run_ours(station, warm, min(n, 4), dev)
    hf_batches = [b for b in args.hf_batches if b in args.batches] if hf_model is not None else []
    if hf_batches:
        run_hf(hf_model, warm.to(dev), 2, dev)
    ours_t = {b: [] for b in args.batches}
    hf_tn, hf_t1 = {b: [] for b in hf_batches}, {b: [] for b in hf_batches}
    tokens = {}
    for _ in range(args.repeats):
        for b in args.batches:
            ids = prompts(b, args.prompt_len, vocab)
            secs, tokens[("ours", b)] = run_ours(station, ids, n, dev)
            ours_t[b].append(secs)
            if b in hf_batches:
                secs, tokens[("hf", b)] = run_hf(hf_model, ids.to(dev), n, dev)
                hf_tn[b].append(secs)
                hf_t1[b].append(run_hf(hf_model, ids.to(dev), 1, dev)[0])

    def rate(b: int, secs: float) -> float | None:
        return b * (n - 1) / secs if secs > 0 else None  # None: noise swamped the HF subtraction

    def ours_rate(pick, i: int) -> dict[str, float | None]:
        return {str(b): rate(b, pick([t[i] for t in ts])) for b, ts in ours_t.items()}

    def hf_rate(pick, i: int) -> dict[str, float | None]:
        return {str(b): rate(b, pick([t[i] for t in hf_tn[b]]) - pick([t[i] for t in hf_t1[b]])) for b in hf_batches}

    med, best = statistics.median, min
    return {
        "ours_tok_s": ours_rate(med, 0), "ours_tok_s_best": ours_rate(best, 0), "ours_tok_s_cpu": ours_rate(med, 1),
        "hf_tok_s": hf_rate(med, 0), "hf_tok_s_best": hf_rate(best, 0), "hf_tok_s_cpu": hf_rate(med, 1),
        "b1_tokens_match_hf": tokens[("ours", 1)] == tokens[("hf", 1)] if 1 in hf_batches else None,
    }


def _ratio(fig: dict, kind: str, k: str) -> float | None:
    """ours / HF of one kind of rate at batch k, None where HF was not measured."""
    hf = fig[f"hf_tok_s_{kind}"].get(k)
    return fig[f"ours_tok_s_{kind}"][k] / hf if hf and k in fig[f"ours_tok_s_{kind}"] else None


def _fmt(v: float | None) -> str:
    """A rate for the table ('-' when not measured)."""
    return "-" if v is None else f"{v:,.1f}"


def main(argv: list[str] | None = None) -> int:
    """Run every measurement, print the table and the figures, and end with one JSON line."""
    # ours and HF's on the one compute thread: the same OpenMP team for both (see mesh.core.compute)
    return on_compute_thread(_main, argv)


def _embedding_bytes(embedding: torch.nn.Module) -> int:
    """The bytes the station holds for its token embedding: GGUF blocks where the loader kept them, else the table."""
    if isinstance(embedding, QuantEmbedding):
        return embedding.rows.raw.nbytes
    return embedding.weight.numel() * embedding.weight.element_size()


def decode_step_bytes(station: Station) -> tuple[int, int]:
    """(the weight bytes a full-model station holds, those one decode step reads), as it holds them: packed tiles
    in float32, bfloat16 or float16, GGUF blocks kept, dense tables. A step reads every weight but the embedding
    table, of which only its B rows (not counted); a head that IS the embedding table (tied, not packed apart) reads
    it whole."""
    embedding = station.model.model.embed_tokens
    held = sum(p.numel() * p.element_size() for p in station.model.parameters() if p.device.type != "meta")
    if isinstance(embedding, QuantEmbedding):
        held += embedding.rows.raw.nbytes
    head = getattr(station.model, "lm_head", None)
    tied = head is not None and getattr(embedding, "weight", None) is head.weight
    return held, held - (0 if tied else _embedding_bytes(embedding))


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model, "bench")
    cfg = ModelConfig.from_dir(model_dir)
    layers = cfg.num_hidden_layers
    block_bytes = DEFAULT_BLOCK_TOKENS * 2 * layers * cfg.num_key_value_heads * cfg.head_dim * DTYPE_BYTES[args.dtype]
    kv_need = (max(args.batches) * blocks_for(args.prompt_len + args.steps, DEFAULT_BLOCK_TOKENS) + 1) * block_bytes
    kv_bytes = max(kv_need, StationSpec(layers=(0, layers)).kv_bytes)
    station = Station(model_dir, StationSpec(layers=(0, layers), dtype=args.dtype, device=args.device,
                                             linear_backend=args.linear_backend,
                                             kv_bytes=kv_bytes, cuda_graphs=not args.eager))
    print(f"model {model_dir} ({layers} layers, {args.dtype}, {args.device}); prompt {args.prompt_len}, "
          f"{args.steps} tokens/seq (decode timed over {args.steps - 1}), {args.repeats} repeats", file=sys.stderr)

    hf_model = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        folder, gguf = transformers_source(model_dir)  # a .gguf file loads through transformers' GGUF reader
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype), **gguf)
        hf_model = hf_model.to(args.device).eval()
    bw = bandwidth_gb_s(args.device)
    fig = bench_decode(station, hf_model, args)
    if args.profile:
        fig["profile_ms"] = {}
        for b in args.batches:
            ms, top = profile_decode(station, prompts(b, args.prompt_len, cfg.vocab_size), max(2, args.steps - 1),
                                     GREEDY)
            fig["profile_ms"][str(b)] = ms
            print(format_profile(b, ms, top), file=sys.stderr)
    ours, hf = fig["ours_tok_s"], fig["hf_tok_s"]
    embed_bytes = _embedding_bytes(station.model.model.embed_tokens)
    # what a decode step reads (until session 30 the roofline counted the whole embedding table; until session 46
    # the checkpoint's bytes as float32, not the station's as held, so bfloat16 tiles counted double)
    weight_bytes, read_bytes = decode_step_bytes(station)
    steps_s = bw * 1e9 / read_bytes
    roof = {str(b): b * steps_s for b in args.batches}

    extra = [("ours best", "ours_tok_s_best"), ("HF best", "hf_tok_s_best"), ("ours/cpu-s", "ours_tok_s_cpu"),
             ("HF/cpu-s", "hf_tok_s_cpu")]
    print(f"\n{'batch':>5} {'ours tok/s':>11} {'HF tok/s':>10} {'ours/HF':>8} {'roofline tok/s':>15} {'of roof':>8} "
          + " ".join(f"{name:>10}" for name, _ in extra))
    for b in args.batches:
        k = str(b)
        ratio = f"{ours[k] / hf[k]:.2f}x" if hf.get(k) else "-"
        print(f"{b:>5} {_fmt(ours[k]):>11} {_fmt(hf.get(k)):>10} {ratio:>8} {_fmt(roof[k]):>15} "
              f"{ours[k] / roof[k]:>7.1%} " + " ".join(f"{_fmt(fig[key].get(k)):>10}" for _, key in extra))
    r1 = ours["1"] / hf["1"] if hf.get("1") else None
    r16 = ours["16"] / hf["16"] if hf.get("16") else None
    print(f"\nours b1 / HF b1: {'-' if r1 is None else f'{r1:.2f}x'}   "
          f"ours b16 / HF static b16: {'-' if r16 is None else f'{r16:.2f}x'}   (wall-clock medians; tok/s per CPU "
          "second, the cpu-s columns, is the load-robust figure at --threads 1)")
    if fig["b1_tokens_match_hf"] is not None:
        print(f"batch-1 greedy tokens identical to HF: {fig['b1_tokens_match_hf']}")
    embedding = ("the embedding is the head" if cfg.tie_word_embeddings else
                 f"of the untied embedding, {embed_bytes / 2**20:.1f} MiB, only B rows")
    print(f"bandwidth {bw:.1f} GB/s; weights {weight_bytes / 2**20:.1f} MiB, a step reading {read_bytes / 2**20:.1f} "
          f"MiB of them ({embedding}); roofline {steps_s:.1f} steps/s")
    graphs = station.graphs
    if graphs is not None:
        print(f"CUDA graphs: {graphs.captures} decode-wave shapes captured, {graphs.replays} waves replayed"
              + (f"; capture FAILED, eager since: {graphs.failed}" if graphs.failed else ""))
    mach = describe_machine()
    print(f"machine: {mach['cpu']}, {mach['cores']} cores, torch {mach['torch']} with {mach['torch_threads']} threads"
          f", load average {os.getloadavg()[0]:.2f}")
    figures = {
        **fig, "ratio_b1": r1, "ratio_b16": r16, **{f"ratio_b{b}_cpu": _ratio(fig, "cpu", str(b)) for b in (1, 16)},
        "bandwidth_gb_s": bw, "weight_bytes": weight_bytes, "embed_bytes": embed_bytes, "read_bytes": read_bytes,
        "roofline_steps_s": steps_s, "roofline_tok_s": roof,
        "roofline_fraction": {k: ours[k] / roof[k] for k in ours},
        "prompt_len": args.prompt_len, "steps": args.steps, "repeats": args.repeats, "dtype": args.dtype,
        "linear_backend": station.linear_backend,
        "cuda_graphs": None if graphs is None else {"captured": graphs.captures, "replayed": graphs.replays},
        "device": args.device, "model": str(model_dir), "machine": mach, "load_avg_1m": os.getloadavg()[0],
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
