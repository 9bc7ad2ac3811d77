"""A large relayed wave cut into parts by entries, each part's rows relayed the moment they exist.

Why: a station relays a wave's rows only once its step over the whole wave is done, so on a chain of stations the
next one idles through the first one's whole step. For a decode wave that is the pipeline's order (the other wave
in flight fills it); for a burst's prompt waves it is not: on the bench preset split [0, 8) / [8, 12) over two
1-core stations, the second station's last 226-256-row prompt wave ran 104-142 ms while the first, its prompts done
and its first decode step relayed, idled ~100 ms waiting for it (bench/out/core_quota_s51.txt part 3). Cut into parts,
the successor starts on the first part while this station computes the next, and the last part it waits for is shorter.
Each part is a whole wave of its entries (a row's result never depends on the rest of its wave, so the tokens are the
same), its own announcement and relay; the replies are merged into the one the caller expects.

Only waves of at least twice a station's `relay_part_rows` are cut (mesh.core.config.StationSpec; a part re-reads
every weight, which a prompt wave's rows amortize on a CPU from ~48 rows on and a decode wave's do not; on CUDA a
step re-reads its weights for far more rows at little cost, so a GPU station does not cut unless told to), and only
toward a successor on its relay link, whose calls wait for its station lock unrefused: a faster station's parts queue
there (over gRPC each would hold one of the successor's workers, and its `max_pending` would refuse the surplus).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from itertools import accumulate
from typing import TypeVar

import torch

from mesh.core.proto import station_pb2 as pb
from mesh.core.wave import WaveEntry, wave_rows
from mesh.core.wire import entries_to_proto

_R = TypeVar("_R")
# a station's step on a part (the successor's request, the part's entries, token ids or rows) and its relay, to call
RelayedStep = Callable[[pb.ForwardRequest, tuple[WaveEntry, ...], "torch.Tensor | None", "torch.Tensor | None"],
                       Callable[[], pb.ForwardReply]]
MAX_PARTS = 4  # parts of one wave at most


def part_bounds(entries: tuple[WaveEntry, ...], min_rows: int, max_parts: int | None = None
                ) -> list[tuple[int, int]]:
    """The [lo, hi) entry ranges a wave is relayed in: one where it is small (or `min_rows` is 0), else up to
    `max_parts` (MAX_PARTS), each cut at the first entry boundary past its share of the rows that leaves at least
    `min_rows` after it."""
    max_parts = MAX_PARTS if max_parts is None else max_parts
    rows = wave_rows(entries)
    n = min(max_parts, rows // min_rows, len(entries)) if min_rows > 0 else 1
    if n <= 1:
        return [(0, len(entries))]
    bounds, lo, part, done = [], 0, 0, 0
    for i, e in enumerate(entries[:-1]):
        part, done = part + e.n_tokens, done + e.n_tokens
        if part * n >= rows and rows - done >= min_rows and len(bounds) < n - 1:  # a part's share, and room after
            bounds.append((lo, i + 1))
            lo, part = i + 1, 0
    bounds.append((lo, len(entries)))
    return bounds


def beside(fn: Callable[[], _R]) -> Future[_R]:
    """fn() on a thread of its own, its outcome in the Future returned (a daemon thread: a relay that hangs holds no
    exit; its deadline ends it)."""
    done: Future[_R] = Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as err:  # noqa: BLE001 - handed to the caller of result()
            done.set_exception(err)
    threading.Thread(target=run, name="relay-part", daemon=True).start()
    return done


def merge_part_replies(replies: list[pb.ForwardReply]) -> pb.ForwardReply:
    """One reply for the parts' replies, in entry order: their samples (or rows) one after the other, this station's
    seconds summed and its KV after the last part; per relayed station its seconds summed and its newest KV."""
    merged = pb.ForwardReply(forward_seconds=sum(r.forward_seconds for r in replies))
    merged.kv.CopyFrom(max((r.kv for r in replies), key=lambda kv: kv.changes))
    if replies[0].WhichOneof("result") == "samples":
        for r in replies:
            merged.samples.samples.extend(r.samples.samples)
    else:  # rows that come back (a relay list short of the last station): concatenated
        first = replies[0].hidden
        merged.hidden.dtype = first.dtype
        merged.hidden.shape.extend([sum(r.hidden.shape[0] for r in replies), *first.shape[1:]])
        merged.hidden.data = b"".join(r.hidden.data for r in replies)
    for hops in zip(*(r.relayed for r in replies)):
        hop = merged.relayed.add(address=hops[0].address)
        hop.kv.CopyFrom(max((h.kv for h in hops), key=lambda kv: kv.changes))
        hop.forward_seconds = sum(h.forward_seconds for h in hops)
        hop.served_seconds = sum(h.served_seconds for h in hops)
        hop.call_seconds = sum(h.call_seconds for h in hops)
    return merged


def relay_in_parts(wave_id: int, entries: tuple[WaveEntry, ...], token_ids: torch.Tensor | None,
                   hidden: torch.Tensor | None, relay_to: tuple[str, ...], parts: list[tuple[int, int]],
                   relayed_step: RelayedStep) -> pb.ForwardReply:
    """A wave stepped and relayed part by part (`parts`: part_bounds): each part's step in turn on this thread (one
    call holding or waiting for the station lock at a time), its relay beside the next part's step; one reply for
    all. A part that fails fails the call, once every relay sent has ended."""
    starts = [0, *accumulate(e.n_tokens for e in entries)]  # each entry's first row
    relays: list[Future[pb.ForwardReply]] = []
    try:
        for lo, hi in parts:
            onward = pb.ForwardRequest(wave_id=wave_id, relay_to=relay_to[1:])
            entries_to_proto(entries[lo:hi], into=onward.entries)
            ids = token_ids[starts[lo]:starts[hi]] if token_ids is not None else None  # [rows]
            rows = hidden[starts[lo]:starts[hi]] if hidden is not None else None  # [rows, d]
            relays.append(beside(relayed_step(onward, entries[lo:hi], ids, rows)))
    finally:
        wait(relays)
    return merge_part_replies([relay.result() for relay in relays])
