"""A pipeline's side of several-step waves whose samples stream back in parts (station.step_replies).

Each part goes to the engine as it comes (its samples and the step it starts at); the part holding the wave's
last step lands it. The engine may ask a pipeline to end a streamed wave early (a request waits for a lane, the
route is to change): the first station then stops after the step under way and ends its stream, and the pipeline
lands the wave at the steps that came with an empty part. A stream that ends short without being asked is a
station failure (StationDown: the wave's effect is unknown).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from mesh.core.wave import SampledToken
from orchestrator.scheduler_types import WavePlan
from orchestrator.station_link import StationDown, StationLink

log = logging.getLogger(__name__)


class EarlyEnds:
    """The streamed waves a pipeline was asked to end early."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: set[int] = set()

    def ask(self, link: StationLink, wave_id: int) -> None:
        """End the wave's streamed call at `link` (its first station) after the step under way: the station call
        goes out on a thread of its own, the caller (the engine, under its lock) does not wait for it."""
        with self._lock:
            self._asked.add(wave_id)
        threading.Thread(target=link.end_steps, args=(wave_id,), name=f"end-steps-{wave_id}", daemon=True).start()

    def take(self, wave_id: int) -> bool:
        """True when the wave was asked to end early (forgotten now: its call is over)."""
        with self._lock:
            asked = wave_id in self._asked
            self._asked.discard(wave_id)
        return asked


class StreamedWaves:
    """The engine's streamed several-step waves in flight that were not asked to end early, and how many were."""

    def __init__(self) -> None:
        self._plans: dict[int, WavePlan] = {}
        self.ended_early = 0  # streamed waves asked to end before their last step

    def __bool__(self) -> bool:
        return bool(self._plans)

    def add(self, plan: WavePlan) -> None:
        """A streamed wave went out."""
        self._plans[plan.wave_id] = plan

    def discard(self, wave_id: int) -> None:
        """The wave landed or failed (its call is over)."""
        self._plans.pop(wave_id, None)

    def end(self, pipeline, live: Callable[[int], bool] | None = None) -> None:
        """Ask `pipeline` to end early every streamed wave (`live` given: those holding a sequence for which it is
        False, one that ended before the wave's last step); each lands within a step, its live sequences are planned
        again."""
        plans = [p for p in self._plans.values() if live is None or not all(live(e.seq_id) for e in p.entries)]
        for plan in plans:
            pipeline.end_steps(plan)
            del self._plans[plan.wave_id]
        self.ended_early += len(plans)


def deliver_parts(plan: WavePlan, parts: Iterable[list[SampledToken | None]], on_done: Callable[..., None],
                  ends: EarlyEnds, station: str) -> None:
    """Hand each part's samples of the streamed wave `plan` to `on_done(plan, samples, None, first_step)` as it
    comes; a stream that ends before the wave's last step lands it with an empty part where `ends` asked for that,
    and raises StationDown otherwise. Raises what the stream raises before the wave's last step, after the parts
    that came (what it raises after the last step is logged: the wave landed)."""
    step = 0
    try:
        for samples in parts:
            on_done(plan, samples, None, step)
            step += len(samples) // len(plan.entries)
    except Exception as e:
        if step < plan.steps:
            raise
        # the last part landed the wave: a stream that breaks after it (a station hung or killed before its call's
        # end) fails no wave; the route's next call to that station finds it
        log.warning("station %s: the stream of wave %d failed after its last step: %s", station, plan.wave_id, e)
    finally:
        asked = ends.take(plan.wave_id)
    if step < plan.steps:
        if not asked:
            raise StationDown(f"station {station}: the stream of wave {plan.wave_id} ended after {step} of its "
                              f"{plan.steps} steps, unasked")
        on_done(plan, [], None, step)
