"""Serving benchmark: the engine's aggregate tok/s over concurrency, and a mixed workload vs HF static batches.

    python bench/serve.py [--model DIR] [--concurrency 1,2,4,8,16,32] [--prompt-len 32] [--output-len 32]
                          [--repeats 3] [--mixed-requests 64] [--mixed-max-seqs 32] [--mixed-scale 1.0]
                          [--hf-batch 16] [--threads N] [--no-hf] [--no-detok] [--plot PATH] [--quick]
                          [--temperature T [--top-p P]]
    mesh bench serve ...  (same arguments)
    mesh bench serve --shared-prefix ...  (prefix cache on vs off: bench/shared_prefix.py)

(a) Concurrency sweep: K equal requests (prompt P, P output tokens, greedy unless --temperature (seed = the
request's index), ignore_eos) submitted at once to an
Engine with max_seqs = K over one in-process full-model Station; time from the first submit to the last result;
aggregate tok/s = K * output / seconds (median over repeats), and its ratio to K = 1.
(b) Mixed workload: N requests, prompts 16-512 and outputs 16-256 tokens (random.Random(0), times --mixed-scale),
all arriving together, engine max_seqs --mixed-max-seqs. Baseline: Hugging Face `generate` on the same checkpoint
in static batches of --hf-batch (left padding, attention_mask, greedy), each batch running to its longest request;
only the tokens each request asked for count as useful. tok/s = useful tokens / wall seconds.
The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


import torch

from mesh.control.cli import resolve_model
from mesh.core.compute import on_compute_thread
from mesh.core.hostinfo import bandwidth_gb_s, describe_machine
from mesh.core.config import DTYPE_BYTES, SUPPORTED_DTYPES, ModelConfig, SchedulerConfig, StationSpec
from mesh.core.model.gguf_file import transformers_source
from mesh.core.model.tokenizer_files import load_tokenizer
from mesh.core.params import SamplingParams
from orchestrator.engine import Engine
from orchestrator.pipeline import LocalLink
from station.kv import DEFAULT_BLOCK_TOKENS, blocks_for
from station.step import Station

Job = tuple[list[int], int]  # (prompt ids, output tokens)
TARGET_CONCURRENCY_16 = 8.0  # aggregate at 16 concurrent vs concurrency 1
TARGET_MIXED = 2.0  # mixed workload vs the static-batch baseline


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line (`--quick` shrinks it to a smoke test)."""
    p = argparse.ArgumentParser(prog="mesh bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF checkpoint dir or .gguf file (default: the built-in `bench` preset)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated request counts")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-wave-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="the sweep's sampling (0: greedy; the mix stays greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="the sweep's top-p, with --temperature")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each concurrency point (median)")
    p.add_argument("--kv-mib", type=int, default=512, help="KV budget floor (raised to fit the mixed workload)")
    p.add_argument("--mixed-requests", type=int, default=64)
    p.add_argument("--mixed-max-seqs", type=int, default=32)
    p.add_argument("--mixed-scale", type=float, default=1.0, help="scale prompt/output lengths of the mix")
    p.add_argument("--hf-batch", type=int, default=16, help="static batch size of the HF baseline")
    p.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES)
    p.add_argument("--threads", type=int, default=0, help="torch threads, both sides (0: default)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    p.add_argument("--no-detok", action="store_true", help="run the engine without a tokenizer (no detokenizing)")
    p.add_argument("--plot", default=str(Path(__file__).resolve().parent / "out" / "serve_concurrency.png"))
    p.add_argument("--quick", action="store_true", help="concurrency 1,2,4; mixed 8 requests at scale 0.1; no plot")
    a = p.parse_args(argv)
    if a.quick:
        a.concurrency, a.repeats, a.mixed_requests, a.mixed_scale, a.plot = "1,2,4", 1, 8, 0.1, None
    a.concurrency = [int(k) for k in a.concurrency.split(",") if k.strip()]
    if (not a.concurrency or min(a.concurrency) < 1 or min(a.prompt_len, a.output_len, a.repeats,
                                                             a.mixed_requests, a.mixed_max_seqs, a.hf_batch) < 1
            or a.mixed_scale <= 0):
        p.error("concurrency, lengths, repeats, request counts and batch sizes must be >= 1; --mixed-scale > 0")
    return a


def mixed_jobs(n: int, scale: float, vocab: int) -> list[Job]:
    """N requests: prompt 16-512 and output 16-256 tokens (times `scale`, at least 1), from random.Random(0)."""
    rng = random.Random(0)
    jobs = []
    for _ in range(n):
        p, o = rng.randint(16, 512), rng.randint(16, 256)
        p, o = max(1, round(p * scale)), max(1, round(o * scale))
        jobs.append(([rng.randrange(3, vocab) for _ in range(p)], o))
    return jobs


def equal_jobs(k: int, prompt_len: int, output_len: int, vocab: int) -> list[Job]:
    """K distinct prompts of equal length (ids 3.. avoid the special tokens)."""
    rng = random.Random(1000 + k)
    return [([rng.randrange(3, vocab) for _ in range(prompt_len)], output_len) for _ in range(k)]


def run_engine(station: Station, cfg: ModelConfig, tok, jobs: list[Job], max_seqs: int,
               max_wave_tokens: int, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Submit every job at once to a fresh Engine (greedy, or sampled with seed = job index); wall time
    first submit -> last result, and where it went."""
    sched = SchedulerConfig(max_seqs=max_seqs, max_wave_tokens=max(max_wave_tokens, max_seqs),
                            max_queue=max(256, len(jobs)))
    engine = Engine([LocalLink(station)], cfg, sched, tok)
    before = station.stats()
    try:
        t0 = time.perf_counter()
        streams = [engine.submit(ids, SamplingParams(max_tokens=o, temperature=temperature, top_p=top_p, seed=i,
                                                     ignore_eos=True))
                   for i, (ids, o) in enumerate(jobs)]
        outs = [s.result()[0] for s in streams]
        wall = time.perf_counter() - t0
        busy, stats = engine.pipeline.busy_seconds[0], engine.stats()
        engine.quiesce()
    finally:
        engine.close()
    after = station.stats()
    if after.kv.sequences:
        raise RuntimeError(f"{after.kv.sequences} sequences still hold KV after the engine closed")
    bad = [o.finish_reason for o in outs if o.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"requests ended with {bad[:3]} instead of 'length'")
    tokens = sum(len(o.token_ids) for o in outs)
    return {"seconds": wall, "tokens": tokens, "tok_s": tokens / wall, "station_busy_s": busy,
            "station_busy_fraction": busy / wall, "waves": stats.waves,
            "mean_wave_occupancy": stats.wave_occupancy_mean, "prefill_tokens": stats.prefill_tokens,
            "decode_waves_s": after.decode_seconds - before.decode_seconds,
            "mixed_waves_s": after.prefill_seconds - before.prefill_seconds,
            "outputs": [o.token_ids for o in outs]}


def run_hf(model, jobs: list[Job], batch: int) -> dict:
    """HF `generate` in static batches (left padded, greedy), each to its longest request; useful tok/s."""
    t0 = time.perf_counter()
    outputs, generated = [], 0
    for i in range(0, len(jobs), batch):
        chunk = jobs[i:i + batch]
        width, new = max(len(p) for p, _ in chunk), max(o for _, o in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])  # [B, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])  # [B, width]
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                 pad_token_id=0)  # [B, width + new]
        generated += out[:, width:].numel()
        outputs += [out[r, width:width + o].tolist() for r, (_, o) in enumerate(chunk)]
    wall = time.perf_counter() - t0
    useful = sum(o for _, o in jobs)
    return {"seconds": wall, "tokens": useful, "tok_s": useful / wall, "generated_tokens": generated,
            "outputs": outputs}


def load_hf(model_dir: Path, dtype: str):
    """The HF model, with EOS disabled so every row runs to max_new_tokens (our side uses ignore_eos)."""
    from transformers import AutoModelForCausalLM

    folder, gguf = transformers_source(model_dir)  # a .gguf file loads through transformers' GGUF reader
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **gguf).eval()
    model.generation_config.eos_token_id = None
    return model


def plot(path: str, ks: list[int], tok_s: dict[str, float], model_name: str) -> None:
    """Measured aggregate tok/s vs concurrency, beside the ideal K x single-request line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(ks, [tok_s[str(k)] for k in ks], "o-", label="wavemesh engine (measured)")
    ax.plot(ks, [k * tok_s[str(ks[0])] / ks[0] for k in ks], "--", color="gray", label="ideal: K x single")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("concurrent requests K")
    ax.set_ylabel("aggregate generated tok/s")
    ax.set_title(f"engine throughput vs concurrency ({model_name}, CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def log(msg: str) -> None:
    """Progress to stderr (stdout holds the table and the JSON line)."""
    print(msg, file=sys.stderr, flush=True)


def _strip(run: dict | None) -> dict | None:
    return None if run is None else {k: v for k, v in run.items() if k != "outputs"}


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and the mixed workload, print the tables, save the plot, end with one JSON line
    (`--shared-prefix`: the prefix-cache benchmark, bench/shared_prefix.py, instead)."""
    if "--shared-prefix" in (sys.argv[1:] if argv is None else argv):
        import shared_prefix
        return shared_prefix.main(argv)
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
        on_compute_thread(torch.set_num_threads, args.threads)
    mach = describe_machine()
    bandwidth = [on_compute_thread(bandwidth_gb_s)]  # K=1 is memory-bound: its speed moves with this
    model_dir = resolve_model(args.model, "bench")
    cfg = ModelConfig.from_dir(model_dir)
    tok = None
    if not args.no_detok:
        tok = load_tokenizer(model_dir)
    mixed = mixed_jobs(args.mixed_requests, args.mixed_scale, cfg.vocab_size)
    block_bytes = (DEFAULT_BLOCK_TOKENS * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
                   * DTYPE_BYTES[args.dtype])
    longest = max([len(p) + o for p, o in mixed] + [args.prompt_len + args.output_len])
    need = (max(args.mixed_max_seqs, *args.concurrency) * blocks_for(longest, DEFAULT_BLOCK_TOKENS) + 1) * block_bytes
    kv_bytes = max(args.kv_mib * 2**20, need)
    station = Station(model_dir, StationSpec(layers=(0, cfg.num_hidden_layers), dtype=args.dtype, kv_bytes=kv_bytes))
    log(f"model {model_dir} ({cfg.num_hidden_layers} layers, {args.dtype}, cpu), KV {kv_bytes / 2**20:.0f} MiB")

    run_engine(station, cfg, tok, equal_jobs(2, 8, 4, cfg.vocab_size), 2, args.max_wave_tokens)  # warm-up
    conc, detail, all_runs = {}, {}, {k: [] for k in args.concurrency}
    for rep in range(args.repeats):  # repeats outside, so load drift on a shared machine hits every K alike
        for k in args.concurrency:
            jobs = equal_jobs(k, args.prompt_len, args.output_len, cfg.vocab_size)
            all_runs[k].append(run_engine(station, cfg, tok, jobs, k, args.max_wave_tokens, args.temperature,
                                          args.top_p))
            log(f"repeat {rep + 1}/{args.repeats} K={k}: {all_runs[k][-1]['tok_s']:.1f} tok/s")
    for k, runs in all_runs.items():
        med = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
        conc[str(k)] = statistics.median(r["tok_s"] for r in runs)
        detail[str(k)] = _strip(med)
        detail[str(k)]["runs_tok_s"] = [r["tok_s"] for r in runs]
    base_k = args.concurrency[0]
    ratios = {k: v / (conc[str(base_k)] / base_k) for k, v in conc.items()}  # vs K x the first point per request

    log(f"mixed: {len(mixed)} requests, {sum(len(p) for p, _ in mixed)} prompt + {sum(o for _, o in mixed)} "
        f"output tokens, max_seqs {args.mixed_max_seqs}")
    ours = run_engine(station, cfg, tok, mixed, args.mixed_max_seqs, args.max_wave_tokens)
    log(f"mixed ours: {ours['tok_s']:.1f} tok/s in {ours['seconds']:.1f} s")
    del station
    hf, match = None, None
    if not args.no_hf:
        # on the compute thread, where our station ran: the same OpenMP team for both (see mesh.core.compute)
        model = on_compute_thread(load_hf, model_dir, args.dtype)
        on_compute_thread(run_hf, model, [(p[:8], 2) for p, _ in mixed[:2]], args.hf_batch)  # warm-up
        hf = on_compute_thread(run_hf, model, mixed, args.hf_batch)
        match = sum(a == b for a, b in zip(ours["outputs"], hf["outputs"])) / len(mixed)
        log(f"mixed HF: {hf['tok_s']:.1f} useful tok/s in {hf['seconds']:.1f} s")
        del model
    mixed_ratio = ours["tok_s"] / hf["tok_s"] if hf else None

    print(f"\n{'K':>4} {'tok/s':>9} {'x K=1':>7} {'ideal':>6} {'waves':>6} {'busy':>6} {'decode s':>9} {'mixed s':>8}")
    for k in args.concurrency:
        d = detail[str(k)]
        print(f"{k:>4} {conc[str(k)]:>9.1f} {ratios[str(k)]:>6.2f}x {k / base_k:>5.0f}x {d['waves']:>6} "
              f"{d['station_busy_fraction']:>6.0%} {d['decode_waves_s']:>9.2f} {d['mixed_waves_s']:>8.2f}")
    print(f"\nmixed ({len(mixed)} requests, scale {args.mixed_scale}): ours {ours['tok_s']:.1f} tok/s "
          f"({ours['seconds']:.1f} s, station busy {ours['station_busy_fraction']:.0%}, {ours['waves']} waves)")
    if hf:
        print(f"HF static batch {args.hf_batch}: {hf['tok_s']:.1f} useful tok/s ({hf['seconds']:.1f} s, "
              f"{hf['generated_tokens']} generated for {hf['tokens']} useful); ours/HF {mixed_ratio:.2f}x; "
              f"greedy outputs identical for {match:.0%} of requests")
    c16 = ratios.get("16") if base_k == 1 else None
    bandwidth.append(on_compute_thread(bandwidth_gb_s))
    met16 = None if c16 is None else c16 >= TARGET_CONCURRENCY_16
    met_mixed = None if mixed_ratio is None else mixed_ratio >= TARGET_MIXED
    print(f"target K=16 >= {TARGET_CONCURRENCY_16:.0f}x K=1: {'-' if c16 is None else f'{c16:.2f}x'} "
          f"({'not measured' if met16 is None else 'met' if met16 else 'NOT met'}); "
          f"target mixed >= {TARGET_MIXED:.0f}x HF: {'-' if mixed_ratio is None else f'{mixed_ratio:.2f}x'} "
          f"({'not measured' if met_mixed is None else 'met' if met_mixed else 'NOT met'})")
    print(f"machine: {mach['cpu']}, {mach['cores']} cores, torch {mach['torch']} with {mach['torch_threads']} "
          f"threads, load {mach['loadavg_1m']}; memory {bandwidth[0]:.0f} GB/s at start, {bandwidth[1]:.0f} at end")
    if args.plot:
        plot(args.plot, args.concurrency, conc, model_dir.name)
        print(f"plot: {args.plot}")
    figures = {
        "concurrency_tok_s": conc, "concurrency_ratio": ratios, "concurrency_detail": detail,
        "mixed_ours_tok_s": ours["tok_s"], "mixed_hf_tok_s": hf["tok_s"] if hf else None,
        "mixed_ratio": mixed_ratio, "mixed_ours": _strip(ours), "mixed_hf": _strip(hf), "mixed_outputs_match_hf": match,
        "targets": {"concurrency16_ratio": {"want": TARGET_CONCURRENCY_16, "got": c16, "met": met16},
                    "mixed_ratio": {"want": TARGET_MIXED, "got": mixed_ratio, "met": met_mixed}},
        "prompt_len": args.prompt_len, "output_len": args.output_len, "repeats": args.repeats,
        "temperature": args.temperature, "top_p": args.top_p,
        "max_wave_tokens": args.max_wave_tokens, "mixed_requests": len(mixed), "mixed_scale": args.mixed_scale,
        "mixed_max_seqs": args.mixed_max_seqs, "hf_batch": args.hf_batch, "kv_bytes": kv_bytes,
        "detokenize": tok is not None, "dtype": args.dtype, "model": str(model_dir),
        "machine": {**mach, "bandwidth_gb_s": bandwidth},
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
