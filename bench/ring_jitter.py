"""What the two cores' speed swings cost a two-station decode ring, and what an elastic layer boundary would win back:
a MODEL over measured speed traces (a measurement: nothing here serves).

    python bench/ring_jitter.py [--model DIR] [--split A] [--rows 32] [--seconds 40] [--steps 63]
                                [--handoff-ms 1.0] [--min-layers 4] [--quick]
    mesh bench ring_jitter ...  (same arguments)

(1) Record: two processes, pinned to cores 0 and 1, each step the first stage's layers [0, A) at rows/2 decode rows
back to back for --seconds, at once, as a core-quota pair's stations do (issue 13); each keeps its steps' wall-clock
start and duration: its core's speed over time (a VM whose host slows a core ~2x for seconds at a time, each core on
its own, shows it here).
(2) Model: the pair's decode phase, two lanes of rows/2 sequences in a ring of two stations: the first holds layers
[0, A), the second the rest and the head (weighed in layers by its weights' size); a lane's step starts at the first
station once its samples are back, each hop adds --handoff-ms, and each station's share of a step takes as long as
its core's trace says (a layer at time t: 1/A of the recorded step covering t). Static: the split as built. Elastic:
the first station hands a lane's rows on after any layer from --min-layers once the second is idle, else goes on, up
to the last layer (the second always computes the head) -- what a boundary that moves at run time would reach, were
both stations to hold the layers between and their KV (not built).
Printed: per window of the trace (a start every 1.5 s), the static and the elastic ring's span for --steps steps of
both lanes; their medians, the elastic / static throughput, and each station's busy fraction in the static ring. Set
the static span beside a core-quota run's decode phase in the same hour (the pair's steps from its first 16-row step
on, `mesh bench core_quota`) to see whether the ring's idle is the cores' swings or the software. The last line
printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import bisect
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # run as a script or loaded from its file

WINDOW_EVERY_MS = 1500.0  # model windows start this far apart along the trace


@dataclass(frozen=True)
class CoreTrace:
    """One core's back-to-back steps of `layers` layers: start times (ms from the recording's start) and durations."""

    starts_ms: tuple[float, ...]
    step_ms: tuple[float, ...]
    layers: int

    def layer_ms(self, t_ms: float) -> float:
        """What one layer takes on this core at t (the recorded step covering t; before the first, the first)."""
        i = max(0, bisect.bisect_right(self.starts_ms, t_ms) - 1)
        return self.step_ms[i] / self.layers

    @property
    def end_ms(self) -> float:
        """When the recording's last step ended."""
        return self.starts_ms[-1] + self.step_ms[-1]


def finish_ms(core: CoreTrace, t_ms: float, layers: float) -> float:
    """When `layers` layers begun on `core` at t end (a quarter layer at a time, each at the speed it starts at)."""
    left = layers
    while left > 1e-9:
        part = min(left, 0.25)
        t_ms += part * core.layer_ms(t_ms)
        left -= part
    return t_ms


@dataclass(frozen=True)
class RingSpan:
    """A modelled decode phase: its span and each station's busy time (ms)."""

    span_ms: float
    busy_ms: tuple[float, float]


def ring_span(first: CoreTrace, second: CoreTrace, start_ms: float, steps: int, split: int, layers: int,
              head_layers: float, handoff_ms: float, min_layers: int | None = None) -> RingSpan:
    """Two lanes' `steps` decode steps through the ring from start_ms (module docstring): the first station holds
    [0, split) and the second the rest of `layers` and the head; with `min_layers` the boundary is elastic."""
    ready = [start_ms, start_ms]  # when each lane's token ids are at the first station
    free = [start_ms, start_ms]  # when each station is next free
    busy = [0.0, 0.0]
    for _ in range(steps):
        for lane in (0, 1):
            begin = max(free[0], ready[lane])
            if min_layers is None:
                done, held = finish_ms(first, begin, split), split
            else:  # layer by layer, on at the first layer from min_layers where the second is idle
                done, held = begin, 0
                while True:
                    done, held = finish_ms(first, done, 1), held + 1
                    if held >= layers or (held >= min_layers and free[1] <= done + handoff_ms):
                        break
            busy[0] += done - begin
            free[0] = done
            begin2 = max(free[1], done + handoff_ms)
            free[1] = finish_ms(second, begin2, layers - held + head_layers)
            busy[1] += free[1] - begin2
            ready[lane] = free[1] + handoff_ms
    return RingSpan(max(ready) - start_ms, (busy[0], busy[1]))


def head_in_layers(cfg) -> float:
    """The final norm and LM head's weights over one decoder layer's (a decode step's time at a few rows goes by the
    weights it reads: mesh.control.layer_plan.step_weights)."""
    from mesh.control.layer_plan import step_weights

    weights = step_weights(cfg)
    return (weights[-1] - weights[0]) / weights[0]


def _record_core(model_dir: str, layers: tuple[int, int], rows: int, core: int, begin_at: float, seconds: float,
                 out) -> None:
    """In a process pinned to `core`: one stage's decode steps back to back from wall time begin_at, for `seconds`."""
    os.sched_setaffinity(0, {core})
    from pipeline_ceiling import decode_stepper

    step = decode_stepper(Path(model_dir), layers, rows, 1)
    step()  # untimed: the first touches the weights
    while time.time() < begin_at:
        time.sleep(0.001)
    spans = []
    while time.time() - begin_at < seconds:
        t = time.time()
        spans.append(((t - begin_at) * 1e3, step()))
    out.put((core, spans))


def record(model_dir: Path, split: int, rows: int, seconds: float, lead_s: float = 30.0) -> tuple[CoreTrace, ...]:
    """Both cores' traces, recorded at once (each process loads its station first; both begin lead_s from now)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    begin_at = time.time() + lead_s
    procs = [ctx.Process(target=_record_core, args=(str(model_dir), (0, split), rows, core, begin_at, seconds, out))
             for core in (0, 1)]
    for p in procs:
        p.start()
    got: dict[int, list] = {}
    deadline = time.monotonic() + lead_s + seconds + 120
    while len(got) < len(procs):
        try:
            core, spans = out.get(timeout=1.0)
            got[core] = spans
        except queue.Empty:
            failed = [(c, p.exitcode) for c, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError("ring_jitter: " + (f"the recording on core {failed[0][0]} exited with {failed[0][1]}"
                                                      if failed else "the recordings did not end in time"))
    for p in procs:
        p.join(timeout=30)
    return tuple(CoreTrace(tuple(s for s, _ in got[c]), tuple(ms for _, ms in got[c]), split) for c in (0, 1))


def model(traces: tuple[CoreTrace, CoreTrace], steps: int, split: int, layers: int, head_layers: float,
          handoff_ms: float, min_layers: int) -> dict:
    """The static and the elastic ring over every window of the traces; their spans and the medians."""
    first, second = traces
    usable = min(first.end_ms, second.end_ms)
    windows = []
    start = 0.0
    while True:
        static = ring_span(first, second, start, steps, split, layers, head_layers, handoff_ms)
        if start + static.span_ms > usable and windows:
            break
        elastic = ring_span(first, second, start, steps, split, layers, head_layers, handoff_ms, min_layers)
        windows.append({"start_ms": start, "static_ms": static.span_ms, "elastic_ms": elastic.span_ms,
                        "static_busy": [b / static.span_ms for b in static.busy_ms]})
        start += WINDOW_EVERY_MS
    return {"windows": windows,
            "static_ms": statistics.median(w["static_ms"] for w in windows),
            "elastic_ms": statistics.median(w["elastic_ms"] for w in windows),
            "elastic_gain": statistics.median(w["static_ms"] / w["elastic_ms"] for w in windows),
            "static_busy": [statistics.median(w["static_busy"][i] for w in windows) for i in (0, 1)]}


def main(argv: list[str] | None = None) -> int:
    """Record, model, print; the last line one JSON object."""
    p = argparse.ArgumentParser(prog="mesh bench ring_jitter", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint dir (default: the built-in `bench` preset; `tiny` with --quick)")
    p.add_argument("--split", type=int, help="first layer of the second station (default: balance compute's, 8 of "
                   "the bench preset's 12)")
    p.add_argument("--rows", type=int, default=32, help="concurrent sequences: two lanes of rows/2")
    p.add_argument("--seconds", type=float, help="recording length (default 40; --quick 2)")
    p.add_argument("--steps", type=int, help="decode steps of each lane modelled (default 63: a core-quota run's 64 "
                   "tokens, the first drawn by the prompt's step; --quick 4)")
    p.add_argument("--handoff-ms", type=float, default=1.0, help="each hop's hand-off (rows out, samples back)")
    p.add_argument("--min-layers", type=int, default=4, help="the elastic boundary's fewest layers at the first")
    p.add_argument("--quick", action="store_true", help="a smoke test: the tiny checkpoint, 2 s, 4 steps")
    a = p.parse_args(argv)
    if a.rows < 2 or a.rows % 2:
        p.error(f"--rows: an even count of two or more, got {a.rows}")
    for name, value, least in (("seconds", a.seconds, 0.1), ("steps", a.steps, 1), ("min-layers", a.min_layers, 1),
                               ("handoff-ms", a.handoff_ms, 0.0)):
        if value is not None and value < least:
            p.error(f"--{name}: must be >= {least:g}, got {value:g}")
    from mesh.control.cli import resolve_model
    from mesh.core.config import ModelConfig
    from mesh.control.layer_plan import plan_layers, split_weights

    if not {0, 1} <= os.sched_getaffinity(0):
        print("ring_jitter: needs cores 0 and 1 (one per station)", file=sys.stderr)
        return 2
    model_dir = resolve_model(a.model, "tiny" if a.quick else "bench")
    cfg = ModelConfig.from_dir(model_dir)
    layers = cfg.num_hidden_layers
    split = a.split or plan_layers(layers, 2, split_weights(cfg, balance="compute"))[0][1]
    if not 0 < split < layers:
        p.error(f"--split: between 1 and {layers - 1}, got {split}")
    seconds = a.seconds or (2.0 if a.quick else 40.0)
    steps = a.steps or (4 if a.quick else 63)
    head = head_in_layers(cfg)
    print(f"ring_jitter (MODEL over measured traces): {model_dir.name}, layers [0, {split}) | [{split}, {layers}) + "
          f"head ({head:.2f} layers), {a.rows // 2} rows a lane, {steps} steps, recording {seconds:g} s on cores 0 "
          f"and 1", flush=True)
    traces = record(model_dir, split, a.rows // 2, seconds, lead_s=5.0 if a.quick else 30.0)
    for core, t in enumerate(traces):
        ms = sorted(t.step_ms)
        print(f"core {core}: {len(ms)} steps of [0, {split}), median {statistics.median(ms):.1f} ms "
              f"(p10 {ms[len(ms) // 10]:.1f}, p90 {ms[9 * len(ms) // 10]:.1f})")
    out = model(traces, steps, split, layers, head, a.handoff_ms, min(a.min_layers, split))
    for w in out["windows"]:
        print(f"from {w['start_ms'] / 1e3:5.1f} s: static {w['static_ms']:8.1f} ms (busy {w['static_busy'][0]:.3f} / "
              f"{w['static_busy'][1]:.3f}), elastic {w['elastic_ms']:8.1f} ms")
    print(f"medians over {len(out['windows'])} windows: static ring {out['static_ms']:.1f} ms, elastic "
          f"{out['elastic_ms']:.1f} ms, elastic / static throughput {out['elastic_gain']:.3f}x; the static ring's "
          f"stations busy {out['static_busy'][0]:.3f} / {out['static_busy'][1]:.3f} (MODEL)")
    print(json.dumps({"model": str(model_dir), "split": split, "layers": layers, "head_layers": head,
                      "rows": a.rows, "steps": steps, "handoff_ms": a.handoff_ms, "min_layers": a.min_layers,
                      "traces": [{"starts_ms": t.starts_ms, "step_ms": t.step_ms} for t in traces], **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
