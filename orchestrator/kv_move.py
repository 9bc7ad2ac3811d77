"""Copies live sequences' KV from the old route's stations to the new route's (a make-before-break switch).

A catch-up plan (orchestrator/catchup.py) names, per sequence, positions the old route has committed and the new
route lacks, with the sequence's new-route block table. The copier asks every old station for the K and V of
those positions in all its layers (ExportKV), cuts and joins them along the layer axis into each new station's
range, and stores them there (ImportKV). The new stations then hold the old route's very bits: exact whatever
kernels either side runs, and no recompute competes with the old route's decode. Calls are cut so that no
message carries more than MAX_COPY_BYTES (nor MAX_COPY_ROWS positions); plans go one at a time on a worker thread and come back through the
engine's wave callback like waves do.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import torch

from mesh.core.wave import WaveEntry
from mesh.core.wire_kv import MAX_COPY_BYTES, MAX_COPY_ROWS
from orchestrator.pipeline import StationLink, release_at
from orchestrator.scheduler_types import WavePlan


class CopySourceFailed(RuntimeError):
    """An old-route station could not export the KV (the new stations were not touched)."""


def can_copy(old: list[StationLink], new: list[StationLink]) -> str | None:
    """Why KV cannot be copied from `old` to `new` (None: it can): every link copies KV, one dtype on both sides."""
    for link in (*old, *new):
        if not getattr(link, "copies_kv", False):
            return f"station {link.address} cannot export or import KV ({type(link).__name__})"
    dtypes = {link.kv().dtype for link in (*old, *new)}
    if len(dtypes) != 1:
        return f"the routes' KV dtypes differ ({sorted(dtypes)})"
    return None


def _pieces(entries: tuple[WaveEntry, ...], max_rows: int, block_tokens: int) -> Iterator[tuple[WaveEntry, ...]]:
    """The entries cut into groups of at most `max_rows` rows, in order; an entry longer than that is cut into
    consecutive ranges (each with its table up to its end)."""
    group, rows = [], 0
    for e in entries:
        start = e.start_pos
        while start < e.end_pos:
            n = min(e.end_pos - start, max_rows - rows)
            end = start + n
            group.append(WaveEntry(e.seq_id, start, n, None, e.blocks[:-(-end // block_tokens)]))
            rows, start = rows + n, end
            if rows == max_rows:
                yield tuple(group)
                group, rows = [], 0
    if group:
        yield tuple(group)


class KVCopier:
    """Copies catch-up plans' KV from `old` stations to `new` ones, one plan at a time on a worker thread, in order
    with the new stations' releases during the catch-up (a block the ledger gives again is free there first)."""

    depth = 1  # plans in flight: each already keeps both routes' stations busy in turn

    def __init__(self, old: list[StationLink], new: list[StationLink], row_bytes: int, block_tokens: int,
                 on_done: Callable[[WavePlan, None, BaseException | None], None]) -> None:
        """`row_bytes`: K and V of one position in one layer (2 x KV heads x head dim x itemsize); `on_done`
        gets every submitted plan back with None or the failure (CopySourceFailed when an old station failed)."""
        self.old, self.new, self.on_done = old, new, on_done
        self._old_ranges = [link.layer_range() for link in old]
        widest = max(hi - lo for lo, hi in (*self._old_ranges, *(link.layer_range() for link in new)))
        self.max_rows = max(1, min(MAX_COPY_ROWS, MAX_COPY_BYTES // (row_bytes * widest)))
        self.block_tokens = block_tokens
        self.forgotten: Callable[[int], bool] = lambda seq_id: False  # left the old route meanwhile (CatchUp)
        self.failed_releases = [0] * len(new)
        self._inbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="kv-copy", daemon=True)
        self._thread.start()

    def submit(self, plan: WavePlan) -> None:
        """Copy `plan` on the worker; its result comes to `on_done`."""
        self._inbox.put(plan)

    def release(self, seq_ids: tuple[int, ...]) -> None:
        """Free these sequences' KV at the new stations, after the plans submitted before."""
        if seq_ids:
            self._inbox.put(tuple(seq_ids))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted so far is done; False on timeout."""
        done = threading.Event()
        self._inbox.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        """Stop the worker after what is queued."""
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def _work(self) -> None:
        while (item := self._inbox.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
            elif isinstance(item, tuple):
                for i, link in enumerate(self.new):
                    release_at(link, item, i, self.failed_releases)
            else:
                try:
                    self.copy(item)
                except BaseException as e:  # noqa: BLE001 - reported to the engine, which decides
                    self.on_done(item, None, e)
                    continue
                self.on_done(item, None, None)

    def copy(self, plan: WavePlan) -> None:
        """Copy the plan's positions now (any thread). Everything is exported before anything is imported: an
        old station that no longer holds a sequence the old route let go meanwhile (`forgotten`) is asked again
        without it. Raises CopySourceFailed when an old station failed, the new station's error when one did."""
        entries = plan.entries
        while entries:
            try:
                parts = [(piece, self._export(piece)) for piece in _pieces(entries, self.max_rows, self.block_tokens)]
                break
            except CopySourceFailed:
                live = tuple(e for e in entries if not self.forgotten(e.seq_id))
                if len(live) == len(entries):
                    raise
                entries = live
        else:
            return
        for piece, exported in parts:
            for link in self.new:
                lo, hi = link.layer_range()
                k = torch.cat([pk[max(lo, a) - a:min(hi, b) - a] for a, b, pk, _ in exported if a < hi and b > lo])
                v = torch.cat([pv[max(lo, a) - a:min(hi, b) - a] for a, b, _, pv in exported if a < hi and b > lo])
                link.import_kv(piece, k, v)  # [hi - lo, rows, KVH, D] each

    def _export(self, piece: tuple[WaveEntry, ...]) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(layer_start, layer_end, k, v) from every old station for the piece's positions."""
        source = tuple(WaveEntry(e.seq_id, e.start_pos, e.n_tokens) for e in piece)
        out = []
        for link, (lo, hi) in zip(self.old, self._old_ranges):
            try:
                out.append((lo, hi, *link.export_kv(source, lo, hi)))  # k, v [hi - lo, rows, KVH, D]
            except Exception as e:
                raise CopySourceFailed(f"station {link.address} could not export KV: {type(e).__name__}: {e}") from e
        return out
