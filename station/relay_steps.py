"""Several decode steps of a wave at the first station of a relay chain (station.proto's `steps` with `relay_to`).

Each step runs here (its token ids in), its rows go through the chain as one step (station.step_hops: a steps
session where the successor takes them, so that each step after the first sends only rows and gets back only fixed
records and ids), and the token ids that come back are the next step's. The steps' answers are gathered into one
ForwardReply per `per_reply` steps (station.step_replies streams them): the samples step-major, this station's
seconds summed and its last KV, one RelayHop per relayed station with its seconds summed and its last KV. A reply
once yielded stands; any later step that fails fails the call.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import numpy as np
import torch

from mesh.core.proto import station_pb2 as pb
from mesh.core.wave import StationOutput, WaveEntry, decode_step_entries, decode_steps_problem
from mesh.core.wire_tensor import WireError
from station.relay import RelayError, Successors
from station.relay_link_client import Announced, StepsCall
from station.step_answers import HopReport, StepAnswer, relay_hop
from station.step_hops import AfterStep, open_step_hop, step_before_hop
from station.step_replies import never

# one step of this station on a wave's entries and token ids, given where its rows may be put (`rows_space` of the
# hop's announcement or session, None: anywhere), calling `then(out, kv)` as soon as it ends (the rows' hop.put); its
# output and KV report
StepRunner = Callable[[tuple[WaveEntry, ...], torch.Tensor, Announced | StepsCall | None, AfterStep],
                      tuple[StationOutput, pb.KVUsage]]


class ReplyChunk:
    """The answers of consecutive steps, gathered into one ForwardReply."""

    def __init__(self, relay_to: tuple[str, ...]) -> None:
        self.steps = 0
        self._relay_to = relay_to
        self._seconds = 0.0
        self._kv: pb.KVUsage | None = None
        self._samples: list[bytes] = []
        self._sums = [[0.0, 0.0, 0.0] for _ in relay_to]  # per relayed station: forward, served, call seconds
        self._last: tuple[HopReport, ...] = ()

    def add(self, seconds: float, kv: pb.KVUsage, answer: StepAnswer) -> None:
        """One step: this station's seconds and KV, and what came back for it."""
        if len(answer.hops) != len(self._relay_to):
            raise RelayError(grpc.StatusCode.INTERNAL, f"relay to {self._relay_to[0]}: {len(answer.hops)} station "
                             f"reports came back for a chain of {len(self._relay_to)}")
        self.steps += 1
        self._seconds += seconds
        self._kv = kv
        self._samples.append(answer.samples)
        for total, hop in zip(self._sums, answer.hops):
            total[0] += hop.forward_seconds
            total[1] += hop.served_seconds
            total[2] += hop.call_seconds
        self._last = answer.hops

    def reply(self) -> pb.ForwardReply:
        """The gathered steps as one reply."""
        reply = pb.ForwardReply(forward_seconds=self._seconds, kv=self._kv)
        reply.samples.MergeFromString(b"".join(self._samples))  # serialized messages joined: their samples in order
        reply.relayed.extend(relay_hop(address, *total, last)
                             for address, total, last in zip(self._relay_to, self._sums, self._last))
        return reply


def relay_step_replies(successors: Successors, wave_id: int, entries: tuple[WaveEntry, ...], token_ids: torch.Tensor,
                       steps: int, relay_to: tuple[str, ...], run_step: StepRunner,
                       time_left_s: Callable[[], float | None], *, block_tokens: int, vocab_size: int,
                       per_reply: int, ended: Callable[[], bool] = never) -> Iterator[pb.ForwardReply]:
    """`steps` decode steps of a wave at the first station of a chain, one reply per `per_reply` steps as their
    samples come back: each step runs here (`run_step`: this station's step and KV report, under its lock, its rows
    where the hop has room for them) and goes through `relay_to` (`hop.put` on the compute thread as soon as the step
    ends); the ids that come back are the next step's token ids. No step starts once `ended()` (the call was ended
    early)."""
    if (problem := decode_steps_problem(entries, steps, block_tokens)) is not None:
        raise WireError(problem)
    hop = open_step_hop(successors, wave_id, entries, steps, relay_to, time_left_s(), vocab_size)
    chunk, finished = ReplyChunk(relay_to), False
    upcoming = [decode_step_entries(entries, 0, block_tokens)]

    def ahead(k: int) -> Callable[[], object]:  # the next step's entries, made while the chain computes this one
        return lambda: upcoming.append(decode_step_entries(entries, k + 1, block_tokens)) if k + 1 < steps else None
    try:
        for k in range(steps):
            if k and ended():
                break
            step = upcoming.pop()
            out, kv = step_before_hop(hop, k, step, time_left_s, lambda space: run_step(
                step, token_ids, space, lambda out, _: hop.put(k, out, time_left_s)))
            answer = hop.answer(k, out, time_left_s, ahead(k))
            token_ids = torch.from_numpy(answer.ids.astype(np.int64))  # [K]
            chunk.add(out.seconds, kv, answer)
            if chunk.steps == per_reply:
                yield chunk.reply()
                chunk = ReplyChunk(relay_to)
        if chunk.steps:
            yield chunk.reply()
        finished = True
    finally:
        if finished:
            hop.finish()
        else:
            hop.abandon()
