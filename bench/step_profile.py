"""Where one decode step's time goes: `mesh bench step --profile` (a measurement mode, never a serving mode).

For a few decode waves at each batch size the station's linears, attention calls and sampling are wrapped with
timers (the wrappers are installed for the measurement and removed after it; a station that runs its layers in
one native call times its linears and attention inside C, and the rest of that call, its norms, RoPE, SiLU and
residual adds, is "native_other"); "other" is the rest of the step (on a station running that one call: the Python
and torch ops around it, the KV bookkeeping, validation, the embedding, the RoPE tables). torch's profiler then names the
largest of the other ops by self CPU time, so the next person sees the split without writing a script.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

import station.step as step_module
from mesh.core.model.fused import TIMED_PARTS
from mesh.core.model.llama import Linear
from mesh.core.wave import WaveEntry
from station.native_attention import NativeWaveAttention
from station.wave_attention import WaveAttention

CATEGORIES = ("linears", "attention", "native_other", "sampling")
NATIVE = {"linears": "linears", "attention": "attention", "other": "native_other"}  # TIMED_PARTS -> CATEGORIES


def _timed(fn: Callable, totals: dict[str, float], key: str) -> Callable:
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t0
    return wrapper


def _timed_inside(run_layers: Callable, totals: dict[str, float]) -> Callable:
    """run_layers with the native call's own timers on (its linears and attention, timed in C)."""
    def wrapper(self, fused, hidden, seconds=None, out=None):
        inside = torch.zeros(len(TIMED_PARTS), dtype=torch.float64)
        try:
            return run_layers(self, fused, hidden, inside, out)
        finally:
            for key, value in zip(TIMED_PARTS, inside.tolist()):
                totals[NATIVE[key]] += value
    return wrapper


@contextmanager
def timers(totals: dict[str, float]) -> Iterator[None]:
    """Time every Linear.forward, attention context's attend and sample_tokens call into `totals` while inside
    (and, where a station runs its layers in one native call, that call's linears, attention and the rest of it,
    timed in C)."""
    saved = (Linear.forward, WaveAttention.attend, NativeWaveAttention.attend, NativeWaveAttention.run_layers,
             step_module.sample_tokens)
    Linear.forward = _timed(saved[0], totals, "linears")
    WaveAttention.attend = _timed(saved[1], totals, "attention")
    NativeWaveAttention.attend = _timed(saved[2], totals, "attention")
    NativeWaveAttention.run_layers = _timed_inside(saved[3], totals)
    step_module.sample_tokens = _timed(saved[4], totals, "sampling")
    try:
        yield
    finally:
        (Linear.forward, WaveAttention.attend, NativeWaveAttention.attend, NativeWaveAttention.run_layers,
         step_module.sample_tokens) = saved


def split(totals: dict[str, float], step_seconds: float) -> dict[str, float]:
    """Per-category milliseconds of one step, with "other" = the step less the timed categories (never < 0)."""
    ms = {k: 1e3 * totals.get(k, 0.0) for k in CATEGORIES}
    ms["other"] = max(0.0, 1e3 * step_seconds - sum(ms.values()))
    ms["step"] = 1e3 * step_seconds
    return ms


def profile_decode(station, ids: torch.Tensor, waves: int, greedy) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Prefill ids [B, P], then time `waves` decode waves: (per-step ms by category, top other ops (name, ms/step))."""
    b, p = ids.shape
    seqs = list(range(b))
    out = station.forward(tuple(WaveEntry(s, 0, p, greedy) for s in seqs), token_ids=ids.reshape(-1))
    last = [s.token_id for s in out.samples]
    totals = {k: 0.0 for k in CATEGORIES}
    elapsed = 0.0
    with timers(totals):
        for w in range(waves):
            entries = tuple(WaveEntry(s, p + w, 1, greedy) for s in seqs)
            t0 = time.perf_counter()
            out = station.forward(entries, token_ids=torch.tensor(last))
            elapsed += time.perf_counter() - t0
            last = [s.token_id for s in out.samples]
    ms = split({k: v / waves for k, v in totals.items()}, elapsed / waves)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        entries = tuple(WaveEntry(s, p + waves, 1, greedy) for s in seqs)
        station.forward(entries, token_ids=torch.tensor(last))
    top = sorted(((e.key, e.self_cpu_time_total / 1e3) for e in prof.key_averages()), key=lambda kv: -kv[1])[:8]
    station.release(seqs)
    return ms, top


def format_profile(batch: int, ms: dict[str, float], top: list[tuple[str, float]]) -> str:
    """The profile of one batch size as printed lines."""
    parts = "  ".join(f"{k} {ms[k]:.2f} ms ({ms[k] / ms['step']:.0%})" for k in (*CATEGORIES, "other"))
    ops = ", ".join(f"{name} {t:.2f}" for name, t in top)
    return (f"PROFILE (measurement mode) batch {batch}: step {ms['step']:.2f} ms = {parts}\n"
            f"  largest torch ops in one step, self CPU ms (profiler overhead included): {ops}")
