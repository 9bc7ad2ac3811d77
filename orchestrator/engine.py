"""The engine: scheduler + pipeline + streaming, the object the API calls.

One wave-loop thread owns the scheduler's plan/commit cycle; submit() and
cancel() take the same lock from any thread, so admission errors are raised to
the caller at once. The loop keeps up to `pipeline.depth` (one per station)
plus `scheduler.extra_waves` waves in flight, splitting running sequences into
groups so each station works on a different wave. Every route decision (admit?
plan? switch, recover, drain, close) is the RouteMachine's (orchestrator/route.py);
it shares the engine's condition, on which the idle waits wait. A several-step wave may
come back in parts (`scheduler.reply_steps`): each is committed and streamed as it comes,
the wave staying in flight until its last; a request waiting for a lane, or a route about
to change, ends such waves early (orchestrator.streamed_steps).
"""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import replace
from typing import Callable

from mesh.core.config import ModelConfig, SchedulerConfig
from mesh.core.params import SamplingParams
from orchestrator.pipeline import StationLink
from orchestrator.relay import make_pipeline
from orchestrator.route import RouteMachine, route_limits
from orchestrator.route_recovery import RouteRecovery
from orchestrator.route_switch import CatchUpFailed, RouteSwitching
from orchestrator.scheduler_types import EngineStats
from orchestrator.scheduler import AdmissionError, Scheduler, WavePlan
from orchestrator.scheduler_counts import TokenRates
from orchestrator.switch_pause import SwitchPauses
from orchestrator.request_table import RequestTable
from orchestrator.stream import CompletionOutput, RequestStream, TextTracker
from orchestrator.streamed_steps import StreamedWaves

__all__ = ["AdmissionError", "CatchUpFailed", "Engine", "EngineStats"]
log = logging.getLogger(__name__)
_WAKE, _STOP = object(), object()


class Engine(RouteSwitching, RouteRecovery):
    """Continuous batching over a chain of stations."""

    _wake = _WAKE  # what a route switch or recovery puts in the wave loop's inbox to wake it

    def __init__(self, links: list[StationLink], model: ModelConfig, config: SchedulerConfig,
                 tokenizer=None, rate_window_s: float = 10.0,
                 on_wave: Callable[[int, float, float], None] | None = None,
                 recover: Callable[[list[StationLink]], list[StationLink]] | None = None,
                 recover_retry_s: float = 2.0) -> None:
        """`on_wave(rows, occupancy, seconds)` is called after each committed wave (metrics hook).
        `recover(links) -> links` brings a route whose station went down back (restarting it); without
        it a station failure ends the requests of the failed wave."""
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.scheduler = Scheduler(config, route_limits(links, model.max_position_embeddings), model.eos_token_ids)
        self.pipeline = make_pipeline(links, self._on_wave_done, config.hidden_path)  # replaced by _swap: read under the lock
        self._lock = threading.Condition(threading.RLock())  # the route machine takes it inside our holds
        self.route = RouteMachine(self._lock)
        self._inbox: queue.Queue = queue.Queue()
        self.requests = RequestTable()  # the live requests' streams and their sequences' owners
        self._in_flight = 0
        self._rates = TokenRates(rate_window_s)  # prefill and decode tokens per second, over the window
        self.on_wave = on_wave
        self._recover, self._recover_retry_s = recover, recover_retry_s
        self.recovery_seconds: list[float] = []  # how long each recovery took
        self.switch_pauses = SwitchPauses()  # how long each route switch held the live streams
        self.switch_reports: list = []  # one SwitchReport per finished route switch
        self.catchup_tokens = 0  # tokens whose KV catch-ups copied or recomputed on new routes
        self.replayed_sequences = 0  # sequences a route switch moved by re-prefill (pause switches, no room)
        self._switch_lock = threading.Lock()  # one route switch at a time
        self._catchup = None  # the CatchUp of a make-before-break switch under way
        self._catchup_pipeline = None  # its new route
        self._catchup_copier = None  # its KVCopier (None: catch-up waves recompute the KV)
        self._catchup_waves: set[int] = set()  # wave ids of catch-up waves in flight (their replies skip the scheduler)
        self._sent: dict[int, float] = {}  # wave id -> when it entered the pipeline
        self._streamed = StreamedWaves()  # streamed several-step waves in flight, not asked to end early
        self._wave_seconds: deque = deque(maxlen=16)  # one-step decode-only waves since the last several-step one
        self._thread = threading.Thread(target=self._run, name="wave-loop", daemon=True)
        self._thread.start()

    # ---- caller side -------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, n: int = 1,
               request_id: str | None = None, probe: bool = False) -> RequestStream:
        """Queue a request of `n` choices; raises AdmissionError (400 never fits / 503 queue full).
        A `probe` (the health check's proof) goes first and takes no user's lane or queue place."""
        request_id = request_id or uuid.uuid4().hex
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        stream = RequestStream(request_id, n, loop)
        with self._lock:
            self.route.check_admission()  # 503 shutting_down / route_down
            if request_id in self.requests:
                raise AdmissionError("invalid", 400, f"request_id {request_id!r} is already running", "request_id")
            self.requests.open(request_id, stream, [TextTracker(self.tokenizer, params.stop) for _ in range(n)])
            try:
                for i in range(n):
                    choice = params if n == 1 else replace(params, seed=(params.seed + i) % 2**63)
                    self.scheduler.add(self.requests.new_sequence(request_id, i), request_id, tuple(prompt_ids),
                                       choice, probe)
            except AdmissionError:
                self._release(self.scheduler.cancel(request_id))
                self.requests.drop(request_id)
                raise
        self._inbox.put(_WAKE)
        return stream

    def generate(self, prompt_ids: list[int], params: SamplingParams, n: int = 1,
                 timeout: float | None = None) -> list[CompletionOutput]:
        """Submit and wait: the blocking variant (do not call from inside an event loop)."""
        return self.submit(prompt_ids, params, n).result(timeout)

    def cancel(self, request_id: str) -> bool:
        """Cancel a request in any state; its KV is freed within a wave. False if it is not live."""
        with self._lock:
            if request_id not in self.requests:
                return False
            self._release(self.scheduler.cancel(request_id))
            self.requests.cancel(request_id)
            self._streamed.end(self.pipeline, self.requests.owns)  # the streamed calls computing its rows end
            self._lock.notify_all()
        self._inbox.put(_WAKE)
        return True

    def max_context(self) -> int:
        """The most tokens (prompt + output) one sequence can reach on the current route: the model's context, or
        fewer where the route's smallest KV pool holds fewer (it changes as `mesh scale` changes the route)."""
        return self.scheduler.limits.sequence_tokens

    def stats(self) -> EngineStats:
        """A consistent snapshot of counters, rates and KV occupancy."""
        with self._lock:
            s = self.scheduler.stats()
            in_flight = self._in_flight
            now = time.monotonic()
            prefill_rate, decode_rate = self._rates.rates(now, s.prefill_tokens, s.decode_tokens)
            links, route_error, recovery = self.pipeline.links, self.route.error, tuple(self.recovery_seconds)
            switches, pauses = self.switch_pauses.switches, tuple(self.switch_pauses.pauses)
            catchup = self._catchup.progress(self.scheduler.running(), now) if self._catchup is not None else None
            catchup_tokens, replayed = self.catchup_tokens, self.replayed_sequences
            ended_early = self._streamed.ended_early
        kv = [link.kv() for link in links]
        return EngineStats(
            running=s.running, waiting=s.waiting, waves_in_flight=in_flight, waves=s.waves,
            wave_occupancy_last=s.last_wave_tokens / self.config.max_wave_tokens,
            wave_occupancy_mean=s.mean_wave_occupancy, wave_occupancy_max=s.max_wave_occupancy,
            prefill_tokens=s.prefill_tokens, decode_tokens=s.decode_tokens,
            prefill_tokens_per_s=prefill_rate, decode_tokens_per_s=decode_rate,
            kv_bytes_used=sum(k.bytes_used for k in kv), kv_bytes_total=sum(k.bytes_total for k in kv),
            preemptions=s.preemptions, refusals=dict(s.refusals), finished=dict(s.finished),
            prefix_cache=s.prefix_cache, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, kv_blocks_cached=s.kv_blocks_cached,
            kv_bytes_cached=s.kv_blocks_cached * sum(k.bytes_total // k.blocks_total for k in kv),
            recovery_seconds=recovery, route_switches=switches, route_switch_pauses=pauses, route_error=route_error,
            route_catchup=catchup, route_catchup_tokens=catchup_tokens, route_replayed_sequences=replayed,
            waves_ended_early=ended_early)

    def _wait_idle(self, timeout: float | None) -> bool:
        """Wait until no wave is in flight (None: no limit); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._in_flight == 0, timeout)

    def stop_admitting(self) -> None:
        """Drain: refuse new requests (503) from now on; those already admitted run to their end."""
        self.route.drain()

    def idle(self) -> bool:
        """True when no request is live (queued or running)."""
        with self._lock:
            return not self.requests

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is live (queued or running); False if some still are after `timeout` s."""
        with self._lock:
            return self._lock.wait_for(lambda: not self.requests, timeout)

    def quiesce(self, timeout: float = 30.0) -> bool:
        """Wait until no wave is in flight and every queued release has reached the stations."""
        deadline = time.monotonic() + timeout
        if not self._wait_idle(timeout):
            return False
        with self._lock:
            pipeline = self.pipeline
        return pipeline.barrier(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop the wave loop and the station workers; live requests end as cancelled."""
        with self._lock:
            self.route.close()
            request_ids = self.requests.request_ids()
        for request_id in request_ids:
            self.cancel(request_id)
        self._inbox.put(_STOP)
        self._thread.join(timeout=30)
        with self._lock:
            pipeline = self.pipeline
        pipeline.close()

    # ---- wave loop ---------------------------------------------------------------------------
    def _on_wave_done(self, plan: WavePlan, samples, error: BaseException | None, first_step: int = 0) -> None:
        """A wave's samples (from step `first_step` on: a several-step wave's may come back in parts) or failure."""
        self._inbox.put((plan, samples, error, first_step))

    def _run(self) -> None:
        try:
            while (item := self._inbox.get()) is not _STOP:
                with self._lock:
                    if item is not _WAKE and item[0].wave_id in self._catchup_waves:
                        self._catchup_wave_done(item[0], item[2])
                        self._lock.notify_all()  # the route switch waits on the catch-up's progress
                    elif item is not _WAKE:
                        self._finish_wave(*item)
                        self._lock.notify_all()  # idle waits: a wave came back, requests may have ended
                    self._fill()
                    self._fill_catchup()
        except Exception as e:  # a fault of the loop itself: no request may wait on a loop that is gone
            log.exception("the wave loop failed; every live request ends with its error, new ones are refused")
            with self._lock:
                self.route.close()
                self.requests.end_all(f"the engine's wave loop failed: {type(e).__name__}: {e}")
                self._lock.notify_all()

    def _fill(self) -> None:
        depth = self.pipeline.depth + self.config.extra_waves
        # several decode steps per call (by route: SchedulerConfig.call_steps) where the pipeline runs them, no
        # route switch under way
        steps, reply_steps = self.config.call_steps(self.pipeline.depth)
        if self._catchup is not None or not self.pipeline.runs_decode_steps(depth):
            steps = 1
        while self._in_flight < depth and not self.route.paused:
            cap = None
            if depth > 1:
                cap = max(1, math.ceil(min(self.scheduler.live(), self.config.max_seqs) / depth))
            plan = self.scheduler.plan(max_entries=cap, max_steps=steps, reply_steps=reply_steps)
            self._release(self.scheduler.take_releases())
            if plan is None:
                break
            self._in_flight += 1
            now = time.monotonic()
            self._sent[plan.wave_id] = now
            for seq_id, cached in plan.admitted:
                self.requests.scheduled(seq_id, cached, now)
            self.pipeline.submit(plan)
            if 0 < plan.reply_steps < plan.steps:
                self._streamed.add(plan)
        if self._streamed and (self.scheduler.admissible() or self.route.paused or self.route.closed
                               or self._catchup is not None):
            self._streamed.end(self.pipeline)  # a request waits for a lane, the route is to change or close

    def _leave_flight(self, plan: WavePlan) -> float | None:
        """A wave landed or failed: one wave fewer in flight; returns when it was sent."""
        self._in_flight -= 1
        self._streamed.discard(plan.wave_id)
        return self._sent.pop(plan.wave_id, None)

    def _finish_wave(self, plan: WavePlan, samples, error: BaseException | None, first_step: int = 0) -> None:
        """Commit a wave's samples (a part before its last step leaves it in flight), or end or replay it."""
        if error is not None:
            self._wave_failed(plan, error)
            return
        result = self.scheduler.commit(plan, samples, first_step)
        self._release(result.released)
        now = time.monotonic()
        sent = self._leave_flight(plan) if result.landed_steps else None
        if sent is not None:
            self._pace_wave(plan, now - sent, result.landed_steps)
        if self.on_wave is not None and sent is not None:
            rows = len(plan.token_ids)
            self.on_wave(rows, rows / self.config.max_wave_tokens, now - sent)
        self._rates.mark(now, *self.scheduler.token_counts())
        ended = False
        for ev in result.events:
            self.switch_pauses.token(ev.seq_id, now)
            if self._catchup is not None:
                self._catchup.old_commit(ev.seq_id)
            if (reason := self.requests.push_token(ev)) is not None:
                if ev.finish_reason is None:
                    self._release(self.scheduler.finish(ev.seq_id, reason))
                self._forget(ev.seq_id)
                ended = ended or ev.finish_reason != "length"  # a length end was planned (WaveBuilder.decode_steps)
        if ended and self._streamed:  # a sequence stopped inside a streamed call: the stations stop computing its row
            self._streamed.end(self.pipeline, self.requests.owns)

    def _end(self, seq_id: int, reason: str, error: str | None = None) -> None:
        if not self.requests.owns(seq_id):
            return
        self._release(self.scheduler.finish(seq_id, reason))
        self.requests.end(seq_id, reason, error)
        self._forget(seq_id)

    def _forget(self, seq_id: int) -> None:
        self.switch_pauses.forget(seq_id)
        if self.requests.forget(seq_id):  # the request's last open sequence: it is gone
            self._lock.notify_all()

    def _release(self, seq_ids) -> None:
        if seq_ids:
            self.pipeline.release(tuple(seq_ids))
            self._catchup_forget(seq_ids)
