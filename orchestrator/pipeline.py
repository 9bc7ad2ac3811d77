"""Drives waves through the chain of stations, several waves in flight.

Each station has a worker thread and an inbox of typed messages (RunWave, Release,
Barrier, Stop). A wave enters station 0's inbox, and each worker hands its output
(hidden rows) to the next station's inbox, so with P stations up to P waves are
computed at once, one per station. Releases go into every inbox in order, so a
release queued before a wave is applied before that wave at every station; a
release a station fails is counted (`failed_releases`) and logged, and the worker
goes on. The last station's samples (or any failure) go to the `on_done` callback.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable

import torch

from mesh.core.wave import StationOutput
from orchestrator.scheduler_types import WavePlan
from orchestrator.station_link import (LinkKV, StationDown, StationLink, runs_steps,  # noqa: F401 (re-exported)
                                       streams_steps)
from orchestrator.streamed_steps import EarlyEnds, deliver_parts
from station.step_replies import RunningSteps, step_chunks

log = logging.getLogger(__name__)


class LocalLink:
    """A Station object in this process."""

    address = "in-process"

    def __init__(self, station) -> None:
        self.station = station
        self._closed = False
        self._running = RunningSteps()  # its forward_steps calls, which end_steps can end early

    def forward(self, wave_id, entries, token_ids, hidden, steps: int = 1) -> StationOutput:
        """Run the wave (`steps` decode steps) on the in-process station."""
        ids = torch.tensor(token_ids, dtype=torch.long) if token_ids is not None else None  # [T]
        return self.station.forward(entries, token_ids=ids, hidden=hidden, steps=steps)

    def forward_steps(self, wave_id, entries, token_ids, steps: int, reply_steps: int) -> Iterator[StationOutput]:
        """`steps` decode steps on the in-process station, one output per `reply_steps` of them as they are drawn
        (what a station's ForwardSteps streams)."""
        ids = torch.tensor(token_ids, dtype=torch.long)  # [K]
        chunks = self._running.run(wave_id, lambda ended: step_chunks(
            lambda e, t, n: (self.station.forward(e, token_ids=t, steps=n), None), entries, ids, steps, reply_steps,
            self.station.kv.block_tokens, ended))
        for out, _ in chunks:
            yield out

    def end_steps(self, wave_id: int) -> bool:
        """End the wave's `forward_steps` after its part under way; False when it is not running."""
        return self._running.end(wave_id)

    def release(self, seq_ids) -> None:
        """Free KV on the in-process station."""
        self.station.release(list(seq_ids))

    def kv(self) -> LinkKV:
        """The station's KV pool figures."""
        s = self.station.kv.stats()
        return LinkKV(s.blocks_total, s.block_tokens, s.bytes_used, s.bytes_total,
                      self.station.prefill_chunk_invariant, self.station.spec.dtype)

    @property
    def copies_kv(self) -> bool:
        """The station can export and import KV (a route switch's copy)."""
        return callable(getattr(self.station, "export_kv", None))

    def layer_range(self) -> tuple[int, int]:
        """The station's layers."""
        return tuple(self.station.spec.layers)

    def export_kv(self, entries, layer_start, layer_end) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy KV out of the in-process station."""
        return self.station.export_kv(entries, layer_start, layer_end)

    def import_kv(self, entries, k, v) -> None:
        """Store copied KV in the in-process station."""
        self.station.import_kv(entries, k, v)

    def health(self) -> bool:
        """An in-process station serves as long as this process does, until the link is closed."""
        return not self._closed

    def describe(self) -> dict:
        """Layer range, device, dtype, health and KV use, for status pages."""
        spec, kv = self.station.spec, self.station.kv.stats()
        return {"layers": list(spec.layers), "device": spec.device, "dtype": spec.dtype, "address": self.address,
                "healthy": self.health(), "kv_bytes_used": kv.bytes_used, "kv_bytes_total": kv.bytes_total,
                "sequences": kv.sequences}

    def close(self) -> None:
        """Mark the link closed (the Station object itself belongs to whoever built it)."""
        self._closed = True


# ---- the workers' inbox messages -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RunWave:
    """Run `plan` at this station; `hidden` [T, d] is the previous station's output (None at station 0)."""

    plan: WavePlan
    hidden: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Release:
    """Free these sequences' KV at this station."""

    seq_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Barrier:
    """Set `done` once everything queued before it at this station has been worked through."""

    done: threading.Event


@dataclass(frozen=True, slots=True)
class Stop:
    """End the worker (after what is queued before it)."""


InboxMessage = RunWave | Release | Barrier | Stop
# (plan, samples, error[, first_step]): a wave's samples from step `first_step` on (several-step waves may stream
# theirs back in parts, the last part landing the wave), or its failure
WaveDone = Callable[..., None]


def release_at(link: StationLink, seq_ids: tuple[int, ...], i: int, failed: list[int]) -> None:
    """Free these sequences at station `i`; a failure is counted in failed[i] and logged, never raised (the
    station may keep that KV)."""
    try:
        link.release(seq_ids)
    except Exception as e:  # noqa: BLE001 - the caller goes on
        failed[i] += 1
        log.warning("station %d (%s): release of %d sequence(s) failed: %s: %s", i, link.address,
                    len(seq_ids), type(e).__name__, e)


class Pipeline:
    """A chain of station links with one worker thread each (the hub path: every station's rows come back
    here and go out to the next; `scheduler.hidden_path: hub`, and in-process stations)."""

    hidden_path = "hub"

    def __init__(self, links: list[StationLink], on_done: WaveDone) -> None:
        if not links:
            raise ValueError("a pipeline needs at least one station")
        self.links = links
        self.on_done = on_done
        self._inboxes: list[queue.Queue[InboxMessage]] = [queue.Queue() for _ in links]
        self.busy_seconds = [0.0] * len(links)
        self.failed_releases = [0] * len(links)  # per station: releases that raised (the KV may linger there)
        self._ends = EarlyEnds()
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"station-{i}", daemon=True)
                         for i in range(len(links))]
        for t in self._threads:
            t.start()

    @property
    def depth(self) -> int:
        """How many waves can usefully be in flight (one per station)."""
        return len(self.links)

    def runs_decode_steps(self, depth: int) -> bool:
        """Several decode steps per wave call: only one wave at a time (`depth` 1) on a lone station whose link
        runs them (it holds the station for every step)."""
        return depth == 1 and runs_steps(self.links[0])  # depth counts a wave per link: 1 means a lone station

    def submit(self, plan: WavePlan) -> None:
        """Send a WavePlan (entries + token ids) into station 0."""
        self._inboxes[0].put(RunWave(plan))

    def end_steps(self, plan: WavePlan) -> None:
        """End a streamed several-step wave early, after its step under way (orchestrator.streamed_steps)."""
        if len(self.links) == 1 and streams_steps(self.links[0], plan):
            self._ends.ask(self.links[0], plan.wave_id)

    def release(self, seq_ids: tuple[int, ...]) -> None:
        """Free these sequences at every station, after the waves already queued there."""
        if seq_ids:
            message = Release(tuple(seq_ids))
            for box in self._inboxes:
                box.put(message)

    def barrier(self, timeout: float = 30.0) -> bool:
        """Wait until every station has worked through what is queued now; False on timeout."""
        flags = [threading.Event() for _ in self._inboxes]
        for box, flag in zip(self._inboxes, flags):
            box.put(Barrier(flag))
        deadline = time.monotonic() + timeout
        return all(f.wait(max(0.0, deadline - time.monotonic())) for f in flags)

    def close(self) -> None:
        """Stop the workers (after what is queued)."""
        for box in self._inboxes:
            box.put(Stop())
        for t in self._threads:
            t.join(timeout=30)

    def _work(self, i: int) -> None:
        while True:
            match self._inboxes[i].get():
                case Stop():
                    return
                case Barrier(done=done):
                    done.set()
                case Release(seq_ids=seq_ids):
                    self._release(i, seq_ids)
                case RunWave(plan=plan, hidden=hidden):
                    self._run_wave(i, plan, hidden)
                case other:  # a bug upstream: say so, and keep serving what is well-formed
                    log.error("station %d: unexpected inbox message %s ignored", i, type(other).__name__)

    def _release(self, i: int, seq_ids: tuple[int, ...]) -> None:
        release_at(self.links[i], seq_ids, i, self.failed_releases)

    def _run_wave(self, i: int, plan: WavePlan, hidden: torch.Tensor | None) -> None:
        t0 = time.perf_counter()
        steps = {"steps": plan.steps} if plan.steps > 1 else {}  # only to links that take it (runs_steps)
        try:
            if len(self.links) == 1 and streams_steps(self.links[0], plan):
                parts = self.links[0].forward_steps(plan.wave_id, plan.entries, list(plan.token_ids), plan.steps,
                                                    plan.reply_steps)
                deliver_parts(plan, (out.samples for out in parts), self.on_done, self._ends, self.links[0].address)
                return
            out = self.links[i].forward(plan.wave_id, plan.entries, list(plan.token_ids) if i == 0 else None,
                                        hidden, **steps)
        except BaseException as e:  # noqa: BLE001 - reported to the engine, which ends the wave
            self.on_done(plan, None, e)
            return
        finally:
            self.busy_seconds[i] += time.perf_counter() - t0
        if i == len(self.links) - 1:
            self.on_done(plan, out.samples, None)
        else:
            self._inboxes[i + 1].put(RunWave(plan, out.hidden))
