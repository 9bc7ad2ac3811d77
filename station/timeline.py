"""A station's last steps on the wall clock: when each began, how long it took, its rows and entries.

Recorded on every step (a bounded deque; 0.56 us a step with the clock read, timed in a loop of 200,000 here) so
that a benchmark can take a pipeline's idle apart after a run (bench/idle_parts.py: each station's gaps, where its
busy fraction alone says only how much). Wall-clock times (time.time) compare across the processes of one node, not
across nodes.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple

TIMELINE_STEPS = 8192  # steps kept, the oldest dropped first (a 64-token core-quota run takes ~400 at a station)


class StepSpan(NamedTuple):
    """One step: its wall-clock start (s since the epoch), its seconds, its rows and its entries."""

    start: float
    seconds: float
    rows: int
    entries: int


class StepTimeline:
    """The last TIMELINE_STEPS steps of a station, oldest first."""

    def __init__(self, keep: int = TIMELINE_STEPS) -> None:
        self._spans: deque[StepSpan] = deque(maxlen=keep)
        self._lock = threading.Lock()  # a copy may be taken from any thread while steps are recorded

    def record(self, start: float, seconds: float, rows: int, entries: int) -> None:
        """One step that began at wall-clock `start` and took `seconds`."""
        with self._lock:
            self._spans.append(StepSpan(start, seconds, rows, entries))

    def spans(self) -> list[StepSpan]:
        """The steps kept, oldest first (a copy)."""
        with self._lock:
            return list(self._spans)
