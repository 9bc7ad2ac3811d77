"""A station's step timeline (station.timeline) and the benchmark's breakdown of its idle (bench/idle_parts.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mesh.core.config import StationSpec
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.step import Station
from station.timeline import StepTimeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from idle_parts import describe, describe_ring, idle_parts, ring_handoffs  # noqa: E402


def test_idle_parts_splits_a_window_into_its_waits_and_gaps():
    """Hand-built steps in a 1 s window: 100 ms before the first, gaps of 300, 20 and 10 ms, 50 after the last; a
    step outside the window (a warm-up) does not count; the decode steps (a row an entry) have their median; no step
    in the window gives no breakdown."""
    t = 1000.0
    spans = [(t - 5.0, 0.1, 8, 1),  # before the window
             (t + 0.1, 0.2, 64, 4), (t + 0.6, 0.1, 4, 4), (t + 0.72, 0.1, 4, 4), (t + 0.83, 0.12, 4, 4)]
    parts = idle_parts(spans, t, t + 1.0)
    want = {"window_ms": 1000.0, "busy_ms": 520.0, "steps": 4, "before_first_ms": 100.0, "after_last_ms": 50.0,
            "longest_gap_ms": 300.0, "other_gaps_ms": 30.0, "other_gaps": 2, "median_gap_ms": 15.0,
            "decode_steps": 3, "median_decode_step_ms": 100.0}
    assert parts.keys() == want.keys() and all(parts[k] == pytest.approx(v) for k, v in want.items())
    busy_and_idle = sum(parts[k] for k in ("busy_ms", "before_first_ms", "longest_gap_ms", "other_gaps_ms",
                                           "after_last_ms"))
    assert busy_and_idle == pytest.approx(parts["window_ms"])
    assert "idle 480 of 1000 ms" in describe(parts) and "300.0 its longest gap" in describe(parts)
    assert "decode steps 100.00 ms at the median" in describe(parts)
    assert idle_parts(spans, t + 2.0, t + 3.0) is None
    one = idle_parts([(t + 0.5, 0.25, 1, 1)], t, t + 1.0)
    assert one["longest_gap_ms"] == one["other_gaps_ms"] == one["median_gap_ms"] == 0.0 and one["other_gaps"] == 0
    prompt_only = idle_parts([(t + 0.5, 0.25, 16, 2)], t, t + 1.0)
    assert prompt_only["decode_steps"] == 0 and prompt_only["median_decode_step_ms"] is None
    assert "decode steps" not in describe(prompt_only)


def test_ring_handoffs_time_the_waits_from_what_ended_before_them():
    """A hand-built two-lane ring of two stations (times in ms): the second station waits for each of the first's
    decode steps and starts 0.5 ms after it ends; the first waits 2 ms for one lane's samples once (started 0.4 ms
    after the second's step ended) and otherwise goes on 0.1 ms after its own step. Steps that did not wait, prompt
    steps and steps outside the window do not count; a lone station has no ring."""
    ms = 1e-3
    first = [(0.0, 10 * ms, 32, 2)]  # a prompt step: not a decode step (its rows are not one an entry)
    second = []
    t = 10.1 * ms
    for k in range(4):
        first.append((t, 10 * ms, 16, 16))
        second.append((t + 10.5 * ms, 9 * ms, 16, 16))
        t += 10.1 * ms
    # the first station's next step waits for the second's last one (began 40.4 + 10.5 ms, ended 9 ms on) + 0.4 ms
    first.append(((40.4 + 10.5 + 9 + 0.4) * ms, 10 * ms, 16, 16))
    ring = ring_handoffs([first, second], -1.0, 1.0)
    assert ring["hops_waited"] == [3] and ring["hop_ms"][0] == pytest.approx(0.5)  # the second's first: none before
    assert ring["back_waited"] == 1 and ring["back_ms"] == pytest.approx(0.4)
    assert "0.50 (3)" in describe_ring(ring) and "back to the first 0.40 (1)" in describe_ring(ring)
    assert ring_handoffs([first], -1.0, 1.0) is None
    none_waited = ring_handoffs([first[:-1], second], -1.0, 1.0)
    assert none_waited["back_ms"] is None and none_waited["back_waited"] == 0 and "back to the first - (0)" in \
        describe_ring(none_waited)
    assert ring_handoffs([first, second], 5.0, 6.0)["hops_waited"] == [0]  # nothing in that window


def test_a_station_records_each_step_on_the_wall_clock(tiny_llama):
    """Every step leaves its wall-clock start, seconds, rows and entries, oldest first, after the one before it
    ended; the timeline keeps only its last steps."""
    station = Station(tiny_llama, StationSpec(layers=(0, 6)))
    g = SamplingParams(max_tokens=4)
    station.forward((WaveEntry(0, 0, 5, g), WaveEntry(1, 0, 3, g)), token_ids=torch.arange(8) + 3)
    station.forward((WaveEntry(0, 5, 1, g), WaveEntry(1, 3, 1, g)), token_ids=torch.tensor([7, 9]))
    first, second = station.timeline.spans()
    assert (first.rows, first.entries, second.rows, second.entries) == (8, 2, 2, 2)
    assert first.seconds > 0 and second.start >= first.start + first.seconds
    kept = StepTimeline(keep=3)
    for i in range(5):
        kept.record(float(i), 0.5, i, 1)
    assert [s.rows for s in kept.spans()] == [2, 3, 4]
