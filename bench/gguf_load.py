"""Loading a station's share of a quantized GGUF against the same weights from safetensors.

    python bench/gguf_load.py [--model FILE.gguf] [--layers 0-15] [--repeats 7] [--fresh 7]

Default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF and its float32 safetensors conversion in the cache.
Medians of alternated runs, in seconds, each side as a station of this machine's `auto` linear backend does it
(float32 on CPU; packed where the native kernels build):
  safetensors_s           load_range of the float32 directory: meta build, memory-mapped tensors assigned (the
                          issue's reference: nothing written)
  safetensors_station_s   the same plus use_linear_backend: every matrix copied into packed float32 tiles
  gguf_s                  the GGUF station load: header parse, load_range keeping Q8_0/Q4_0/Q4_1 matrices as the
                          file's blocks (the embedding a row lookup), use_linear_backend repacking them into
                          quant_linear's tiles (other types dequantized); with another backend, gguf_dequantized_s
  gguf_dequantized_s      load_range dequantizing every tensor to float32 (a station on another backend or dtype)
  gguf_header_s           the header parse alone (`GGUFCheckpoint`), which every GGUF load pays once
  float32_write_s         writing as many float32 values as the dequantized layers hold (np.ones): the floor of any
                          load that materializes float32 weights
The process's cache of parsed GGUF headers is cleared before each GGUF run (a station process parses once).
Repeated loads in one process reuse memory the earlier ones freed; a station loads once, into fresh memory. So
`--fresh N` also times N loads of each kind alternated, each the first load of a new process (after the imports and
the kernels' probe, which a station pays once whatever its checkpoint): safetensors_fresh_s, gguf_fresh_s,
safetensors_station_fresh_s and their ratio gguf_over_safetensors_fresh; and gguf_cached_fresh_s (ratio
gguf_cached_over_safetensors_fresh), the GGUF station load where an earlier station on this machine left its
packed weights in the packed cache (mesh.core.model.packed_cache; a temporary one here), which it maps instead of
packing them. gguf_fresh_s is the load without a cache, as a station's first load of those layers on a node is.
Ratios are of the unrounded medians (seconds print to 0.1 ms); `..._by_round` gives the lowest and highest of the
rounds' own ratios (each round's GGUF load over the safetensors load of the same round) and `..._paired` their median
(a round's two loads run back to back, so a slow spell of the machine tends to hit both).

`--repack-shape ROWSxK` instead times the Q4_1 repack alone on one random weight of that shape, pushed out of the
caches before each of 5 runs (a large model's weights are read from memory once): GB/s of GGUF blocks, the best run.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from mesh.control.cli import resolve_model
from mesh.core.compute import on_compute_thread
from mesh.core.config import ModelConfig
from mesh.core.model.gguf_convert import SMOLLM2, convert_gguf, smollm2_gguf
from mesh.core.model.gguf_file import GGUFCheckpoint
from mesh.core.model.gguf_header import clear_header_cache
from mesh.core.model.kernels import resolve_linear_backend, use_linear_backend
from mesh.core.model.loader import load_range
from mesh.core.model.packed_cache import PackedCache, wait_for_stores
from mesh.core.model.quant_linear import BLOCK_WEIGHTS, QuantRows, repack, repacked_bytes


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _cold_gguf(fn):
    """fn after forgetting the parsed GGUF headers: each GGUF load pays its header, as a station process does."""
    def run():
        clear_header_cache()
        return fn()
    return run


def _station_load(path: Path, cfg: ModelConfig, start: int, end: int, backend: str, keep_quantized: bool,
                  cache: PackedCache | None = None):
    """load_range then the kernels' set-up, as Station._load does."""
    model, report = load_range(path, cfg, start, end, for_packed=keep_quantized)
    use_linear_backend(model, backend, torch.device("cpu"), torch.float32, packed_cache=cache)
    return model, report


FRESH_KINDS = ("safetensors", "gguf", "safetensors_station", "gguf_cached")


def _one_fresh_load(kind: str, gguf: Path, hf_dir: Path, layers: str, cache_dir: str) -> None:
    """In a new process: the first load of its kind, timed after the imports and the kernels' probe, with the
    process's objects frozen first as a station's start freezes them (station/actor.py); prints seconds."""
    backend = resolve_linear_backend("auto", torch.device("cpu"), torch.float32)
    gc.freeze()
    cfg = ModelConfig.from_dir(hf_dir)
    start, end = (int(x) for x in layers.split("-"))
    load = {"safetensors": lambda: load_range(hf_dir, cfg, start, end),
            "gguf": lambda: _station_load(gguf, cfg, start, end, backend, backend == "packed"),
            "safetensors_station": lambda: _station_load(hf_dir, cfg, start, end, backend, False),
            "gguf_cached": lambda: _station_load(gguf, cfg, start, end, backend, backend == "packed",
                                                 PackedCache.for_gguf(cache_dir, gguf))}[kind]
    print(_seconds(lambda: on_compute_thread(load)))


def _fresh_loads(n: int, gguf: Path, hf_dir: Path, layers: str, cache_dir: str) -> dict[str, float]:
    """Medians of n fresh-process loads of each kind, the kinds alternated."""
    times: dict[str, list[float]] = {k: [] for k in FRESH_KINDS}
    for _ in range(n):
        for kind in FRESH_KINDS:
            out = subprocess.run([sys.executable, __file__, "--one-fresh", kind, "--model", str(gguf),
                                  "--hf-dir", str(hf_dir), "--layers", layers, "--cache-dir", cache_dir],
                                 capture_output=True, text=True, timeout=300, check=True)
            times[kind].append(float(out.stdout.split()[-1]))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {f"{k}_fresh_s": round(m, 4) for k, m in med.items()}
    for kind in ("gguf", "gguf_cached"):  # from the unrounded medians: at ~13 ms, a millisecond is 8%
        out[f"{kind}_over_safetensors_fresh"] = round(med[kind] / med["safetensors"], 2)
        pairs = sorted(g / s for g, s in zip(times[kind], times["safetensors"]))  # each round's own ratio
        out[f"{kind}_over_safetensors_fresh_by_round"] = [round(pairs[0], 2), round(pairs[-1], 2)]
        out[f"{kind}_over_safetensors_fresh_paired"] = round(statistics.median(pairs), 2)  # rounds share a state
    return out


def repack_speed(shape: str) -> dict[str, float]:
    """The Q4_1 repack's GB/s on one random [rows, K] weight read from memory (best of 5)."""
    rows, k = (int(x) for x in shape.split("x"))
    raw = np.random.default_rng(0).integers(0, 255, (rows, k // BLOCK_WEIGHTS[Q.Q4_1] * 20), dtype=np.uint8)
    weight = QuantRows("w", Q.Q4_1, raw, k)
    out = torch.zeros(repacked_bytes([weight]), dtype=torch.uint8)
    flush, best = np.ones(64 << 20, np.uint8), float("inf")
    for _ in range(5):
        flush += 1  # 64 MiB written: the weight leaves the caches
        best = min(best, _seconds(lambda: repack([weight], out)))
    return {"repack_shape": shape, "repack_mb": round(raw.nbytes / 1e6, 1), "repack_ms": round(best * 1e3, 2),
            "repack_gb_s": round(raw.nbytes / best / 1e9, 2)}


def main() -> None:
    """Time the loads of one layer range and print one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a .gguf file (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--layers", default="0-15", help="A-B: the station's layer range [A, B)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--fresh", type=int, default=0, help="also N loads of each kind, each in a new process")
    p.add_argument("--repack-shape", help="ROWSxK: time only the Q4_1 repack of one such weight")
    p.add_argument("--one-fresh", choices=FRESH_KINDS, help=argparse.SUPPRESS)  # the child of --fresh
    p.add_argument("--hf-dir", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.repack_shape:
        print(json.dumps(repack_speed(args.repack_shape)))
        return
    if args.one_fresh:
        _one_fresh_load(args.one_fresh, Path(args.model), Path(args.hf_dir), args.layers, args.cache_dir)
        return
    gguf = Path(args.model) if args.model else smollm2_gguf()
    backend = resolve_linear_backend("auto", torch.device("cpu"), torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = resolve_model(None, SMOLLM2) if args.model is None else convert_gguf(gguf, Path(tmp) / "hf")
        cfg = ModelConfig.from_dir(hf_dir)
        start, end = (int(x) for x in args.layers.split("-"))
        _, report = on_compute_thread(load_range, gguf, cfg, start, end)
        floats = report.weight_bytes // 4
        _, kept = on_compute_thread(_station_load, gguf, cfg, start, end, backend, backend == "packed")
        loads = {"safetensors": lambda: on_compute_thread(load_range, hf_dir, cfg, start, end),
                 "safetensors_station": lambda: on_compute_thread(_station_load, hf_dir, cfg, start, end, backend,
                                                                  False),
                 "gguf": _cold_gguf(lambda: on_compute_thread(_station_load, gguf, cfg, start, end, backend,
                                                              backend == "packed")),
                 "gguf_dequantized": _cold_gguf(lambda: on_compute_thread(load_range, gguf, cfg, start, end)),
                 "gguf_header": _cold_gguf(lambda: GGUFCheckpoint(gguf)),
                 "float32_write": lambda: on_compute_thread(np.ones, floats, np.float32)}
        times: dict[str, list[float]] = {k: [] for k in loads}
        for _ in range(args.repeats):  # alternating, so a change in the machine's load hits both alike
            for k, fn in loads.items():
                times[k].append(_seconds(fn))
        cache_dir = str(Path(tmp) / "packed")  # filled by one load, then mapped by each gguf_cached load
        on_compute_thread(_station_load, gguf, cfg, start, end, backend, backend == "packed",
                          PackedCache.for_gguf(cache_dir, gguf))
        wait_for_stores(60)
        fresh = _fresh_loads(args.fresh, gguf, hf_dir, args.layers, cache_dir) if args.fresh else {}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"model": gguf.name, "layers": [start, end], "backend": backend,
                      **{f"{k}_s": round(m, 4) for k, m in med.items()},
                      "gguf_weight_bytes": kept.weight_bytes, "dequantized_weight_bytes": report.weight_bytes,
                      "gguf_over_safetensors": round(med["gguf"] / med["safetensors"], 2),
                      "gguf_over_safetensors_station": round(med["gguf"] / med["safetensors_station"], 2),
                      **fresh}))


if __name__ == "__main__":
    main()
