"""Where a pipeline station's idle went in one timed run (a measurement): its steps (station.timeline) inside the
run's wall-clock window, split into the wait before its first step, the gaps between steps (the longest apart: in the
core-quota workload, the turn from prompts to decode) and the wait after its last step; and, for a chain, how long a
station that waited took to start once what it waited for had ended at the station before it (`ring_handoffs`).

Wall clocks compare across the processes of one node only: a mesh spread over nodes gets no breakdown.
"""
from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence

WAITED_MS = 0.3  # a decode step that began more than this after the station's previous step ended waited for input


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


def ring_handoffs(chain: Sequence[Sequence[Sequence[float]]], start: float, end: float,
                  waited_ms: float = WAITED_MS) -> dict | None:
    """A chain's hand-offs in the window [start, end] (wall clock, s), from its stations' steps in chain order: for
    each decode step (a row an entry) a station began more than `waited_ms` after its previous step ended, the ms
    since the latest step of the station it waited for had ended (the one before it; for the first station, the
    last: the samples' way back). Their medians (None where no step waited) and counts: `hop_ms` / `hops_waited` for
    each station after the first, `back_ms` / `back_waited` for the first; None for fewer than two stations."""
    if len(chain) < 2:
        return None
    inside = [sorted((s[0], s[1], s[2] == s[3]) for s in spans if s[0] >= start and s[0] + s[1] <= end)
              for spans in chain]
    ms = 1e3

    def waits(i: int) -> list[float]:  # station i's waited decode steps, timed from the ends of the one it waits for
        ends = sorted(b + d for b, d, _ in inside[i - 1])  # i - 1 == -1: the last station, for the first
        got = []
        for before, (begin, _, decode) in zip(inside[i], inside[i][1:]):
            if not decode or ms * (begin - before[0] - before[1]) <= waited_ms:
                continue
            at = bisect.bisect_right(ends, begin)
            if at:
                got.append(ms * (begin - ends[at - 1]))
        return got

    def median(v: list[float]) -> float | None:
        return statistics.median(v) if v else None

    hops = [waits(i) for i in range(1, len(chain))]
    back = waits(0)
    return {"hop_ms": [median(h) for h in hops], "hops_waited": [len(h) for h in hops],
            "back_ms": median(back), "back_waited": len(back)}


def describe_ring(ring: dict) -> str:
    """One line for `ring_handoffs`'s result."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"
    hops = ", ".join(f"{ms(h)} ({n})" for h, n in zip(ring["hop_ms"], ring["hops_waited"]))
    return (f"the ring's hand-offs, ms at the median of the steps that waited for them (their count): a hop to each "
            f"station after the first {hops}, the samples' way back to the first {ms(ring['back_ms'])} "
            f"({ring['back_waited']})")
