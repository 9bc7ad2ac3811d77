"""A relayed decode step's answer in a steps session (station.steps_session), as fixed records and raw token ids.

What comes back to a relaying station for one step of a several-step wave: the KV and seconds of every station
from the one it called to the last, the token ids the last drew (the relaying station's next step feeds them in)
and the samples' own message (logprobs included), which the first station hands the orchestrator as it came. A
ForwardReply carried the same; built, serialized, parsed and walked in Python on every step it cost the first
station's relay thread ~0.6 ms a step on the core its compute thread needs (bench/out/core_quota_s50.txt part 5).

    hops u16 | ids u32 | hops x HOP | ids x int32 | the Samples message (the rest)

HOP is one station's report: its step's seconds, its time in the call, the caller's wall time for the call (0 from
the station that answers: its caller measures it) and its KV after the step.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from mesh.core.proto import station_pb2 as pb
from mesh.core.wire import MAX_RELAY_HOPS, sampled_token_ids
from mesh.core.wire_tensor import WireError

HEAD = struct.Struct("<HI")
HOP = struct.Struct("<dddQQIQ")


class HopReport(NamedTuple):
    """One station's part of a relayed step (RelayHop's fields, flat)."""

    forward_seconds: float
    served_seconds: float
    call_seconds: float
    bytes_used: int
    blocks_used: int
    sequences: int
    changes: int


class StepAnswer(NamedTuple):
    """What a relayed step brought back: one report per station from the called one on, the sampled ids, the
    samples' message."""

    hops: tuple[HopReport, ...]
    ids: np.ndarray  # int32 [K], one per entry
    samples: bytes  # a serialized pb.Samples


def own_report(forward_seconds: float, served_seconds: float, kv: pb.KVUsage) -> HopReport:
    """The answering station's report (its caller fills in the call's seconds)."""
    return HopReport(forward_seconds, served_seconds, 0.0, kv.bytes_used, kv.blocks_used, kv.sequences, kv.changes)


def pack_step_answer(hops: tuple[HopReport, ...], ids: np.ndarray, samples: bytes) -> bytes:
    """The STEP_REPLY body of an answer."""
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    return b"".join((HEAD.pack(len(hops), ids.size), *(HOP.pack(*h) for h in hops), ids.tobytes(), samples))


def unpack_step_answer(body: bytes | bytearray, *, n_entries: int, vocab_size: int) -> StepAnswer:
    """A STEP_REPLY body, checked: a report per station (at most the relay limit), one token id per entry, each in
    the vocabulary. WireError naming what is wrong."""
    if len(body) < HEAD.size:
        raise WireError(f"step answer: {len(body)} bytes, shorter than its {HEAD.size}-byte head")
    n_hops, n_ids = HEAD.unpack_from(body)
    if not 1 <= n_hops <= MAX_RELAY_HOPS or n_ids != n_entries:
        raise WireError(f"step answer: {n_hops} station reports and {n_ids} token ids, expected 1 to "
                        f"{MAX_RELAY_HOPS} and {n_entries} (one per entry)")
    at = HEAD.size + n_hops * HOP.size
    if len(body) < at + 4 * n_ids:
        raise WireError(f"step answer: {len(body)} bytes, short of its {n_hops} reports and {n_ids} ids")
    hops = tuple(HopReport._make(HOP.unpack_from(body, HEAD.size + i * HOP.size)) for i in range(n_hops))
    ids = np.frombuffer(body, dtype=np.int32, count=n_ids, offset=at)
    listed = ids.tolist()  # one call, not two reductions: an answer holds a wave's few ids
    if n_ids and not (0 <= min(listed) and max(listed) < vocab_size):
        bad = next(t for t in listed if not 0 <= t < vocab_size)
        raise WireError(f"step answer: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return StepAnswer(hops, ids, bytes(body[at + 4 * n_ids:]))


def answer_of_relayed(reply: pb.ForwardReply, *, n_entries: int, vocab_size: int) -> StepAnswer:
    """What the stations after a relaying station answered for one step, from the reply it built of their answer
    (station.relay.Successors.relay: one RelayHop per station after it, the samples), as a StepAnswer; WireError
    where it carries no samples or they do not check."""
    if not reply.HasField("samples"):
        raise WireError("a relayed decode step came back without samples (several decode steps need the chain to "
                        "reach the last station)")
    ids = sampled_token_ids(reply.samples, n_entries=n_entries, vocab_size=vocab_size)
    hops = tuple(HopReport(h.forward_seconds, h.served_seconds, h.call_seconds, h.kv.bytes_used, h.kv.blocks_used,
                           h.kv.sequences, h.kv.changes) for h in reply.relayed)
    return StepAnswer(hops, np.asarray(ids, dtype=np.int32), reply.samples.SerializeToString())


def relay_hop(address: str, forward_seconds: float, served_seconds: float, call_seconds: float,
              last: HopReport) -> pb.RelayHop:
    """A RelayHop for the orchestrator: a station's seconds (summed over steps) and its last report's KV."""
    return pb.RelayHop(address=address, forward_seconds=forward_seconds, served_seconds=served_seconds,
                       call_seconds=call_seconds,
                       kv=pb.KVUsage(bytes_used=last.bytes_used, blocks_used=last.blocks_used,
                                     sequences=last.sequences, changes=last.changes))
