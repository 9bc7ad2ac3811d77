"""Several decode steps of one wave, their samples streamed back as they are drawn (station.proto's ForwardSteps).

Why a stream: a several-step call keeps a wave at the stations between its visits to the orchestrator, and each
visit idles the chain (the wave's samples go back, are committed and streamed, the next call is planned and sent);
more steps per call means fewer visits. With one reply per call, more steps also meant longer waits for every
token; streamed, the samples of each `reply_steps` steps reach the orchestrator (and the users) as they are drawn,
while the wave stays at the stations for the whole call.

The first station runs the steps: alone (it holds every layer), each chunk of `reply_steps` steps as one
several-step forward under its lock; in a relay chain (station.relay_steps), each step relayed through its
successors. Each reply holds its steps' samples (step-major), its seconds and its last step's KV; in a chain, one
RelayHop per relayed station with its seconds summed over the chunk's steps. A reply once sent stands: its steps ran at every
station, so a failure later in the call leaves the orchestrator with the steps it was sent.

The orchestrator may end such a call early (EndSteps, when a request waits for a lane or the route is to change):
the station stops after the step under way, sends the reply of the steps it ran and ends the stream, so the
orchestrator has every step that ran (its KV and its ledger agree) and can plan again within a step.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from mesh.core.proto import station_pb2 as pb
from mesh.core.wave import StationOutput, WaveEntry, decode_step_entries
from mesh.core.wire import samples_to_proto

ChunkRunner = Callable[[tuple[WaveEntry, ...], torch.Tensor, int], tuple[StationOutput, pb.KVUsage]]
_R = TypeVar("_R")


def never() -> bool:
    """The `ended` of a call nothing ends early."""
    return False


class RunningSteps:
    """The several-step calls running at a station (or an in-process link), by wave id, each with the flag that
    ends it early (EndSteps)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flags: dict[int, threading.Event] = {}

    def run(self, wave_id: int, replies: Callable[[Callable[[], bool]], Iterator[_R]]) -> Iterator[_R]:
        """The replies of `replies(ended)`, the call of `wave_id`: `ended()` turns true once `end(wave_id)` is
        called, and the call then stops after its step under way."""
        flag = threading.Event()
        with self._lock:
            self._flags[wave_id] = flag
        try:
            yield from replies(flag.is_set)
        finally:
            with self._lock:
                if self._flags.get(wave_id) is flag:
                    del self._flags[wave_id]

    def end(self, wave_id: int) -> bool:
        """End the call of `wave_id` after its step under way; False when none runs here."""
        with self._lock:
            flag = self._flags.get(wave_id)
        if flag is not None:
            flag.set()
        return flag is not None


def local_step_replies(run_chunk: ChunkRunner, entries: tuple[WaveEntry, ...], token_ids: torch.Tensor, steps: int,
                       per_reply: int, block_tokens: int, ended: Callable[[], bool] = never
                       ) -> Iterator[pb.ForwardReply]:
    """`steps` decode steps at a station holding every layer, one reply per `per_reply` of them: `run_chunk(entries,
    token_ids, n)` runs n steps (this station's several-step forward and its KV report, under its lock), fed the
    last samples of the chunk before; no chunk starts once `ended()`."""
    for out, kv in step_chunks(run_chunk, entries, token_ids, steps, per_reply, block_tokens, ended):
        yield pb.ForwardReply(samples=samples_to_proto(out.samples or []), forward_seconds=out.seconds, kv=kv)


def step_chunks(run_chunk: Callable[[tuple[WaveEntry, ...], torch.Tensor, int], tuple[StationOutput, object]],
                entries: tuple[WaveEntry, ...], token_ids: torch.Tensor, steps: int, per_reply: int,
                block_tokens: int, ended: Callable[[], bool] = never) -> Iterator[tuple[StationOutput, object]]:
    """Run `steps` decode steps of a wave of sampling 1-token entries as chunks of `per_reply` steps, each chunk's
    first tokens the samples of the chunk before's last step; yields what `run_chunk` returns for each chunk, and
    stops early (after a chunk) once `ended()`."""
    for k in range(0, steps, per_reply):
        if k and ended():
            return
        n = min(per_reply, steps - k)
        out, report = run_chunk(decode_step_entries(entries, k, block_tokens, n), token_ids, n)
        last = (out.samples or [])[-len(entries):]
        token_ids = torch.tensor([t.token_id for t in last], dtype=torch.long)  # [K]
        yield out, report
