"""Loading a station's share of a quantized GGUF against the same weights from safetensors.

    python bench/gguf_load.py [--model FILE.gguf] [--layers 0-15] [--repeats 3]

Default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF and its float32 safetensors conversion in the cache.
Reports the median seconds of `load_range` (meta build + reads + dequantize + assign) for each, and the
GGUF's header parse alone (`GGUFCheckpoint`), which every load pays once.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from mesh.control.cli import resolve_model
from mesh.core.compute import on_compute_thread
from mesh.core.config import ModelConfig
from mesh.core.model.gguf_convert import SMOLLM2, convert_gguf, smollm2_gguf
from mesh.core.model.gguf_file import GGUFCheckpoint
from mesh.core.model.loader import load_range


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    """Time both loads of one layer range and print one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a .gguf file (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--layers", default="0-15", help="A-B: the station's layer range [A, B)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    gguf = Path(args.model) if args.model else smollm2_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = resolve_model(None, SMOLLM2) if args.model is None else convert_gguf(gguf, Path(tmp) / "hf")
        cfg = ModelConfig.from_dir(hf_dir)
        start, end = (int(x) for x in args.layers.split("-"))
        sf = _median_s(lambda: on_compute_thread(load_range, hf_dir, cfg, start, end), args.repeats)
        gg = _median_s(lambda: on_compute_thread(load_range, gguf, cfg, start, end), args.repeats)
        header = _median_s(lambda: GGUFCheckpoint(gguf), args.repeats)
    print(json.dumps({"model": gguf.name, "layers": [start, end], "safetensors_s": round(sf, 3),
                      "gguf_s": round(gg, 3), "gguf_header_s": round(header, 3),
                      "gguf_over_safetensors": round(gg / sf, 2),
                      "gguf_reads_over_safetensors": round((gg - header) / sf, 2)}))


if __name__ == "__main__":
    main()
