"""A station's decode waves with two builds of its native kernels, alternated in one process (MEASUREMENT ONLY).

    python bench/kernel_ab.py [--model smollm2|bench|DIR|FILE.gguf] [--base HEAD] [--batches 1,4,16] [--rounds 20]
                              [--quick]
    mesh bench kernel_ab ...  (same arguments)

Builds csrc/ twice, as committed at --base and as in the working tree (bench/linear_stream.py's `build`), loads one
float32 station holding every layer, and times rounds of B sequences x 32 decode steps (bench/step.py's `run_ours`:
a 1-token prompt first, untimed; one untimed round of each build first), switching the station between the two
libraries every round, the order flipped each round (A B, B A, ...), so both builds meet the same machine. Unlike
linear_stream, everything a decode step does runs: the fused layers, the head, attention, the Python and torch glue
between native calls (which a build's memory traffic can slow by evicting it from the caches). Prints per batch the
median ms per step of each build, the median of the paired ratios tree/base, how many pairs the tree won, and
whether both builds drew the same greedy tokens (a kernel change must not move a bit). The last line printed is one
JSON object with every sample.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # run as a script or loaded from its file
import mesh.core.model.kernels as kernels  # noqa: E402
import mesh.core.model.quant_linear as quant_linear  # noqa: E402
from linear_stream import CSRC, build, checkout_csrc  # noqa: E402
from mesh.control.cli import resolve_model  # noqa: E402
from mesh.core.compute import on_compute_thread  # noqa: E402
from mesh.core.config import ModelConfig, StationSpec  # noqa: E402
from mesh.core.model.gguf_convert import SMOLLM2  # noqa: E402
from station.step import Station  # noqa: E402
from step import prompts, run_ours  # noqa: E402

PRESETS = {"smollm2": SMOLLM2, "bench": "bench"}
STEPS = 32


@contextlib.contextmanager
def using(station: Station, lib: ctypes.CDLL):
    """The station's fused layers, final norm and head on `lib` while inside (the only callers on a decode step)."""
    saved = (station.fused.lib, kernels.load_native, quant_linear.load_native)
    station.fused.lib = lib
    kernels.load_native = quant_linear.load_native = lambda: (lib, "")
    try:
        yield
    finally:
        station.fused.lib, kernels.load_native, quant_linear.load_native = saved


def decode_round(station: Station, batch: int) -> tuple[float, list[int]]:
    """ms per step of `batch` sequences over STEPS decode steps (bench/step.py's loop), and sequence 0's tokens."""
    (wall, _cpu), tokens = run_ours(station, prompts(batch, 1, station.config.vocab_size), STEPS + 1, "cpu")
    return wall / STEPS * 1e3, tokens


def main(argv: list[str] | None = None) -> dict:
    """Run the A/B and print its table and JSON; returns the JSON object."""
    p = argparse.ArgumentParser(prog="mesh bench kernel_ab", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2",
                   help="smollm2, bench (built-in presets), a checkpoint directory or a .gguf file")
    p.add_argument("--base", default="HEAD", help="git revision whose kernels are the baseline")
    p.add_argument("--batches", default="1,4,16", help="sequences per wave, comma-separated")
    p.add_argument("--rounds", type=int, default=20, help="pairs of rounds per batch (median taken)")
    p.add_argument("--quick", action="store_true", help="2 pairs of rounds, batch 1 (a smoke test)")
    a = p.parse_args(argv)
    rounds, batches = (2, [1]) if a.quick else (a.rounds, [int(b) for b in a.batches.split(",")])
    model = resolve_model(None, PRESETS[a.model]) if a.model in PRESETS else Path(a.model)
    layers = ModelConfig.from_dir(model).num_hidden_layers
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "base").mkdir()
        libs = {"base": build(checkout_csrc(a.base, Path(tmp) / "base"), Path(tmp) / "base.so"),
                "tree": build(ROOT / CSRC, Path(tmp) / "tree.so")}
        station = Station(model, StationSpec(layers=(0, layers)))
        if station.fused is None:
            raise SystemExit("kernel_ab: this station does not run the fused native kernels (no packed float32 path)")
        print(f"kernel_ab (MEASUREMENT): {model.name}, {layers} layers, base = {a.base}, tree = working tree",
              file=sys.stderr)
        result = {"model": str(model), "base": a.base, "batches": {}}
        for batch in batches:
            ms, tokens = {"base": [], "tree": []}, {}
            for name in libs:  # warm-up: the first round after a switch of shape or build is not timed
                with using(station, libs[name]):
                    on_compute_thread(decode_round, station, batch)
            for r in range(rounds):
                for name in ("base", "tree") if r % 2 else ("tree", "base"):
                    with using(station, libs[name]):
                        got, tokens[name] = on_compute_thread(decode_round, station, batch)
                    ms[name].append(got)
            pairs = [t / b for t, b in zip(ms["tree"], ms["base"])]
            fig = {"base_ms": statistics.median(ms["base"]), "tree_ms": statistics.median(ms["tree"]),
                   "paired_ratio": statistics.median(pairs), "tree_faster": sum(x < 1 for x in pairs),
                   "pairs": len(pairs), "same_tokens": tokens["base"] == tokens["tree"], "samples": ms}
            result["batches"][batch] = fig
            print(f"batch {batch:3d}: base {fig['base_ms']:7.2f} ms/step  tree {fig['tree_ms']:7.2f}  paired tree/base "
                  f"{fig['paired_ratio']:.3f}  tree faster in {fig['tree_faster']}/{fig['pairs']}  same tokens "
                  f"{fig['same_tokens']}", flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
