"""The station lock taken in a call's turn on the compute thread (station/station_lock.py's `queued`): queued calls
run one after another there, each handing on its output before the next starts; a lock held on another thread puts
them off without blocking the compute thread; queued releases, failures and the bound on waiting calls behave as
for calls that take the lock on their own thread."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mesh.core.compute import compute_thread, on_compute_thread
from mesh.core.wave import KVUsage
from station.station_lock import StationBusy, StationLock

WAIT_S = 10.0  # every wait in these tests is bounded


class FakeStation:
    """What the lock reads of a station: its KV occupancy, and releases (counted as sequences held)."""

    def __init__(self, sequences: int = 0, steps_on_compute_thread: bool = True) -> None:
        self.steps_on_compute_thread = steps_on_compute_thread
        self.sequences = sequences
        self.released: list[int] = []

    def kv_usage(self) -> KVUsage:
        return KVUsage(bytes_used=0, blocks_used=0, sequences=self.sequences, changes=len(self.released))

    def release(self, seq_ids: list[int]) -> int:
        self.released.extend(seq_ids)
        self.sequences -= len(seq_ids)
        return len(seq_ids)


def _hold_compute_thread() -> threading.Event:
    """Keep the compute thread busy until the returned event is set (calls posted meanwhile wait in its queue)."""
    started, free = threading.Event(), threading.Event()
    compute_thread().post(lambda: (started.set(), free.wait(WAIT_S)))
    assert started.wait(WAIT_S)
    return free


def _queue_in_order(calls, pool: ThreadPoolExecutor, monkeypatch) -> list:
    """Submit `calls` from threads of `pool`, each once the one before has posted its step to the compute thread."""
    thread, posted = compute_thread(), threading.Semaphore(0)
    post = thread.post

    def counted(fn) -> None:
        post(fn)
        posted.release()
    monkeypatch.setattr(thread, "post", counted)
    futures = []
    for call in calls:
        futures.append(pool.submit(call))
        assert posted.acquire(timeout=WAIT_S)
    return futures


def test_queued_calls_run_in_turn_on_the_compute_thread_each_handing_on_before_the_next_starts(monkeypatch):
    lock, seen = StationLock(FakeStation(sequences=3), max_pending=4), []

    def call(name: str):
        def step() -> str:
            seen.append((f"{name} step", threading.current_thread().name))
            return name

        def then(result: str, kv) -> None:
            seen.append((f"{result} sent with {kv.sequences} sequences", threading.current_thread().name))
        return lambda: lock.queued(step, then, waits=True)
    free = _hold_compute_thread()
    with ThreadPoolExecutor(2) as pool:
        futures = _queue_in_order([call("a"), call("b")], pool, monkeypatch)
        assert seen == []
        free.set()
        results = [f.result(WAIT_S) for f in futures]
    assert [r for r, _ in results] == ["a", "b"] and all(kv.sequences == 3 for _, kv in results)
    assert [what for what, _ in seen] == ["a step", "a sent with 3 sequences", "b step", "b sent with 3 sequences"]
    assert {thread for _, thread in seen} == {"torch-compute"}


def test_a_station_stepping_on_the_callers_thread_takes_the_lock_there_and_hands_on_after_it():
    """A SIMULATED station sleeps its modelled step on the calling thread: no hop to the compute thread for it."""
    lock, seen = StationLock(FakeStation(sequences=2, steps_on_compute_thread=False), max_pending=4), []
    result, kv = lock.queued(lambda: seen.append(("step", threading.current_thread().name)) or "stepped",
                             lambda result, kv: seen.append((f"{result} sent", threading.current_thread().name)))
    here = threading.current_thread().name
    assert (result, kv.sequences) == ("stepped", 2) and seen == [("step", here), ("stepped sent", here)]
    assert lock.hold_within(WAIT_S, lambda: None)


def test_a_lock_held_on_another_thread_puts_a_queued_call_off_without_blocking_the_compute_thread():
    lock, order = StationLock(FakeStation(), max_pending=4), []
    held, let_go = threading.Event(), threading.Event()

    def holder() -> None:
        with lock.hold():
            held.set()
            assert let_go.wait(WAIT_S)
            order.append(on_compute_thread(lambda: "the holder's own compute call"))
    with ThreadPoolExecutor(2) as pool:
        holding = pool.submit(holder)
        assert held.wait(WAIT_S)
        queued = pool.submit(lock.queued, lambda: order.append("queued step") or "done",
                             lambda result, kv: order.append(f"queued {result}"), waits=True)
        for _ in range(int(WAIT_S / 0.001)):  # until the queued call has found the lock held and is put off
            if lock._put_off:
                break
            threading.Event().wait(0.001)
        assert len(lock._put_off) == 1 and order == []
        let_go.set()  # the holder's compute call runs though the queued call came first: the thread is not blocked
        holding.result(WAIT_S)
        assert queued.result(WAIT_S)[0] == "done"
    assert order == ["the holder's own compute call", "queued step", "queued done"]
    assert lock.hold_within(WAIT_S, lambda: None)  # let go after it


def test_a_release_queued_while_a_queued_call_holds_the_lock_applies_before_it_lets_go():
    station = FakeStation(sequences=5)
    lock, replies = StationLock(station, max_pending=4), []

    def step() -> str:  # a release sent while this step holds the lock is queued, not waited for
        with ThreadPoolExecutor(1) as pool:
            replies.append(pool.submit(lock.release, [7, 8], True).result(WAIT_S))
        return "stepped"
    result, kv = lock.queued(step, lambda result, kv: replies.append((result, kv.sequences)), waits=True)
    assert replies == [(0, None), ("stepped", 3)]
    assert result == "stepped" and kv.sequences == 3 and station.released == [7, 8]


@pytest.mark.parametrize("fails", ["step", "then"])
def test_what_a_queued_call_or_its_hand_on_raises_reaches_its_caller_and_the_lock_is_let_go(fails):
    lock = StationLock(FakeStation(), max_pending=4)

    def step() -> str:
        if fails == "step":
            raise ValueError("the step failed")
        return "stepped"

    def then(result, kv) -> None:
        raise OSError("the successor went away")
    with pytest.raises(ValueError if fails == "step" else OSError, match="step failed|went away"):
        lock.queued(step, then)
    assert lock.run(lambda: "the lock is free")[0] == "the lock is free"


def test_queued_calls_beyond_max_pending_are_refused_unless_they_wait(monkeypatch):
    lock = StationLock(FakeStation(), max_pending=1)
    free = _hold_compute_thread()
    try:
        with ThreadPoolExecutor(2) as pool:
            first = _queue_in_order([lambda: lock.queued(lambda: "first", lambda r, kv: None)], pool, monkeypatch)[0]
            with pytest.raises(StationBusy, match="station busy: 1 calls"):
                lock.queued(lambda: "refused", lambda r, kv: None)
            waiting = pool.submit(lock.queued, lambda: "waited", lambda r, kv: None, waits=True)
            free.set()
            assert first.result(WAIT_S)[0] == "first" and waiting.result(WAIT_S)[0] == "waited"
    finally:
        free.set()
