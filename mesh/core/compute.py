"""One thread per process for multi-threaded torch work.

torch's CPU kernels run on OpenMP (libgomp) thread teams, one team per calling
thread. Once more team threads are alive than there are CPUs, libgomp stops
spinning between parallel regions, and every one of the hundreds of regions in a
step pays a sleeping thread's wake-up. Measured on the bench preset (2 cores): a
batch-1 decode step took 19 ms from a second thread against 10.5 ms from the
thread that loaded the model; in the engine, where a worker thread calls the
station, that was 51 tok/s at one request instead of 75. So every Station of a
process loads, steps, probes and releases on this one thread, whichever thread
asks (a pipeline worker, a gRPC handler, the health probe); code that must be
compared with a station on equal terms (the Hugging Face baselines) runs here too.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from mesh.core.allocator import keep_large_blocks

_T = TypeVar("_T")
log = logging.getLogger(__name__)


class ComputeThread:
    """A daemon thread that runs submitted calls one at a time, in order."""

    def __init__(self, name: str = "torch-compute") -> None:
        keep_large_blocks()  # a step's large temporaries reuse freed memory instead of faulting in new pages
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """fn(*args, **kwargs) on the compute thread (directly when already on it); its result or exception."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        done: Future = Future()
        self._inbox.put((done, fn, args, kwargs))
        return done.result()

    def post(self, fn: Callable[[], object]) -> None:
        """fn() on the compute thread after the calls already submitted, not waited for (from any thread, the
        compute thread included: it runs after the call under way); fn hands on its own outcome (what it raises is
        logged)."""
        self._inbox.put((None, fn, (), {}))

    def _loop(self) -> None:
        while True:
            done, fn, args, kwargs = self._inbox.get()
            if done is None:
                try:
                    fn()
                except BaseException:  # noqa: BLE001 - a posted call reports its own outcome; this is a bug
                    log.exception("a call posted to the compute thread raised")
                continue
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as err:  # noqa: BLE001 - handed to the caller, which re-raises it
                done.set_exception(err)


_shared: ComputeThread | None = None
_shared_lock = threading.Lock()


def compute_thread() -> ComputeThread:
    """This process's compute thread (started on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ComputeThread()
        return _shared


def on_compute_thread(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """Run fn(*args, **kwargs) on this process's compute thread."""
    return compute_thread().run(fn, *args, **kwargs)
