"""Loading a station's share of a quantized GGUF against the same weights from safetensors.

    python bench/gguf_load.py [--model FILE.gguf] [--layers 0-15] [--repeats 7]

Default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF and its float32 safetensors conversion in the cache.
Reports the median seconds of `load_range` (meta build + reads + dequantize + assign) for each, and the
GGUF's header parse alone (`GGUFCheckpoint`), which every load pays once: the runs alternate, and the
process's cache of parsed GGUF headers is cleared before each GGUF one (a station process parses once).
`float32_write_s` is the time to write the station's dequantized weights once (np.ones of as many float32
values): a floor for any load that materializes float32 weights, where memory-mapped float32 safetensors
write nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from mesh.control.cli import resolve_model
from mesh.core.compute import on_compute_thread
from mesh.core.config import ModelConfig
from mesh.core.model.gguf_convert import SMOLLM2, convert_gguf, smollm2_gguf
from mesh.core.model.gguf_file import GGUFCheckpoint
from mesh.core.model.gguf_header import clear_header_cache
from mesh.core.model.loader import load_range


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


def main() -> None:
    """Time both loads of one layer range and print one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a .gguf file (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--layers", default="0-15", help="A-B: the station's layer range [A, B)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    gguf = Path(args.model) if args.model else smollm2_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = resolve_model(None, SMOLLM2) if args.model is None else convert_gguf(gguf, Path(tmp) / "hf")
        cfg = ModelConfig.from_dir(hf_dir)
        start, end = (int(x) for x in args.layers.split("-"))
        _, report = on_compute_thread(load_range, gguf, cfg, start, end)
        floats = report.weight_bytes // 4
        loads = {"safetensors": lambda: on_compute_thread(load_range, hf_dir, cfg, start, end),
                 "gguf": _cold_gguf(lambda: on_compute_thread(load_range, gguf, cfg, start, end)),
                 "header": _cold_gguf(lambda: GGUFCheckpoint(gguf)),
                 "write": lambda: on_compute_thread(np.ones, floats, np.float32)}
        times: dict[str, list[float]] = {k: [] for k in loads}
        for _ in range(args.repeats):  # alternating, so a change in the machine's load hits both alike
            for k, fn in loads.items():
                times[k].append(_seconds(fn))
        sf, gg, header, write = (statistics.median(times[k]) for k in ("safetensors", "gguf", "header", "write"))
    print(json.dumps({"model": gguf.name, "layers": [start, end], "safetensors_s": round(sf, 3),
                      "gguf_s": round(gg, 3), "gguf_header_s": round(header, 3), "float32_write_s": round(write, 3),
                      "gguf_over_safetensors": round(gg / sf, 2),
                      "gguf_reads_over_safetensors": round((gg - header) / sf, 2)}))


if __name__ == "__main__":
    main()
