"""The two sides of `mesh bench vs_llamacpp`: the same weights (float32, or bfloat16) in wavemesh and in llama.cpp.

wavemesh: one full-model Station in this process (decode and prefill, bench/step.py's code path) and
`mesh up` in a subprocess (HTTP). llama.cpp: `llama-bench` and `llama-server` built by
bench/llamacpp_peer.sh into the cache. Both HTTP servers get the same token-id prompts on the same
`/v1/completions` body. Nothing here is imported by the runtime or by `make test`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
from gguf import GGMLQuantizationType

from mesh.control.cli import resolve_model
from mesh.control.cli_cluster import wavemesh_cache
from mesh.core.config import ModelConfig
from mesh.core.model.gguf_convert import SMOLLM2, smollm2_gguf
from mesh.core.model.gguf_write import write_gguf
from mesh.core.model.quant_linear import QuantEmbedding
from mesh.core.model.synthetic import builtin_model
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.step import Station

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
from step import decode_step_bytes, prompts, run_ours  # noqa: E402  (bench/step.py: the station decode loop `mesh bench step` times)
from server_process import free_port, start_server, stop_server  # noqa: E402
from vs_llamacpp import parse_llama_bench  # noqa: E402  (the pure parts)

MODELS = {"smollm2": SMOLLM2, "bench": "bench", "bench-bf16": "bench"}  # --model choice -> resolve_model preset
GGUF_TYPES = {"bench-bf16": GGMLQuantizationType.BF16}  # --model choice -> the peer's GGUF type (else F32)
WEIGHTS = {"bench-bf16": "bfloat16: wavemesh's bfloat16 tiles, a BF16 GGUF",
           "smollm2-q4_1": "the embedded default's Q4_1 GGUF on both sides: wavemesh keeps its blocks, float32 "
                           "activations"}  # the table's title (else float32)
SHARED_FILE = {"smollm2-q4_1": smollm2_gguf}  # --model choice -> the one GGUF both sides load as it is
GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)


def peer_cache() -> Path:
    """Where the llama.cpp build and the GGUF copies live: under $WAVEMESH_CACHE (as `mesh` reads it), outside the repo."""
    return wavemesh_cache() / "llamacpp"


def peer_binaries(bin_dir: str | None) -> Path:
    """The folder holding llama-bench and llama-server: the one given, or bench/llamacpp_peer.sh's (built if needed)."""
    if bin_dir:
        path = Path(bin_dir)
    else:
        env = dict(os.environ, WAVEMESH_CACHE=str(peer_cache().parent), PYTHON=sys.executable)
        out = subprocess.run(["bash", str(BENCH_DIR / "llamacpp_peer.sh")], env=env, check=True,
                             stdout=subprocess.PIPE, text=True)
        path = Path(out.stdout.strip().splitlines()[-1])
    for name in ("llama-bench", "llama-server"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name} not found: build it with bench/llamacpp_peer.sh, or name the "
                                    "folder holding llama-bench and llama-server with --llamacpp-bin")
    return path


def model_pair(model: str) -> tuple[Path, Path]:
    """(safetensors directory, GGUF of the same weights) for a --model choice; GGUF written once. float32 on both
    sides, or for bench-bf16 the bench preset stored in bfloat16 (wavemesh holds it in bfloat16 tiles) and a BF16
    GGUF; for smollm2-q4_1 the packaged GGUF twice (wavemesh loads it as it is)."""
    if model in SHARED_FILE or model.endswith(".gguf"):
        path = SHARED_FILE[model]() if model in SHARED_FILE else Path(model)
        return path, path
    qtype = GGUF_TYPES.get(model, GGMLQuantizationType.F32)
    if qtype == GGMLQuantizationType.BF16:
        model_dir = builtin_model(wavemesh_cache() / "models", MODELS[model], dtype="bfloat16")
    else:
        model_dir = resolve_model(None, MODELS[model])
    gguf = peer_cache() / "models" / f"{model}.{qtype.name}.gguf"
    if not gguf.is_file():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        tmp = gguf.with_suffix(f".{os.getpid()}.tmp")
        write_gguf(model_dir, tmp, qtype)
        tmp.rename(gguf)
    return model_dir, gguf


def ours_decode(station: Station, tokens: int) -> float:
    """wavemesh batch-1 decode tok/s: a 1-token prompt, then `tokens` timed one-row waves (like llama-bench tg)."""
    ids = prompts(1, 1, station.config.vocab_size)
    (wall, _cpu), _ = run_ours(station, ids, tokens + 1, "cpu")
    return tokens / wall


def ours_prefill(station: Station, tokens: int) -> float:
    """wavemesh prefill tok/s: one prompt of `tokens` ids in one wave (like llama-bench pp)."""
    ids = prompts(1, tokens, station.config.vocab_size).reshape(-1)
    t0 = time.perf_counter()
    station.forward((WaveEntry(0, 0, tokens, GREEDY),), token_ids=ids)
    seconds = time.perf_counter() - t0
    station.release([0])
    return tokens / seconds


def llama_bench(bin_dir: Path, gguf: Path, threads: int, pp: int, tg: int, repack: bool = True) -> dict[str, float]:
    """One llama-bench run (one repetition after its warm-up) of pp`pp` and tg`tg` (0 skips one); `repack` False
    turns off llama.cpp's load-time weight repacking."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", str(pp), "-n", str(tg), "-t", str(threads),
           "-r", "1", "-o", "jsonl", *([] if repack else ["--repack", "0"])]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=1800)
    return parse_llama_bench(out.stdout)


def mesh_up_command(model_dir: Path, threads: int, clients: int, port: int, workdir: Path) -> list[str]:
    """`mesh up` on a YAML of one station holding every layer with `threads` torch threads."""
    layers = ModelConfig.from_dir(model_dir).num_hidden_layers
    cfg = workdir / "vs_llamacpp.yaml"
    cfg.write_text(f"model: {{path: {model_dir}}}\n"
                   f"stations: [{{layers: [0, {layers}], num_cpus: {threads}}}]\n"
                   f"scheduler: {{max_seqs: {max(clients, 1)}, max_queue: {4 * clients + 8}}}\n"
                   f"api: {{host: 127.0.0.1, port: {port}}}\n")
    return [sys.executable, "-m", "mesh.control.cli", "up", str(cfg)]


def llama_server_command(bin_dir: Path, gguf: Path, threads: int, clients: int, ctx: int, port: int,
                         repack: bool = True) -> list[str]:
    """llama-server with `clients` slots sharing a `ctx`-token context, `threads` threads (`repack` False: without
    its load-time weight repacking)."""
    return [str(bin_dir / "llama-server"), "-m", str(gguf), "--parallel", str(clients), "-c", str(ctx),
            "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1", "--port", str(port),
            *([] if repack else ["--no-repack"])]


class LoadClient:
    """The load generator of the HTTP rounds: one pool of keep-alive connections to `url`, one per client, made
    before any timed round and reused by every round, as a serving benchmark's client session is. (A fresh
    httpx client per request builds a TLS context, ~50 ms of CPU each here: 16 of them cost ~0.5 s of both cores
    at the start of every round, timed and competing with the server's prefill.)"""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self._http = httpx.Client(timeout=900, limits=httpx.Limits(max_connections=clients,
                                                                   max_keepalive_connections=clients))

    def round(self, prompt_ids: list[list[int]], max_tokens: int) -> tuple[int, float]:
        """All prompts at once on /v1/completions (greedy, ignore_eos), one thread each: (completion tokens,
        wall seconds)."""
        counts = [0] * len(prompt_ids)
        errors: list[str] = []

        def one(i: int) -> None:
            body = {"prompt": prompt_ids[i], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            try:
                r = self._http.post(self.url + "/v1/completions", json=body)
                r.raise_for_status()
                counts[i] = r.json()["usage"]["completion_tokens"]
            except (httpx.HTTPError, KeyError, ValueError) as e:
                errors.append(f"request {i}: {e!r}")

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompt_ids))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=1200)
        seconds = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"{self.url}: " + "; ".join(errors[:3]))
        return sum(counts), seconds

    def close(self) -> None:
        """Close the connections."""
        self._http.close()


def http_prompts(round_no: int, clients: int, length: int, vocab: int) -> list[list[int]]:
    """Distinct token-id prompts for one round (no shared prefixes, so no prefix-cache hits on either side)."""
    g = torch.Generator().manual_seed(7919 * (round_no + 1) + clients)
    return torch.randint(3, vocab, (clients, length), generator=g).tolist()


def _bench_rounds(args, model_dir: Path, gguf: Path, bin_dir: Path, samples: dict[str, list[float]]) -> int:
    """Decode/prefill rounds, ours and llama-bench alternating (A B, B A, ...); returns weight bytes per step."""
    from mesh.core.config import StationSpec
    from mesh.core.hostinfo import bandwidth_gb_s

    station = Station(model_dir, StationSpec(layers=(0, ModelConfig.from_dir(model_dir).num_hidden_layers)))
    decode, prefill = "decode" in args.parts, "prefill" in args.parts
    ours_decode(station, 4)  # warm-up: first-call allocations and kernel choices
    ours_prefill(station, min(args.prompt_tokens, 64))
    for r in range(args.rounds):
        samples["bandwidth_gb_s"].append(bandwidth_gb_s("cpu"))
        for side in (("ours", "llama") if r % 2 == 0 else ("llama", "ours")):
            if side == "llama":
                got = llama_bench(bin_dir, gguf, args.threads, args.prompt_tokens if prefill else 0,
                                  args.gen_tokens if decode else 0, not args.peer_no_repack)
                for kind, rate in got.items():
                    samples[f"llama_{kind}"].append(rate)
                continue
            if decode:
                samples["ours_tg"].append(ours_decode(station, args.gen_tokens))
            if prefill:
                samples["ours_pp"].append(ours_prefill(station, args.prompt_tokens))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:,.1f}" for k, v in samples.items() if v),
              file=sys.stderr, flush=True)
    read_bytes = held_read_bytes(station)
    del station
    return read_bytes


def held_read_bytes(station: Station) -> int:
    """Weight bytes one batch-1 decode step reads as the station holds them (bench/step.py), plus its one row of
    the embedding table (dense, or GGUF blocks)."""
    embed = station.model.model.embed_tokens
    row = embed.rows.raw.shape[1] if isinstance(embed, QuantEmbedding) else embed.weight[0].nbytes
    return decode_step_bytes(station)[1] + row


def _http_rounds(args, model_dir: Path, gguf: Path, bin_dir: Path, samples: dict[str, list[float]]) -> None:
    """Each server in turn (never together): start, one warm-up round, --http-rounds timed rounds, stop."""
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    ctx = args.clients * (args.http_prompt_tokens + args.http_tokens + 64)
    timed = 0
    with tempfile.TemporaryDirectory(prefix="vs_llamacpp.") as tmp:
        for cycle in range(args.http_cycles):
            for side in (("ours", "llama") if cycle % 2 == 0 else ("llama", "ours")):
                port = free_port()
                cmd = (mesh_up_command(model_dir, args.threads, args.clients, port, Path(tmp)) if side == "ours"
                       else llama_server_command(bin_dir, gguf, args.threads, args.clients, ctx, port,
                                                 not args.peer_no_repack))
                url, log = f"http://127.0.0.1:{port}", Path(tmp) / f"{side}-{cycle}.log"
                proc = start_server(cmd, url, log, "mesh up" if side == "ours" else "llama-server")
                load = LoadClient(url, args.clients)
                try:
                    load.round(http_prompts(-1, args.clients, args.http_prompt_tokens, vocab), 4)
                    for r in range(args.http_rounds):
                        ids = http_prompts(timed + r, args.clients, args.http_prompt_tokens, vocab)
                        tokens, seconds = load.round(ids, args.http_tokens)
                        if tokens != args.clients * args.http_tokens:
                            raise RuntimeError(f"{side}: {tokens} tokens generated, expected "
                                               f"{args.clients * args.http_tokens}")
                        samples[f"{side}_http"].append(tokens / seconds)
                        print(f"http {side} cycle {cycle + 1} round {r + 1}: {tokens / seconds:,.1f} tok/s",
                              file=sys.stderr, flush=True)
                finally:
                    load.close()
                    stop_server(proc)
            timed += args.http_rounds


def measure(args) -> tuple[dict[str, list[float]], dict]:
    """Every sample of the chosen parts, and the settings the table names."""
    from mesh.core.hostinfo import describe_machine

    torch.set_num_threads(args.threads)
    model_dir, gguf = model_pair(args.model)
    bin_dir = peer_binaries(args.llamacpp_bin)
    keys = ("bandwidth_gb_s", "ours_tg", "llama_tg", "ours_pp", "llama_pp", "ours_http", "llama_http")
    samples: dict[str, list[float]] = {k: [] for k in keys}
    read_bytes = 0
    if {"decode", "prefill"} & set(args.parts):
        read_bytes = _bench_rounds(args, model_dir, gguf, bin_dir, samples)
    if "http" in args.parts:
        _http_rounds(args, model_dir, gguf, bin_dir, samples)
    mach = describe_machine()
    source = bin_dir.parent.parent / "src" / "SOURCE"
    settings = {**{k: getattr(args, k) for k in ("model", "threads", "rounds", "gen_tokens", "prompt_tokens",
                                                   "clients", "http_tokens", "http_prompt_tokens", "http_rounds",
                                                   "http_cycles")},
                "parts": list(args.parts), "read_bytes": read_bytes, "model_dir": str(model_dir), "gguf": str(gguf),
                "weights": WEIGHTS.get(args.model, "float32") if not args.model.endswith(".gguf") else
                "the file on both sides: wavemesh keeps the blocks its kernel holds, float32 activations",
                "machine": f"{mach['cpu']}, {mach['cores']} cores, torch {mach['torch']}",
                "peer_source": (source.read_text().strip() if source.is_file() else str(bin_dir))
                + (" with --repack 0" if args.peer_no_repack else ""),
                "load_avg": f"{os.getloadavg()[0]:.2f}"}
    return samples, settings
