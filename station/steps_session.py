"""A steps session: a several-step decode wave held open at a station after the first of a relay chain.

Why: on a chain each decode step of a wave used to reach the next station as a whole request (its entries built,
serialized, announced, parsed and checked again) and come back as a whole reply, in Python on both stations, on the
cores their compute threads need: ~1.0 ms of the first station's CPU a step and ~0.6 ms of the second's
(bench/out/core_quota_s50.txt parts 4-5), in the moments when the chain waits on the hop. In a session the relaying
station sends the wave once (STEPS: its entries as of its first step, its steps, the relay list after this station),
the station checks it once, and each step after is its rows and index alone (STEP): the station derives the step's
entries (each entry k positions on, as the first station does), runs its step under its lock and answers with fixed
records and raw ids (STEP_REPLY, station.step_answers). A station that relays on opens its own session with its
successor (station.step_hops), so every hop of the chain is one. The step is taken in its turn on the compute thread
(station.station_lock's `queued`), and what goes on right after it goes from there before the next step starts: the
last station's answer, a relaying station's rows.

What a session refuses, each answered at the step with an ERROR naming it, which ends the session: a STEPS request
that does not check (entries, steps, a payload, a relay list it cannot serve), a step out of order or past the
wave's last, rows of the wrong size or not finite, and whatever the step itself fails with (its KV budget, a
successor that cannot be reached). A session ends at its connection's next frame of another kind, or when the
connection closes; the KV its steps wrote stays, as a whole request's would.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import grpc
import numpy as np
import torch

from mesh.core.proto import station_pb2 as pb
from mesh.core.torch_dtypes import TORCH_DTYPES
from mesh.core.wave import StationOutput, WaveEntry, decode_step_entries, wave_rows
from mesh.core.wire import samples_to_proto
from mesh.core.wire_tensor import WireError, all_finite
from station.relay_link_client import Announced, StepsCall
from station.step_answers import own_report, pack_step_answer
from station.step_hops import AfterStep, StepHop, step_before_hop

Failure = Callable[[Exception], "tuple[grpc.StatusCode, str]"]  # a failed step's status and message
Outcome = "tuple[grpc.StatusCode, str] | None"  # the status and message of an ERROR, None: answered (STEP_REPLY)
AnswerSender = Callable[[bytes], None]  # puts a STEP_REPLY body on the session's connection
# the station's step on a session step's entries and rows, under its lock, its rows where the hop has room for them,
# `then(out, kv)` on the compute thread as soon as it ends
SessionStep = Callable[[tuple[WaveEntry, ...], torch.Tensor, Announced | StepsCall | None, AfterStep],
                       tuple[StationOutput, pb.KVUsage]]


class Session(Protocol):
    """What the relay link holds for a connection's session (StepsSession, or RefusedSession)."""

    def step(self, k: int, rows: bytearray | memoryview | None, time_left: Callable[[], float | None],
             send: AnswerSender) -> Outcome:
        """Answer step `k` of the wave with these rows: its STEP_REPLY body through `send` (None returned), or the
        status and message of an ERROR."""

    def ahead(self) -> None:
        """Work for the next step done while the relaying station computes it (after the answer went out)."""

    def close(self) -> None:
        """The session is over: what it holds is let go."""


OpenSteps = Callable[[pb.ForwardRequest, float | None], Session]  # a STEPS request (and its seconds left) -> session


class RefusedSession:
    """A session whose STEPS request did not check: its first step answers with the reason."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self._outcome = (code, message)

    def step(self, k: int, rows: bytearray | memoryview | None, time_left: Callable[[], float | None],
             send: AnswerSender) -> Outcome:
        return self._outcome

    def ahead(self) -> None:
        return None

    def close(self) -> None:
        return None


class StepsSession:
    """A checked wave's steps at this station (module docstring)."""

    def __init__(self, entries: tuple[WaveEntry, ...], steps: int, block_tokens: int, *, hidden_size: int,
                 dtype: str, run: SessionStep, failure: Failure, hop: StepHop | None) -> None:
        """`entries`: the wave as of its first step (checked for `steps` steps); `run`: the station's step;
        `failure`: a failed step's status; `hop`: the way on to the next station (None: this station samples)."""
        self._entries, self._steps, self._block_tokens = entries, steps, block_tokens
        self._dtype = TORCH_DTYPES[dtype]
        self._shape = (wave_rows(entries), hidden_size)
        self._nbytes = self._shape[0] * hidden_size * self._dtype.itemsize
        self._run, self._failure, self._hop = run, failure, hop
        self._next = 0  # the step expected next
        self._upcoming: tuple[WaveEntry, ...] | None = decode_step_entries(entries, 0, block_tokens)

    def step(self, k: int, rows: bytearray | memoryview | None, time_left: Callable[[], float | None],
             send: AnswerSender) -> Outcome:
        started = time.perf_counter()
        try:
            entries = self._step_entries(k)
            hidden = self._hidden(rows)  # [T, d]
            self._next = k + 1
            if self._hop is None:  # the last station: its samples (every entry of a decode step samples), answered
                def answer(out: StationOutput, kv: pb.KVUsage) -> None:  # on the compute thread, before its next step
                    ids = np.fromiter((s.token_id for s in out.samples), dtype=np.int32, count=len(entries))
                    send(pack_step_answer((own_report(out.seconds, time.perf_counter() - started, kv),), ids,
                                          samples_to_proto(out.samples).SerializeToString()))
                self._run(entries, hidden, None, answer)
                return None
            hop = self._hop
            out, kv = step_before_hop(hop, k, entries, time_left, lambda space: self._run(
                entries, hidden, space, lambda stepped, _: hop.put(k, stepped, time_left)))
            got = hop.answer(k, out, time_left)
            send(pack_step_answer((own_report(out.seconds, time.perf_counter() - started, kv), *got.hops), got.ids,
                                  got.samples))
            return None
        except Exception as err:  # noqa: BLE001 - `failure` maps every class, a bug to INTERNAL
            return self._failure(err)

    def _step_entries(self, k: int) -> tuple[WaveEntry, ...]:
        """Step k's entries (made ahead where they could be); WireError for a step out of order."""
        if k != self._next or k >= self._steps:
            raise WireError(f"step: step {k} where step {self._next} of {self._steps} was expected")
        entries, self._upcoming = self._upcoming, None
        return entries if entries is not None else decode_step_entries(self._entries, k, self._block_tokens)

    def _hidden(self, rows: bytearray | memoryview | None) -> torch.Tensor:
        """A step's rows as this station's input [T, d], in place; WireError naming what is wrong."""
        got = 0 if rows is None else len(rows)
        if got != self._nbytes:
            raise WireError(f"hidden: {got} bytes of rows, expected {self._nbytes} ({self._shape[0]} rows of "
                            f"{self._shape[1]} {str(self._dtype).removeprefix('torch.')})")
        hidden = torch.frombuffer(rows, dtype=self._dtype).view(self._shape)
        if not all_finite(hidden):  # NaN / inf would poison every later layer and the sample
            j = int((~torch.isfinite(hidden).all(dim=-1)).nonzero()[0, 0])
            raise WireError(f"hidden[{j}]: holds NaN or infinite values; hidden rows must be finite")
        return hidden

    def ahead(self) -> None:
        if self._upcoming is None and self._next < self._steps:
            self._upcoming = decode_step_entries(self._entries, self._next, self._block_tokens)

    def close(self) -> None:
        if self._hop is not None:
            self._hop.abandon() if self._next < self._steps else self._hop.finish()
