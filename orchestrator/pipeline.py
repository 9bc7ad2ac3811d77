"""Drives waves through the chain of stations, several waves in flight.

Each station has a worker thread and an inbox. A wave enters station 0's inbox,
and each worker hands its output (hidden rows) to the next station's inbox, so
with P stations up to P waves are computed at once, one per station. Releases
go into every inbox in order, so a release queued before a wave is applied
before that wave at every station. The last station's samples (or any failure)
go to the `on_done` callback.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from mesh.core.wave import SampledToken, StationOutput, WaveEntry


class StationDown(RuntimeError):
    """A station could not serve a wave: dead, hung past its deadline, or the call was lost.

    The wave's effect at the stations is unknown, so the engine rebuilds the route's KV by replay."""


@dataclass(frozen=True, slots=True)
class LinkKV:
    """A station's KV geometry, for the scheduler's ledger."""

    blocks_total: int
    block_tokens: int
    bytes_used: int
    bytes_total: int


class StationLink(Protocol):
    """One station as the pipeline sees it: in-process or over gRPC."""

    def forward(self, wave_id: int, entries: tuple[WaveEntry, ...], token_ids: list[int] | None,
                hidden: torch.Tensor | None) -> StationOutput:
        """Run one wave through the station."""
        ...

    def release(self, seq_ids: tuple[int, ...]) -> None:
        """Free these sequences' KV."""
        ...

    def kv(self) -> LinkKV:
        """KV geometry and occupancy."""
        ...


class LocalLink:
    """A Station object in this process."""

    def __init__(self, station) -> None:
        self.station = station

    def forward(self, wave_id, entries, token_ids, hidden) -> StationOutput:
        """Run the wave on the in-process station."""
        ids = torch.tensor(token_ids, dtype=torch.long) if token_ids is not None else None
        return self.station.forward(entries, token_ids=ids, hidden=hidden)

    def release(self, seq_ids) -> None:
        """Free KV on the in-process station."""
        self.station.release(list(seq_ids))

    def kv(self) -> LinkKV:
        """The station's KV pool figures."""
        s = self.station.kv.stats()
        return LinkKV(s.blocks_total, s.block_tokens, s.bytes_used, s.bytes_total)

    def describe(self) -> dict:
        """Layer range, device and dtype, for status pages."""
        spec = self.station.spec
        return {"layers": list(spec.layers), "device": spec.device, "dtype": spec.dtype, "address": "in-process"}


WaveDone = Callable[[object, "list[SampledToken | None] | None", "BaseException | None"], None]


class Pipeline:
    """A chain of station links with one worker thread each."""

    def __init__(self, links: list[StationLink], on_done: WaveDone) -> None:
        if not links:
            raise ValueError("a pipeline needs at least one station")
        self.links = links
        self.on_done = on_done
        self._inboxes = [queue.Queue() for _ in links]
        self.busy_seconds = [0.0] * len(links)
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"station-{i}", daemon=True)
                         for i in range(len(links))]
        for t in self._threads:
            t.start()

    @property
    def depth(self) -> int:
        """How many waves can usefully be in flight (one per station)."""
        return len(self.links)

    def submit(self, plan) -> None:
        """Send a WavePlan (entries + token ids) into station 0."""
        self._inboxes[0].put(("wave", plan, None))

    def release(self, seq_ids: tuple[int, ...]) -> None:
        """Free these sequences at every station, after the waves already queued there."""
        if seq_ids:
            for box in self._inboxes:
                box.put(("release", tuple(seq_ids), None))

    def barrier(self, timeout: float = 30.0) -> bool:
        """Wait until every station has worked through what is queued now; False on timeout."""
        flags = [threading.Event() for _ in self._inboxes]
        for box, flag in zip(self._inboxes, flags):
            box.put(("barrier", flag, None))
        deadline = time.monotonic() + timeout
        return all(f.wait(max(0.0, deadline - time.monotonic())) for f in flags)

    def close(self) -> None:
        """Stop the workers (after what is queued)."""
        for box in self._inboxes:
            box.put(None)
        for t in self._threads:
            t.join(timeout=30)

    def _work(self, i: int) -> None:
        link, last = self.links[i], i == len(self.links) - 1
        while (item := self._inboxes[i].get()) is not None:
            kind, plan, hidden = item
            if kind == "barrier":
                plan.set()
                continue
            if kind == "release":
                try:
                    link.release(plan)
                except Exception:  # a station that cannot release has lost the KV anyway
                    pass
                continue
            t0 = time.perf_counter()
            try:
                out = link.forward(plan.wave_id, plan.entries, list(plan.token_ids) if i == 0 else None, hidden)
            except BaseException as e:  # noqa: BLE001 - reported to the engine, which ends the wave
                self.on_done(plan, None, e)
                continue
            finally:
                self.busy_seconds[i] += time.perf_counter() - t0
            if last:
                self.on_done(plan, out.samples, None)
            else:
                self._inboxes[i + 1].put(("wave", plan, out.hidden))
