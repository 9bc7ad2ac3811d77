"""How each step of a several-step decode wave reaches the next station of a chain, and what comes back.

A relaying station (the first of a chain, or one inside a steps session) hands each step's rows to a StepHop: a
steps session (SessionHop: station.steps_session, where the successor's relay link takes sessions) sends the
successor the wave once and then only each step's rows and index, its answer a StepAnswer (station.step_answers);
otherwise each step goes as a whole one-step request (RequestHop: announced before the step where the link takes
announcements, else a gRPC Forward call) and its reply is read as a StepAnswer. Either way the relaying station runs

    out, kv = step_before_hop(hop, k, entries, time_left, run)  # its own step, rows where the hop has room; `run`
                                     # calls hop.put(k, out, time_left) right after it, on the compute thread
    answer = hop.answer(k, out, time_left)  # the reports of every station after, the sampled ids, the samples

and `hop.finish()` once the wave's last step has been answered (`abandon` when a step failed or the call ends).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import grpc

from mesh.core.proto import station_pb2 as pb
from mesh.core.wave import StationOutput, WaveEntry
from mesh.core.wire import entries_to_proto
from station.relay import RelayError, Successors
from station.relay_link_client import Announced, StepsCall
from station.step_answers import StepAnswer, answer_of_relayed

TimeLeft = Callable[[], "float | None"]  # seconds left of the call the relaying station serves (None: no deadline)
# what runs on the compute thread as soon as a step ends, before the station's next step (a hop's `put`, the last
# station's answer): given the step's output and KV report
AfterStep = Callable[[StationOutput, pb.KVUsage], object]
_R = TypeVar("_R")


class StepHop(Protocol):
    """The way a several-step wave's steps go to the next station (module docstring)."""

    def begin(self, k: int, entries: tuple[WaveEntry, ...], time_left: TimeLeft) -> Announced | StepsCall | None:
        """Before step `k`'s own step: where its rows may be put (`rows_space`), None: anywhere."""

    def put(self, k: int, out: StationOutput, time_left: TimeLeft) -> None:
        """Step `k`'s rows out, as soon as the step ends (where the hop sends them alone: with `answer` otherwise).
        RelayError on failure."""

    def answer(self, k: int, out: StationOutput, time_left: TimeLeft, meanwhile: Callable[[], object] | None = None
               ) -> StepAnswer:
        """Step `k`'s answer (its rows sent first where `put` did not; the first report's call seconds measured from
        the rows' sending); `meanwhile()` runs while the stations after compute. RelayError on failure, WireError
        for an answer that does not check."""

    def abandon(self) -> None:
        """The wave stops before its last step (a step failed, the call ended): what is held is let go."""

    def finish(self) -> None:
        """The wave's last step was answered (or it ended between steps): what is held is kept for the next wave."""


class SessionHop:
    """Steps through a steps session with the successor."""

    def __init__(self, successors: Successors, successor: str, call: StepsCall) -> None:
        self._successors, self._successor, self._call = successors, successor, call
        self._open = True
        self._sent_at = 0.0  # when the last step's rows went out

    def begin(self, k: int, entries: tuple[WaveEntry, ...], time_left: TimeLeft) -> StepsCall:
        return self._call

    def put(self, k: int, out: StationOutput, time_left: TimeLeft) -> None:
        if out.hidden is None:
            raise RelayError(grpc.StatusCode.INVALID_ARGUMENT, "relay_to: this station samples (it holds the last "
                             "layer); there is nothing to relay")
        self._sent_at = time.perf_counter()
        try:
            self._successors.session_send(self._call, self._successor, k, out.hidden, time_left())
        except BaseException:
            self._open = False  # the client closed the session's connection
            raise

    def answer(self, k: int, out: StationOutput, time_left: TimeLeft, meanwhile: Callable[[], object] | None = None
               ) -> StepAnswer:
        try:
            answer = self._successors.session_answer(self._call, self._successor, time_left(), meanwhile)
        except BaseException:
            self._open = False
            raise
        first = answer.hops[0]._replace(call_seconds=time.perf_counter() - self._sent_at)
        return answer._replace(hops=(first, *answer.hops[1:]))

    def abandon(self) -> None:
        if self._open:
            self._open = False
            self._call.client.abandon(self._call)

    def finish(self) -> None:
        if self._open:
            self._open = False
            self._call.client.finish(self._call)


class RequestHop:
    """Each step as a whole one-step request (a successor that takes no sessions)."""

    def __init__(self, successors: Successors, wave_id: int, relay_to: tuple[str, ...], vocab_size: int) -> None:
        self._successors, self._wave_id, self._relay_to, self._vocab_size = successors, wave_id, relay_to, vocab_size
        self._onward: pb.ForwardRequest | None = None
        self._announced: Announced | None = None

    def begin(self, k: int, entries: tuple[WaveEntry, ...], time_left: TimeLeft) -> Announced | None:
        self._onward = pb.ForwardRequest(wave_id=self._wave_id, relay_to=self._relay_to[1:])
        entries_to_proto(entries, into=self._onward.entries)
        self._announced = self._successors.announce(self._onward, self._relay_to[0], time_left())
        return self._announced

    def put(self, k: int, out: StationOutput, time_left: TimeLeft) -> None:
        return None  # the rows go with `answer`, a whole request's relay

    def answer(self, k: int, out: StationOutput, time_left: TimeLeft, meanwhile: Callable[[], object] | None = None
               ) -> StepAnswer:
        onward, announced, self._announced = self._onward, self._announced, None
        assert onward is not None, "send before begin"
        reply = self._successors.relay(onward, self._relay_to[0], out, pb.KVUsage(), time_left(), announced)
        if meanwhile is not None:
            meanwhile()
        if not reply.HasField("samples"):
            raise RelayError(grpc.StatusCode.INTERNAL, f"relay to {self._relay_to[0]}: step {k} came back without "
                             "samples (several decode steps need the chain to reach the last station)")
        return answer_of_relayed(reply, n_entries=len(onward.entries), vocab_size=self._vocab_size)

    def abandon(self) -> None:
        announced, self._announced = self._announced, None
        if announced is not None:
            announced.client.abandon(announced)

    def finish(self) -> None:
        self._announced = None


def step_before_hop(hop: StepHop, k: int, entries: tuple[WaveEntry, ...], time_left: TimeLeft,
                    run: Callable[[Announced | StepsCall | None], _R]) -> _R:
    """Step `k`'s own step at the relaying station and its rows' `hop.put`: `run(space)`, `space` where the hop has
    room for the rows (`begin`); if either fails, what the hop holds is let go (`abandon`) and it raises."""
    space = hop.begin(k, entries, time_left)
    try:
        return run(space)
    except BaseException:
        hop.abandon()
        raise


def open_step_hop(successors: Successors, wave_id: int, entries: tuple[WaveEntry, ...], steps: int,
                  relay_to: tuple[str, ...], time_left_s: float | None, vocab_size: int) -> StepHop:
    """The hop of a several-step wave from this station to `relay_to[0]`: a steps session where its link takes them
    (the wave's `entries` as of its first step sent now), else whole requests (a successor that cannot be reached
    then fails the first step's relay, as a whole request's would)."""
    request = pb.ForwardRequest(wave_id=wave_id, relay_to=relay_to[1:], steps=steps)
    entries_to_proto(entries, into=request.entries)
    try:
        call = successors.open_steps(request, relay_to[0], time_left_s, n_entries=len(entries),
                                     vocab_size=vocab_size)
    except RelayError:
        call = None
    if call is None:
        return RequestHop(successors, wave_id, relay_to, vocab_size)
    return SessionHop(successors, relay_to[0], call)
