"""Direct transfer of hidden rows (`scheduler.hidden_path: direct`): one call per wave into the first station.

The first station runs its layers and sends its rows straight to the next station, and so on; the last
station's samples come back along the same call (station/relay.py says why a nested call and not a push).
The orchestrator still plans every wave, owns its deadline (the call's, which every station hands on)
and sees every failure: a station anywhere in the chain that is dead, hung or unreachable fails the call
with StationDown, exactly as a dead station does on the hub path, so recovery and replay are unchanged.

Ordering is the hub pipeline's: one dispatcher thread works through an inbox of the same typed messages.
A wave is handed to a call thread and the dispatcher goes on (up to the engine's waves in flight run at
once); a release is applied at every station before any later message, so a wave sent after a release
(a preempted sequence's re-prefill, say) never meets the KV it released. The scheduler never releases a
sequence that is in flight, so a release may run beside the waves already travelling.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait

from orchestrator.pipeline import (
    Barrier,
    InboxMessage,
    Pipeline,
    Release,
    RunWave,
    StationDown,
    StationLink,
    Stop,
    WaveDone,
    release_at,
    streams_steps,
)
from orchestrator.scheduler_types import WavePlan
from orchestrator.streamed_steps import EarlyEnds, deliver_parts

log = logging.getLogger(__name__)
HOP_SAMPLES = 4096  # transfer costs kept per station, for benchmarks and status


def can_relay(links: list[StationLink]) -> bool:
    """True when every station of the chain can take part in direct transfer (gRPC stations)."""
    return len(links) > 1 and all(callable(getattr(link, "relay", None)) for link in links)


def make_pipeline(links: list[StationLink], on_done: WaveDone, hidden_path: str = "direct"):
    """The pipeline `hidden_path` asks for: direct transfer where every station can relay, else the hub."""
    if hidden_path == "direct" and can_relay(links):
        return RelayPipeline(links, on_done)
    return Pipeline(links, on_done)


class RelayPipeline:
    """A chain of gRPC stations whose hidden rows go station to station; same interface as Pipeline."""

    hidden_path = "direct"

    def __init__(self, links: list[StationLink], on_done: WaveDone, max_calls: int | None = None) -> None:
        """`max_calls`: wave calls running at once (default: twice the stations, above what the engine sends)."""
        if not can_relay(links):
            raise ValueError("direct transfer needs at least two stations that can relay (gRPC links)")
        self.links = links
        self.on_done = on_done
        self.busy_seconds = [0.0] * len(links)  # per station: its steps' seconds, as the relayed reports tell
        self.failed_releases = [0] * len(links)
        # per station, its newest calls' transfer cost per decode step: the caller's wall time minus the callee's
        # own time, over the call's steps (a several-step call sums each relayed step's)
        self.hop_seconds: list[deque[float]] = [deque(maxlen=HOP_SAMPLES) for _ in links]
        # per station, its newest calls' own turn per decode step: its time in the call less its step and its
        # successor's call (the request's decode, the lock, the encoding and sending of rows and replies)
        self.turn_seconds: list[deque[float]] = [deque(maxlen=HOP_SAMPLES) for _ in links]
        self._ends = EarlyEnds()
        self._calls = ThreadPoolExecutor(max_workers=max_calls or 2 * len(links) + 2, thread_name_prefix="relay")
        self._running: set[Future] = set()
        self._running_lock = threading.Lock()
        self._inbox: queue.Queue[InboxMessage] = queue.Queue()
        self._thread = threading.Thread(target=self._dispatch, name="relay-dispatch", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """How many waves can usefully be in flight (one per station)."""
        return len(self.links)

    def runs_decode_steps(self, depth: int) -> bool:
        """Several decode steps per wave call, at any depth: the first station runs each step, relays it and
        feeds the samples back, taking its lock per step, so the other waves in flight interleave."""
        return True

    def submit(self, plan: WavePlan) -> None:
        """Send a WavePlan into the chain."""
        self._inbox.put(RunWave(plan))

    def end_steps(self, plan: WavePlan) -> None:
        """End a streamed several-step wave early, after its step under way (orchestrator.streamed_steps)."""
        if streams_steps(self.links[0], plan):
            self._ends.ask(self.links[0], plan.wave_id)

    def release(self, seq_ids: tuple[int, ...]) -> None:
        """Free these sequences at every station, before any wave submitted after this call."""
        if seq_ids:
            self._inbox.put(Release(tuple(seq_ids)))

    def barrier(self, timeout: float = 30.0) -> bool:
        """Wait until every wave and release queued now has been worked through; False on timeout."""
        done = threading.Event()
        self._inbox.put(Barrier(done))
        return done.wait(timeout)

    def close(self) -> None:
        """Stop after what is queued (waves in flight finish or fail by their deadline)."""
        self._inbox.put(Stop())
        self._thread.join(timeout=60)
        self._calls.shutdown(wait=False)

    def _dispatch(self) -> None:
        while True:
            match self._inbox.get():
                case Stop():
                    self._wait_calls()
                    return
                case Barrier(done=done):
                    self._wait_calls()
                    done.set()
                case Release(seq_ids=seq_ids):
                    for i in range(len(self.links)):
                        release_at(self.links[i], seq_ids, i, self.failed_releases)
                case RunWave(plan=plan):
                    future = self._calls.submit(self._run_wave, plan)
                    with self._running_lock:
                        self._running.add(future)
                    future.add_done_callback(self._call_ended)
                case other:
                    log.error("relay: unexpected inbox message %s ignored", type(other).__name__)

    def _call_ended(self, future: Future) -> None:
        with self._running_lock:
            self._running.discard(future)

    def _wait_calls(self) -> None:
        """Wait for every wave call started so far (each ends by its deadline at the latest)."""
        with self._running_lock:
            running = list(self._running)
        wait(running)

    def _run_wave(self, plan: WavePlan) -> None:
        t0 = time.perf_counter()
        try:
            if streams_steps(self.links[0], plan):  # its samples come back in parts as they are drawn
                deliver_parts(plan, self._parts(plan, t0), self.on_done, self._ends, self.links[0].address)
                return
            reply = self.links[0].relay(plan.wave_id, plan.entries, list(plan.token_ids), self.links[1:],
                                        steps=plan.steps)
            if reply.output.samples is None:
                raise StationDown(f"station {self.links[-1].address}: a relayed wave came back without samples")
        except BaseException as e:  # noqa: BLE001 - reported to the engine, which ends or replays the wave
            self.on_done(plan, None, e)
            return
        self._note(reply, t0, plan.steps)
        self.on_done(plan, reply.output.samples, None)

    def _parts(self, plan: WavePlan, t0: float) -> Iterator[list]:
        """The samples of each part of a streamed wave's call, as they come, their transfer costs kept."""
        for reply in self.links[0].relay_steps(plan.wave_id, plan.entries, list(plan.token_ids), plan.steps,
                                               plan.reply_steps, self.links[1:]):
            t0 = self._note(reply, t0, len(reply.output.samples) // len(plan.entries))
            yield reply.output.samples

    def _note(self, reply, t0: float, steps: int) -> float:
        """Keep the transfer costs and busy times a reply of `steps` steps reports, its call (or part of a
        streamed call) begun at `t0`; returns when it came."""
        now = time.perf_counter()
        self.hop_seconds[0].append((now - t0 - reply.served_seconds) / steps)
        self.busy_seconds[0] += reply.output.seconds
        served = [(reply.served_seconds, reply.output.seconds)] + [(h.served_seconds, h.forward_seconds)
                                                                   for h in reply.hops]
        onward = [h.call_seconds for h in reply.hops] + [0.0]
        for i, ((own, step), call) in enumerate(zip(served, onward)):
            self.turn_seconds[i].append(max(0.0, own - step - call) / steps)
        for i, hop in enumerate(reply.hops, start=1):
            self.busy_seconds[i] += hop.forward_seconds
            self.hop_seconds[i].append((hop.call_seconds - hop.served_seconds) / steps)
        return now
