"""Where a pipeline station's idle went in one timed run (a measurement): its steps (station.timeline) inside the
run's wall-clock window, split into the wait before its first step, the gaps between steps (the longest apart: in the
core-quota workload, the turn from prompts to decode) and the wait after its last step.

Wall clocks compare across the processes of one node only: a mesh spread over nodes gets no breakdown.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence


def idle_parts(spans: Sequence[Sequence[float]], start: float, end: float) -> dict | None:
    """The idle of a station whose steps are `spans` ((wall start, seconds, rows, entries), oldest first) in the
    window [start, end] (wall clock, s): ms before its first step and after its last, its longest gap, the other
    gaps' sum, count and median, its busy ms and the window's, and the median ms of its decode steps (a row an
    entry); None when no step of it fell in the window."""
    kept = [s for s in spans if s[0] >= start and s[0] + s[1] <= end]
    inside = sorted((s[0], s[1]) for s in kept)
    if not inside:
        return None
    decode = [s[1] for s in kept if s[2] == s[3]]
    gaps = sorted(max(0.0, b[0] - (a[0] + a[1])) for a, b in zip(inside, inside[1:]))
    longest, others = (gaps[-1], gaps[:-1]) if gaps else (0.0, [])
    ms = 1e3
    return {"window_ms": ms * (end - start), "busy_ms": ms * sum(s for _, s in inside), "steps": len(inside),
            "before_first_ms": ms * (inside[0][0] - start), "after_last_ms": ms * (end - sum(inside[-1])),
            "longest_gap_ms": ms * longest, "other_gaps_ms": ms * sum(others), "other_gaps": len(others),
            "median_gap_ms": ms * statistics.median(others) if others else 0.0,
            "decode_steps": len(decode), "median_decode_step_ms": ms * statistics.median(decode) if decode else None}


def describe(parts: dict) -> str:
    """One line for `idle_parts`'s result."""
    idle = parts["window_ms"] - parts["busy_ms"]
    return (f"idle {idle:.0f} of {parts['window_ms']:.0f} ms: {parts['before_first_ms']:.1f} before its first "
            f"step, {parts['longest_gap_ms']:.1f} its longest gap, {parts['other_gaps_ms']:.1f} in "
            f"{parts['other_gaps']} other gaps (median {parts['median_gap_ms']:.2f}), {parts['after_last_ms']:.1f} "
            "after its last step" + (f"; its decode steps {parts['median_decode_step_ms']:.2f} ms at the median"
               if parts["median_decode_step_ms"] is not None else ""))
