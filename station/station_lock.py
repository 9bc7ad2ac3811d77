"""One call at a time on a station's KV, and releases that need not wait for it.

A station's KV is not thread-safe: a step, a KV export or import and a release each hold one lock. A release that
finds the lock held by a call (a step under way) may be queued instead of waiting (`release(..., queue_if_busy=True)`):
the call holding the lock applies every queued release before it lets go, so any call that takes the lock later finds
that KV freed, exactly as if the release had waited its turn, and the sender goes on at once. The orchestrator's
releases are sent so: a sequence that ends no longer holds up the next wave's dispatch while each station finishes the
step under way (on a direct chain the one dispatcher sends every station's release before the next wave).

The hand-over is race-free: a release queues only while holding the queue's own lock and seeing the station lock
held, and a holder lets go of the station lock only while holding the queue's lock and seeing the queue empty.

A call may also take the lock in its turn on the compute thread (`queued`: a relay chain's decode steps). A call that
takes it on its own thread then hands it on through three threads' wake-ups (the compute thread's result to the
caller, the caller's let-go to the next caller, that caller's step to the compute thread) while the station's core
sits idle; and the step's rows or samples go on only once the caller has the core again, behind the next step (on a
1-core station). A queued call is already waiting in the compute thread's queue when the step before ends, and sends
its output from there (`then`) before the next step starts. It never blocks the compute thread: where another thread
holds the lock (whose own work waits in that queue), it is put off and posted again when that thread lets go.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import TypeVar

from mesh.core.compute import compute_thread
from mesh.core.proto import station_pb2 as pb
from station.step import Station

log = logging.getLogger(__name__)
_R = TypeVar("_R")


class StationBusy(RuntimeError):
    """Too many calls already hold or wait for the station."""


def kv_usage_proto(station: Station) -> pb.KVUsage:
    """The station's KV occupancy as sent with every Forward and Release reply (read under the station lock)."""
    kv = station.kv_usage()
    return pb.KVUsage(bytes_used=kv.bytes_used, blocks_used=kv.blocks_used, sequences=kv.sequences,
                      changes=kv.changes)


class StationLock:
    """The station lock, the releases queued while it is held, and the bound on calls waiting for it."""

    def __init__(self, station: Station, max_pending: int) -> None:
        """At most `max_pending` calls hold or wait for the lock at once (`run` refuses more with StationBusy)."""
        self._station = station
        self._max_pending = max_pending
        self._pending = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queued: list[int] = []  # seq ids released while a call held the lock, applied before it lets go
        self._put_off: list[Callable[[], None]] = []  # queued calls that found the lock held, posted at its let-go
        self.queued_releases = 0  # releases queued so far (not waited for)

    def run(self, fn: Callable[[], _R], *, waits: bool = False) -> tuple[_R, pb.KVUsage]:
        """fn() holding the lock, and the KV occupancy after it and after any release queued meanwhile;
        StationBusy when `max_pending` calls already hold or wait for it. `waits`: wait for the lock however many
        calls wait, and count in none of them (a relay link's call: their number is bounded by the link's
        connections, each served on a thread of its own, where the bound keeps gRPC workers free)."""
        if not waits and not self._pending.acquire(blocking=False):
            raise StationBusy(f"station busy: {self._max_pending} calls already hold or wait for it")
        try:
            self._lock.acquire()
            return self._under_lock(fn)
        finally:
            if not waits:
                self._pending.release()

    def queued(self, fn: Callable[[], _R], then: Callable[[_R, pb.KVUsage], object], *, waits: bool = False
               ) -> tuple[_R, pb.KVUsage]:
        """fn() holding the lock, taken in its turn on the compute thread (module docstring), then `then(result, kv)`
        there at once, before the compute thread's next call; fn's result and the KV occupancy after it, as `run`
        (what fn or `then` raises is raised here). StationBusy and `waits` as `run`. A station whose steps do not
        run on the compute thread (`steps_on_compute_thread` False: a SIMULATED one) takes the lock as `run` does,
        `then` after it on the caller's thread."""
        if not self._station.steps_on_compute_thread:
            result, kv = self.run(fn, waits=waits)
            then(result, kv)
            return result, kv
        if not waits and not self._pending.acquire(blocking=False):
            raise StationBusy(f"station busy: {self._max_pending} calls already hold or wait for it")
        try:
            done: Future = Future()
            compute_thread().post(lambda: self._in_turn(fn, then, done))
            return done.result()
        finally:
            if not waits:
                self._pending.release()

    def _in_turn(self, fn: Callable[[], _R], then: Callable[[_R, pb.KVUsage], object], done: Future) -> None:
        """A queued call on the compute thread: the lock, fn(), the let-go, then(); put off where it is held."""
        with self._queue_lock:
            if not self._lock.acquire(blocking=False):
                self._put_off.append(lambda: self._in_turn(fn, then, done))
                return
        try:
            result, kv = self._under_lock(fn)
            then(result, kv)
        except BaseException as err:  # noqa: BLE001 - handed to the caller, which re-raises it
            done.set_exception(err)
            return
        done.set_result((result, kv))

    def release(self, seq_ids: Sequence[int], queue_if_busy: bool) -> tuple[int, pb.KVUsage | None]:
        """Free these sequences' KV: how many were resident and the KV occupancy after; with `queue_if_busy`, where
        a call holds the lock, the release is queued for that call to apply before it lets go: (0, None)."""
        def free() -> int:
            return self._station.release(list(seq_ids))
        if not queue_if_busy:
            return self.run(free)
        with self._queue_lock:
            if not self._lock.acquire(blocking=False):
                self._queued.extend(seq_ids)
                self.queued_releases += 1
                return 0, None
        return self._under_lock(free)

    def hold_within(self, timeout: float, fn: Callable[[], object]) -> bool:
        """fn() holding the lock, waiting at most `timeout` s for it: False where it stayed held (fn's errors
        propagate)."""
        if not self._lock.acquire(timeout=timeout):
            return False
        self._under_lock(fn)
        return True

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the lock for the block, waiting for it (what a call does; releases queued meanwhile are applied
        before it is let go)."""
        self._lock.acquire()
        try:
            yield
        finally:
            self._let_go()

    def _under_lock(self, fn: Callable[[], _R]) -> tuple[_R, pb.KVUsage]:
        """fn() with the lock held (acquired by the caller), then the lock let go: its result and the KV after."""
        try:
            result = fn()
        except BaseException:
            self._let_go()
            raise
        return result, self._let_go()

    def _let_go(self) -> pb.KVUsage:
        """Apply every queued release, then let go of the lock (and post the calls put off meanwhile); the KV
        occupancy at that moment (a few counters)."""
        while True:
            with self._queue_lock:
                if not self._queued:
                    try:
                        return kv_usage_proto(self._station)
                    finally:  # under the queue lock: a release or a queued call that saw the lock held is in by now
                        self._lock.release()
                        put_off, self._put_off = self._put_off, []
                        for call in put_off:
                            compute_thread().post(call)
                seq_ids, self._queued = self._queued, []
            try:
                self._station.release(seq_ids)
            except Exception:  # noqa: BLE001 - its sender has gone on; the KV stays held, the station serves on
                log.exception("queued release of %d sequence(s) failed", len(seq_ids))
