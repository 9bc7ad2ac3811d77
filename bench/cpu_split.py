"""Where the CPU goes on both sides of issue 12's HTTP comparison (a measurement mode, never a serving mode).

    mesh bench cpu_split [--model smollm2|bench] [--clients 1,16] [--tokens 64] [--prompt-tokens 32] [--threads 2]
                         [--frequency 499] [--out bench/out/cpu_split.txt]

Each server in turn (`mesh up` with one station of --threads cores, then `llama-server --parallel C` with as many
threads; the same float32 weights, as `mesh bench vs_llamacpp` starts them) serves one warm-up round and then, for
each client count C, a round of C requests x --tokens tokens at once while `perf record -a -e cpu-clock` samples
every CPU of the machine. Each sample is put in one category by its process, library and symbol (CATEGORIES, in
order: the first that matches), and the table gives CPU milliseconds per generated token by category, so the
two engines' splits sit side by side: the matmuls, attention, the other tensor ops, sampling, threads waiting on
each other, the rest of the process (interpreter, RPC, HTTP, Ray), the kernel, and idle CPU. Samples of this
benchmark's own process (its HTTP clients) and of perf are counted apart and left out of the split.

Needs `perf` (linux-perf) and the rights to sample every CPU (root, or kernel.perf_event_paranoid <= 0); the
llama.cpp binaries come from bench/llamacpp_peer.sh, as for `mesh bench vs_llamacpp`.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

IDLE, EXCLUDED = "idle CPU", "benchmark client and perf (left out)"
# (category, pattern over "comm dso symbol"), first match wins; IDLE and EXCLUDED are decided before these
CATEGORIES = (
    ("matmuls (linears)", r"packed_linear|quant_linear|rows_block|rows_over_block|decode_block|few_rows|ggml_vec_dot|mul_mat|gemm|gemv|tinyblas"
                          r"|mkl_|dnnl|sgemm"),
    ("attention", r"attention|attn|soft_max|softmax"),
    ("sampling", r"sampler|argmax|sample_tokens|top_k|topk"),
    ("other tensor ops", r"rmsnorm|rms_norm|rope|silu|swiglu|\bglu|fused_layers|ggml_compute_forward|ggml_vec_|"
                         r"ggml_graph_compute|embedding|libtorch|libc10|\bat::|aten"),
    ("threads waiting (OpenMP, barriers)", r"libgomp|libiomp|gomp_|\bomp_|ggml_barrier|sched_yield|pthread_cond"),
    ("kernel", r"\[kernel"),
    ("runtime (interpreter, RPC, HTTP, Ray)", r"."),
)
IDLE_SYMBOLS = re.compile(r"^(cpu_idle|default_idle|do_idle|native_safe_halt|pv_native_safe_halt|acpi_idle|"
                          r"intel_idle|mwait|cpuidle|arch_cpu_idle|default_idle_call)")
_COMPILED = tuple((name, re.compile(pattern, re.IGNORECASE)) for name, pattern in CATEGORIES)
SAMPLE_LINE = re.compile(r"^\s*(?P<comm>.+?)\s+(?P<pid>\d+)\s+(?P<ip>[0-9a-f]+)\s+(?P<sym>.*?)\s+\((?P<dso>[^()]*)\)\s*$")


def classify(comm: str, pid: int, sym: str, dso: str, excluded_pids: frozenset[int]) -> str:
    """The category of one sample: idle (pid 0 or an idle-loop symbol), excluded (the benchmark's own process or
    perf), else the first of CATEGORIES whose pattern finds the sample's "comm dso symbol"."""
    if pid == 0 or IDLE_SYMBOLS.match(sym):
        return IDLE
    if pid in excluded_pids or comm == "perf":
        return EXCLUDED
    text = f"{comm} {dso} {sym}"
    return next(name for name, pattern in _COMPILED if pattern.search(text))


def count_samples(perf_script_lines, excluded_pids: frozenset[int]) -> Counter:
    """Samples per category from `perf script -F comm,pid,ip,sym,dso` output lines (lines it cannot read are
    counted under "unparsed", never dropped)."""
    counts: Counter = Counter()
    for line in perf_script_lines:
        if not line.strip():
            continue
        m = SAMPLE_LINE.match(line)
        if m is None:
            counts["unparsed"] += 1
            continue
        counts[classify(m["comm"].strip(), int(m["pid"]), m["sym"], m["dso"], excluded_pids)] += 1
    return counts


def ms_per_token(counts: Counter, frequency: int, tokens: int) -> dict[str, float]:
    """CPU milliseconds per generated token of each category (a sample stands for 1/frequency s of one CPU)."""
    return {name: 1e3 * n / frequency / tokens for name, n in counts.items()}


def format_table(results: dict[tuple[str, int], dict], order: list[tuple[str, int]]) -> str:
    """Markdown: a row per category (CPU ms per token), the busy total, tok/s and wall seconds; a column per run."""
    names = [n for n, _ in CATEGORIES] + [IDLE, "unparsed", EXCLUDED]
    head = [f"{'wavemesh' if side == 'ours' else 'llama.cpp'}, {clients} client{'s' * (clients != 1)}"
            for side, clients in order]
    rows = [["CPU ms per generated token", *head], ["---", *(["---:"] * len(order))]]
    for name in names:
        cells = [results[key]["ms_per_token"].get(name) for key in order]
        if any(cells) or name == IDLE:
            rows.append([name, *(f"{c:.2f}" if c else "-" for c in cells)])
    busy = [sum(v for k, v in results[key]["ms_per_token"].items() if k not in (IDLE, EXCLUDED)) for key in order]
    rows.append(["**busy CPU ms per token (all but idle and left out)**", *(f"**{b:.2f}**" for b in busy)])
    rows.append(["tok/s (this round)", *(f"{results[key]['tok_s']:.1f}" for key in order)])
    rows.append(["round wall s", *(f"{results[key]['seconds']:.2f}" for key in order)])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mesh bench cpu_split", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", "bench"), default="smollm2")
    p.add_argument("--clients", default="1,16", help="comma-separated client counts, one round each")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="threads of each server")
    p.add_argument("--frequency", type=int, default=499, help="perf samples per second per CPU")
    p.add_argument("--llamacpp-bin", default=None)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "cpu_split.txt")
    args = p.parse_args(argv)
    try:
        args.clients = tuple(int(c) for c in args.clients.split(","))
    except ValueError:
        p.error(f"--clients: expected comma-separated integers, got {args.clients!r}")
    for name in ("tokens", "prompt_tokens", "threads", "frequency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if not args.clients or min(args.clients) < 1:
        p.error(f"--clients: expected counts >= 1, got {args.clients}")
    return args


def _perf_round(load, prompts: list[list[int]], tokens: int, frequency: int, data: Path) -> dict:
    """One round of the prompts through `load` (vs_llamacpp_sides.LoadClient) under `perf record -a`: its counts per
    category, tokens, seconds."""
    perf = subprocess.Popen(["perf", "record", "-a", "-e", "cpu-clock", "-F", str(frequency), "-o", str(data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)  # perf has opened every CPU's event
    try:
        generated, seconds = load.round(prompts, tokens)
    finally:
        perf.send_signal(signal.SIGINT)
        _, err = perf.communicate(timeout=120)
    if perf.returncode not in (0, -signal.SIGINT):
        raise RuntimeError(f"perf record failed ({perf.returncode}): {err.decode(errors='replace')[-2000:]}")
    script = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,pid,ip,sym,dso"], check=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    counts = count_samples(script.stdout.splitlines(), frozenset({os.getpid()}))
    return {"ms_per_token": ms_per_token(counts, frequency, generated), "samples": dict(counts),
            "tok_s": generated / seconds, "seconds": seconds, "tokens": generated}


def measure(args) -> tuple[dict, list]:
    """Each server in turn: start, warm up, one perf-sampled round per client count, stop."""
    import json

    import vs_llamacpp_sides as sides
    from server_process import free_port, start_server, stop_server

    model_dir, gguf = sides.model_pair(args.model)
    bin_dir = sides.peer_binaries(args.llamacpp_bin)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    most = max(args.clients)
    results, order = {}, []
    with tempfile.TemporaryDirectory(prefix="cpu_split.") as tmp:
        for side in ("ours", "llama"):
            port = free_port()
            ctx = most * (args.prompt_tokens + args.tokens + 64)
            cmd = (sides.mesh_up_command(model_dir, args.threads, most, port, Path(tmp)) if side == "ours"
                   else sides.llama_server_command(bin_dir, gguf, args.threads, most, ctx, port))
            url = f"http://127.0.0.1:{port}"
            proc = start_server(cmd, url, Path(tmp) / f"{side}.log", "mesh up" if side == "ours" else "llama-server")
            load = sides.LoadClient(url, most)
            try:
                load.round(sides.http_prompts(-1, most, args.prompt_tokens, vocab), 4)
                for clients in args.clients:
                    prompts = sides.http_prompts(clients, clients, args.prompt_tokens, vocab)
                    results[side, clients] = _perf_round(load, prompts, args.tokens, args.frequency,
                                                         Path(tmp) / f"{side}-{clients}.data")
                    order.append((side, clients))
                    print(f"{side} {clients} clients: {results[side, clients]['tok_s']:.1f} tok/s",
                          file=sys.stderr, flush=True)
            finally:
                load.close()
                stop_server(proc)
    order.sort(key=lambda k: (k[1], k[0] != "ours"))
    return results, order


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table (also to --out) and one JSON line."""
    import json

    args = parse_args(argv)
    if subprocess.run(["perf", "--version"], capture_output=True).returncode != 0:
        print("mesh bench cpu_split: `perf` is not installed (Debian: linux-perf)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mesh.core.hostinfo import describe_machine

    load_before = os.getloadavg()[0]
    results, order = measure(args)
    m = describe_machine()
    table = format_table(results, order)
    text = (f"CPU split, MEASUREMENT MODE (perf record -a -e cpu-clock -F {args.frequency}): {args.model} float32, "
            f"{args.threads} threads each, prompts of {args.prompt_tokens} tokens, {args.tokens} tokens per "
            f"request; {m['cpu']}, {m['cores']} cores; load average {load_before:.2f} before, {m['loadavg_1m']:.2f} after\n\n{table}\n")
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["mesh bench cpu_split", *(sys.argv[1:] if argv is None else argv)])
        args.out.write_text(f"$ {command}\n\n{text}\n")
    print(json.dumps({f"{side}_{clients}": results[side, clients] for side, clients in order}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
