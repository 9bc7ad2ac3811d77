"""A station's core claim (station.cores) when it cannot pin: each case leaves the process unpinned and says why."""
from __future__ import annotations

import fcntl
import os

from station.cores import claim_cores


def test_less_than_one_core_is_not_pinned(tmp_path):
    got = claim_cores(0.5, tmp_path, available={0})
    assert not got.pinned and "less than one whole core" in got.reason


def test_more_cores_than_the_process_may_use_is_not_pinned(tmp_path):
    got = claim_cores(3, tmp_path, available={0, 1})
    assert not got.pinned and "may run on 2 core(s)" in got.reason


def test_a_core_another_station_holds_is_not_taken(tmp_path):
    """Another claimant holds core 0's lock: a 2-core claim on {0, 1} gets nothing, and lets core 1 go again."""
    other = os.open(tmp_path / "core-0.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        got = claim_cores(2, tmp_path, available={0, 1})
        assert not got.pinned and "only 1 of this node's 2 core(s) are free" in got.reason
    finally:
        os.close(other)
    before = os.sched_getaffinity(0)
    spare = os.open(tmp_path / "core-1.lock", os.O_RDWR | os.O_CREAT)
    try:  # the failed claim released the core it had taken
        fcntl.flock(spare, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(spare)
    assert os.sched_getaffinity(0) == before


def test_a_claim_made_again_after_the_holder_left_pins_the_process(tmp_path):
    """A station that started while another held its core claims it once the other is gone (as after a reroute);
    giving the core back lets the process (and a thread it started while pinned) run where it could before."""
    import threading

    before = os.sched_getaffinity(0)
    core = min(before)
    other = os.open(tmp_path / f"core-{core}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert not claim_cores(1, tmp_path, available={core}).pinned
    finally:
        os.close(other)  # the other station ends
    again = claim_cores(1, tmp_path, available={core})
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, daemon=True)
    try:
        assert again.pinned and again.cores == (core,) and os.sched_getaffinity(0) == {core}
        worker.start()  # inherits the pinned affinity
        assert os.sched_getaffinity(worker.native_id) == {core}
    finally:
        again.release()
    try:
        assert os.sched_getaffinity(0) == before and os.sched_getaffinity(worker.native_id) == before
    finally:
        stop.set()
        worker.join(timeout=10)
    mine = os.open(tmp_path / f"core-{core}.lock", os.O_RDWR | os.O_CREAT)
    try:  # and its lock is free for the next station
        fcntl.flock(mine, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(mine)
