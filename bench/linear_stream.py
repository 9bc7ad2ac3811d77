"""The packed float32 linears over a model's worth of weights, by row count: two kernel sources side by side.

    python bench/linear_stream.py [--rows 1,2,4,8,16,32,64] [--base HEAD] [--rounds 9] [--threads 2] [--busy 0.3]
    mesh bench linear_stream ...  (same arguments)

Builds csrc/ twice, as committed at --base and as in the working tree, and times one model step of linears with
each in alternating rounds: SmolLM2-135M's shapes (30 layers of qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536, then the 49152x576 head), each layer its own random weights (~540 MB float32, so every weight
streams from memory as it does in a served step; a benchmark that reuses one small matrix reads it from cache and
misjudges prefetching). Prints per row count the median step time of each, their ratio, and whether their outputs'
bits are equal (the last linear of each output shape: qkv, down, gate_up, head; a kernel change must not move
them). Measures the kernels alone: no station, no model.
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mesh.core.model.fused import FIELDS  # noqa: E402
from mesh.core.model.native import SIGNATURES, build_library  # noqa: E402
from mesh.core.model.packed import pack_rows  # noqa: E402

CSRC = "mesh/core/model/csrc"
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of qkv, o, gate_up, down
HEAD, LAYERS = (49152, 576), 30
BUSY_LOOP = ("import sys, time\nshare = float(sys.argv[1])\nwhile True:\n    end = time.perf_counter() + 1e-3 * share\n"
             "    while time.perf_counter() < end:\n        pass\n    time.sleep(1e-3 * (1 - share))\n")


def build(src: Path, out: Path) -> ctypes.CDLL:
    """Compile every .c in src as the station does (native.build_library) and load it, every exported function
    with the station's argument types (native.SIGNATURES)."""
    build_library(shutil.which("cc") or "gcc", out, tuple(sorted(src.glob("*.c"))))
    lib = ctypes.CDLL(str(out))
    missing = [name for name in SIGNATURES if not hasattr(lib, name)]
    if missing:  # an older revision's kernels: their calls (and the fused layers' table) differ from these
        raise SystemExit(f"the kernels in {src} lack {', '.join(missing)}: they predate the station's native "
                         "interface (session 46 added narrow tiles and the fused table's tile format, session 49 a "
                         "format per linear and fused_table_fields); compare against a later revision")
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    fields = torch.zeros(1, dtype=torch.int64)
    lib.fused_table_fields(fields.data_ptr())
    if fields.item() != len(FIELDS):  # a station switched onto it would hand it rows it reads otherwise
        raise SystemExit(f"the kernels in {src} read fused-layer table rows of {fields.item()} fields, this tree "
                         f"writes {len(FIELDS)} (session 49 added q, k and v apart): compare against a revision "
                         "whose table is this one's")
    return lib


def checkout_csrc(rev: str, dest: Path) -> Path:
    """The kernel sources as committed at rev, written under dest."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        data = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=ROOT, check=True, capture_output=True).stdout
        (dest / name).write_bytes(data)
    return dest


def model_weights() -> list[tuple[torch.Tensor, int, int]]:
    """(packed weight, out features, in features) for every linear of a step, in order."""
    torch.manual_seed(0)
    shapes = [s for _ in range(LAYERS) for s in LAYER_SHAPES] + [HEAD]
    return [(pack_rows([torch.randn(n, k)]), n, k) for n, k in shapes]


def step(fn, weights, xs, outs, rows: int, threads: int) -> float:
    """Seconds for one pass of every linear at `rows` rows."""
    t0 = time.perf_counter()
    for wp, n, k in weights:
        fn(xs[k].data_ptr(), rows, k, k, wp.data_ptr(), n, None, outs[n].data_ptr(), threads)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64", help="row counts to time, comma-separated")
    p.add_argument("--base", default="HEAD", help="git revision whose kernels are the baseline")
    p.add_argument("--rounds", type=int, default=9, help="alternating rounds per row count (median taken)")
    p.add_argument("--threads", type=int, default=2, help="OpenMP threads of each call")
    p.add_argument("--busy", type=float, default=0.0,
                   help="share of one core (0-1) a competing process keeps busy in 1 ms slices while timing, as a "
                        "server's other threads do (0: none)")
    args = p.parse_args()
    if not 0.0 <= args.busy < 1.0:
        p.error("--busy must be in [0, 1)")
    competitor = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(args.busy)]) if args.busy else None
    try:
        run(args)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()


def run(args: argparse.Namespace) -> None:
    """Build both kernels, then time every row count in alternating rounds and print one line each."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "base").mkdir()
        kernels = {"base": build(checkout_csrc(args.base, tmp / "base"), tmp / "base.so"),
                   "tree": build(ROOT / CSRC, tmp / "tree.so")}
        weights = model_weights()
        print(f"linear_stream: {len(weights)} linears, {sum(w.numel() for w, _, _ in weights) * 4 / 1e9:.2f} GB "
              f"float32, {args.threads} threads; base = {args.base}, tree = working tree"
              + (f"; a competing process keeps {args.busy:.0%} of a core busy" if args.busy else ""))
        for rows in map(int, args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for k in {k for _, _, k in weights}}
            outs = {n: torch.empty(rows, n) for n in {n for _, n, _ in weights}}
            times, last = {name: [] for name in kernels}, {}
            for r in range(args.rounds):
                for name in (kernels if r % 2 else reversed(kernels)):
                    times[name].append(step(kernels[name].packed_linear_f32, weights, xs, outs, rows,
                                            args.threads))
                    last[name] = {n: out.clone() for n, out in outs.items()}
            base, tree = statistics.median(times["base"]), statistics.median(times["tree"])
            print(f"rows {rows:3d}: base {base * 1e3:7.1f} ms  tree {tree * 1e3:7.1f} ms  tree/base {tree / base:.2f}"
                  f"  same bits {all(torch.equal(last['base'][n], last['tree'][n]) for n in outs)}", flush=True)


if __name__ == "__main__":
    main()
