"""The gRPC servicer of one station (thin): decode a request, run the step, encode the reply.

All validation lives in `mesh.core.wire` and `mesh.core.wire_tensor` (message shape, dtypes, limits) and in
`Station.forward` (positions, KV); this file only maps their errors to status codes:

    WireError, StepError -> INVALID_ARGUMENT     KVBudgetError -> RESOURCE_EXHAUSTED
    unparsable bytes     -> INVALID_ARGUMENT     over the message limit -> RESOURCE_EXHAUSTED (gRPC)
    station busy         -> RESOURCE_EXHAUSTED   anything else -> INTERNAL (logged)

and the server keeps serving after each. A station's KV is not thread-safe, so
Forward and Release hold one lock (station.station_lock; a Release sent with `queue_if_busy` while a call holds it
is queued for that call to apply); the server (station.server) still runs a thread pool so
that Info and the standard gRPC health service answer while a long forward runs. At
most `max_pending` lock-taking gRPC calls wait at once, which keeps workers free for
health checks whatever a client sends. The relay link (station.relay_link) calls the same
Forward through `forward_answer`; its calls wait for the lock unrefused (each on a thread of the link's own, their
number bounded by its connections): the parts of a large relayed wave (station.relay_parts) and the waves of a
fast predecessor queue there while a slower station steps.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc
import torch

from mesh.core.proto import station_pb2 as pb
from mesh.core.proto import station_pb2_grpc
from mesh.core.torch_dtypes import TORCH_DTYPES
from mesh.core.wave import StationOutput, WaveEntry, decode_steps_problem, wave_rows
from mesh.core.wire import (decode_entries, decode_forward, decode_relay, decode_reply_steps, decode_steps,
                            samples_to_proto)
from mesh.core.wire_tensor import WireError, tensor_to_proto
from mesh.core.wire_kv import decode_export, decode_import
from station.interceptors import WireBytes
from station.relay import Successors, onward_request
from station.relay_link_client import Announced, StepsCall
from station.relay_parts import part_bounds, relay_in_parts
from station.relay_steps import relay_step_replies
from station.replies import failure_status, info_reply
from station.server_limits import ServerLimits
from station.station_lock import StationLock
from station.step import Station
from station.step_hops import AfterStep, open_step_hop
from station.step_replies import RunningSteps, local_step_replies
from station.steps_session import RefusedSession, Session, StepsSession

log = logging.getLogger(__name__)

_R = TypeVar("_R")


class StationServicer(station_pb2_grpc.StationServicer):
    """Forward / Release / ExportKV / ImportKV / Info over one Station; error classes map to status codes."""

    def __init__(self, station: Station, limits: ServerLimits, wire: WireBytes, metrics_address: str = "",
                 successors: Successors | None = None) -> None:
        """`successors`: how this station reaches the next ones on a relayed wave (None: it refuses relays);
        `wire`: the Forward byte counts (the server's CountForwardBytes and the successors count into it)."""
        self.station = station
        self.successors = successors
        self.limits = limits
        self.metrics_address = metrics_address
        self.lock = StationLock(station, limits.max_pending)  # one call at a time on the KV; releases may queue
        self._positions_per_block: int | None = None
        self.wire = wire  # Forward bytes, relays to the next station included (/metrics)
        self.relay_port = 0  # the port of this station's relay link (start_server sets it), 0: none
        self.running_steps = RunningSteps()  # the ForwardSteps calls running here, which EndSteps can end

    def probe(self, hang_s: float) -> bool:
        """Run the station's probe row under the station lock: False when the lock stays held for `hang_s`
        (a forward that does not end) or the forward path fails."""
        try:
            return self.lock.hold_within(hang_s, self.station.probe)
        except Exception:  # noqa: BLE001 - any failure of the forward path means unhealthy
            log.exception("health probe: the forward path failed")
            return False

    def _guarded(self, context: grpc.ServicerContext, method: str, fn: Callable[[], _R]) -> _R:
        """Run fn; map a failure to its status code and abort the call (the server goes on)."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - failure_status maps every class, a bug to INTERNAL
            code, message = failure_status(err, method)
        context.abort(code, message)  # raises
        raise AssertionError("unreachable")

    def Forward(self, request: pb.ForwardRequest, context: grpc.ServicerContext) -> pb.ForwardReply:
        """One batched step over the wave in `request`; with `relay_to`, the output goes on to those stations
        (station.relay) and their answer comes back."""
        started = time.perf_counter()
        reply = self._guarded(context, "Forward", lambda: self.forward(request, context.time_remaining))
        reply.served_seconds = time.perf_counter() - started
        return reply

    def ForwardSteps(self, request: pb.ForwardRequest, context: grpc.ServicerContext) -> Iterator[pb.ForwardReply]:
        """Several decode steps of one wave, their samples streamed back every `reply_steps` steps (station.
        step_replies); each reply's served_seconds is this station's time since the reply before."""
        mark = time.perf_counter()
        replies = self._guarded(context, "ForwardSteps", lambda: self.forward_steps(request, context.time_remaining))
        while (reply := self._guarded(context, "ForwardSteps", lambda: next(replies, None))) is not None:
            now = time.perf_counter()
            reply.served_seconds, mark = now - mark, now
            yield reply

    def forward_steps(self, request: pb.ForwardRequest, time_remaining: Callable[[], float | None]
                      ) -> Iterator[pb.ForwardReply]:
        """The replies of one ForwardSteps request, one per `reply_steps` decode steps; the request is checked here,
        before any step runs. Raises what `failure_status` maps, here or while the replies are drawn."""
        st = self.station
        _, entries, token_ids, _ = decode_forward(
            request, hidden_size=st.config.hidden_size, dtype=st.spec.dtype, vocab_size=st.config.vocab_size,
            max_entries=self.limits.max_entries, max_rows=self.limits.max_rows)
        relay_to, steps = self._relay_list(request), decode_steps(request)
        per_reply, bt = decode_reply_steps(request, steps), self._block_tokens()
        if token_ids is None:
            raise WireError("payload: ForwardSteps starts at the first station (token ids in), not from hidden rows")
        if (problem := decode_steps_problem(entries, steps, bt)) is not None:
            raise WireError(problem)
        if relay_to:
            return self.running_steps.run(request.wave_id, lambda ended: relay_step_replies(
                self.successors, request.wave_id, entries, token_ids, steps, relay_to, self._first_step,
                time_remaining, block_tokens=bt, vocab_size=st.config.vocab_size, per_reply=per_reply, ended=ended))
        return self.running_steps.run(request.wave_id, lambda ended: local_step_replies(
            self._steps_chunk, entries, token_ids, steps, per_reply, bt, ended))

    def EndSteps(self, request: pb.EndStepsRequest, context: grpc.ServicerContext) -> pb.EndStepsReply:
        """End the wave's ForwardSteps call running here after its step under way (lock-free)."""
        return pb.EndStepsReply(running=self.running_steps.end(request.wave_id))

    def _relay_list(self, request: pb.ForwardRequest) -> tuple[str, ...]:
        """The request's `relay_to`, refused where this station cannot relay."""
        relay_to, st = decode_relay(request), self.station
        if relay_to and (self.successors is None or st.spec.end >= st.config.num_hidden_layers):
            raise WireError("relay_to: this station cannot relay (it holds the last layer, or serves no relays)")
        return relay_to

    def prepare_forward(self, request: pb.ForwardRequest) -> tuple[WaveEntry, ...] | None:
        """An announced request's entries, decoded before its rows come (station.relay_link); None where they do not
        decode (`forward` then raises what is wrong)."""
        try:
            return decode_entries(request, max_entries=self.limits.max_entries, max_rows=self.limits.max_rows)
        except WireError:
            return None

    def open_steps(self, request: pb.ForwardRequest, time_left_s: float | None) -> Session:
        """A steps session for a relay link's STEPS request (station.steps_session), checked now: one that does not
        check answers its first step with the reason."""
        st = self.station
        try:
            entries = decode_entries(request, max_entries=self.limits.max_entries, max_rows=self.limits.max_rows)
            relay_to, steps, bt = self._relay_list(request), decode_steps(request), self._block_tokens()
            if request.WhichOneof("payload") is not None or st.spec.start == 0:
                raise WireError("steps: a session takes hidden rows step by step, at a station after the first; "
                                "its STEPS request carries no payload")
            if (problem := decode_steps_problem(entries, steps, bt)) is not None:
                raise WireError(problem)
            hop = (open_step_hop(self.successors, request.wave_id, entries, steps, relay_to, time_left_s,
                                 st.config.vocab_size) if relay_to else None)
        except Exception as err:  # noqa: BLE001 - failure_status maps every class, a bug to INTERNAL
            return RefusedSession(*failure_status(err, "Steps"))
        return StepsSession(entries, steps, bt, hidden_size=st.config.hidden_size, dtype=st.spec.dtype,
                            run=lambda entries, hidden, space, then: self._relaying_step(
                                entries, space, hidden=hidden, from_link=True, then=then),
                            failure=lambda err: failure_status(err, "Steps"), hop=hop)

    def forward_answer(self, request: pb.ForwardRequest, time_remaining: Callable[[], float | None],
                       hidden_data: bytearray | memoryview | None = None, entries: tuple[WaveEntry, ...] | None = None
                       ) -> pb.ForwardReply | tuple[grpc.StatusCode, str]:
        """Forward for a relay link (station.relay_link): the reply, or the status code and message of its failure;
        `entries`: what `prepare_forward` made of an announced request."""
        started = time.perf_counter()
        try:
            reply = self.forward(request, time_remaining, hidden_data, entries, from_link=True)
        except Exception as err:  # noqa: BLE001 - failure_status maps every class, a bug to INTERNAL
            return failure_status(err, "Forward")
        reply.served_seconds = time.perf_counter() - started
        return reply

    def forward(self, request: pb.ForwardRequest, time_remaining: Callable[[], float | None],
                hidden_data: bytearray | memoryview | None = None, entries: tuple[WaveEntry, ...] | None = None,
                *, from_link: bool = False) -> pb.ForwardReply:
        """The step (and relay) of one Forward request; `time_remaining()`: seconds left of the caller's deadline
        (None: no deadline); `hidden_data`: the hidden rows' bytes where they came beside the request; `entries`: its
        entries where they were decoded ahead (`prepare_forward`); `from_link`: it came over the relay link, and waits
        for the station lock however many calls wait (StationLock.run). Raises what `failure_status` maps."""
        st = self.station
        _, entries, token_ids, hidden = decode_forward(
            request, hidden_size=st.config.hidden_size, dtype=st.spec.dtype, vocab_size=st.config.vocab_size,
            max_entries=self.limits.max_entries, max_rows=self.limits.max_rows, hidden_data=hidden_data,
            entries=entries)
        relay_to, steps = self._relay_list(request), decode_steps(request)
        if relay_to and steps > 1:  # the first station of a chain runs each step and relays it
            if token_ids is None:
                raise WireError("steps: several decode steps through a relay chain start at its first station "
                                "(token ids in)")
            (reply,) = relay_step_replies(self.successors, request.wave_id, entries, token_ids, steps, relay_to,
                                          self._first_step, time_remaining, block_tokens=self._block_tokens(),
                                          vocab_size=st.config.vocab_size, per_reply=steps)
            return reply
        # a large wave, part by part, where its successor takes them on its relay link (over gRPC each part waiting
        # there would hold one of its workers, and its `max_pending` refuses more)
        if (relay_to and len(parts := part_bounds(entries, st.spec.part_rows)) > 1
                and self.successors.has_link(relay_to[0], time_remaining())):
            return relay_in_parts(request.wave_id, entries, token_ids, hidden, relay_to, parts, lambda *part: (
                self._relayed_step(*part, relay_to, time_remaining, from_link)))
        if relay_to:  # the successor decodes the onward request while this station computes the rows
            return self._relayed_step(onward_request(request), entries, token_ids, hidden, relay_to, time_remaining,
                                      from_link)()
        out, kv = self.lock.run(lambda: st.forward(entries, token_ids=token_ids, hidden=hidden, steps=steps),
                                waits=from_link)
        if out.hidden is not None:
            reply = pb.ForwardReply(forward_seconds=out.seconds, kv=kv)
            tensor_to_proto(out.hidden, into=reply.hidden)
            return reply
        return pb.ForwardReply(samples=samples_to_proto(out.samples or []), forward_seconds=out.seconds, kv=kv)

    def _relayed_step(self, onward: pb.ForwardRequest, entries: tuple[WaveEntry, ...],
                      token_ids: torch.Tensor | None, hidden: torch.Tensor | None, relay_to: tuple[str, ...],
                      time_remaining: Callable[[], float | None], from_link: bool = False
                      ) -> Callable[[], pb.ForwardReply]:
        """This station's step on a wave whose rows go on through `relay_to` (`onward`: the request the successor
        gets, announced to it before the step where its link takes announcements), and the relay of those rows, to be
        called outside the station lock (the next wave computes meanwhile): its reply."""
        announced = self.successors.announce(onward, relay_to[0], time_remaining())
        out, kv = self.successors.unless_failed(announced, lambda: self._relaying_step(
            entries, announced, token_ids=token_ids, hidden=hidden, from_link=from_link))
        return lambda: self.successors.relay(onward, relay_to[0], out, kv, time_remaining(), announced)

    @property
    def wire_bytes(self) -> dict[str, int]:
        """Forward message bytes in and out of this station, relays to the next station included."""
        return self.wire.totals()

    def _block_tokens(self) -> int:
        """Positions per KV block at the station: how a several-step wave's block tables are cut per step."""
        if self._positions_per_block is None:  # read on first use: a station's blocks never change size
            self._positions_per_block = self.station.stats().kv.block_tokens
        return self._positions_per_block

    def _steps_chunk(self, entries: tuple[WaveEntry, ...], token_ids: torch.Tensor, steps: int
                     ) -> tuple[StationOutput, pb.KVUsage]:
        """Some decode steps of a streamed several-step wave at a station holding every layer, under the lock."""
        st = self.station
        return self.lock.run(lambda: st.forward(entries, token_ids=token_ids, steps=steps))

    def _relaying_step(self, entries: tuple[WaveEntry, ...], space: Announced | StepsCall | None, *,
                       token_ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                       from_link: bool = False, then: AfterStep | None = None) -> tuple[StationOutput, pb.KVUsage]:
        """This station's step on a wave whose rows go on to its successor (or a session's last station's step),
        under the station lock (let go before they travel, so other waves compute meanwhile); its rows where `space`
        (the hop's announcement or steps session) has room for them. `from_link`: the wave came over the relay link
        (StationLock.run's `waits`). `then(out, kv)`: a decode step's hand-on, run on the compute thread as soon as
        the step ends (the lock taken there in the step's turn: StationLock.queued)."""
        st, rows_out = self.station, self._rows_out(space, entries)

        def step() -> StationOutput:
            return st.forward(entries, token_ids=token_ids, hidden=hidden, rows_out=rows_out)
        if then is not None:
            return self.lock.queued(step, then, waits=from_link)
        return self.lock.run(step, waits=from_link)

    def _first_step(self, entries: tuple[WaveEntry, ...], token_ids: torch.Tensor, space: Announced | StepsCall | None,
                    then: AfterStep) -> tuple[StationOutput, pb.KVUsage]:
        """One step of a several-step relayed wave at the first station (station.relay_steps' StepRunner)."""
        return self._relaying_step(entries, space, token_ids=token_ids, then=then)

    def _rows_out(self, announced: Announced | StepsCall | None, entries: tuple[WaveEntry, ...]
                  ) -> torch.Tensor | None:
        """Where this relaying station's step puts its rows [T, d]: in the successor's shared-memory segment that
        `announced` holds, where they fit, so that they cross the hop without a copy into it (a GPU station's copy
        to the host lands there); None: the link copies them."""
        if announced is None:
            return None
        st, rows = self.station, wave_rows(entries)
        dtype = TORCH_DTYPES[st.spec.dtype]
        space = announced.rows_space(rows * st.config.hidden_size * dtype.itemsize)
        return None if space is None else torch.frombuffer(space, dtype=dtype).view(rows, st.config.hidden_size)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseReply:
        """Free the KV of the listed sequences; replies with how many were resident and the KV left, or, with
        `queue_if_busy` while a call holds the station, that the release is queued for that call to apply."""
        def run() -> pb.ReleaseReply:
            released, kv = self.lock.release(list(request.seq_ids), request.queue_if_busy)
            return pb.ReleaseReply(queued=True) if kv is None else pb.ReleaseReply(released=released, kv=kv)

        return self._guarded(context, "Release", run)

    def ExportKV(self, request: pb.ExportKVRequest, context: grpc.ServicerContext) -> pb.ExportKVReply:
        """K and V of resident sequences' positions in some of this station's layers (a route switch's copy)."""
        def run() -> pb.ExportKVReply:
            entries, lo, hi = decode_export(request, max_entries=self.limits.max_entries,
                                            max_rows=self.limits.max_rows)
            (k, v), kv = self.lock.run(lambda: self.station.export_kv(entries, lo, hi))
            return pb.ExportKVReply(k=tensor_to_proto(k), v=tensor_to_proto(v), kv=kv)

        return self._guarded(context, "ExportKV", run)

    def ImportKV(self, request: pb.ImportKVRequest, context: grpc.ServicerContext) -> pb.ImportKVReply:
        """Store KV copied from other stations, every layer of this station, as a Forward would have."""
        def run() -> pb.ImportKVReply:
            st, cfg = self.station, self.station.config
            entries, k, v = decode_import(request, dtype=st.spec.dtype, layers=st.spec.end - st.spec.start,
                                          kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                          max_entries=self.limits.max_entries, max_rows=self.limits.max_rows)
            _, kv = self.lock.run(lambda: st.import_kv(entries, k, v))
            return pb.ImportKVReply(kv=kv)

        return self._guarded(context, "ImportKV", run)

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoReply:
        """What the station holds and how full its KV is (lock-free: answers during a forward)."""
        return self._guarded(context, "Info", lambda: info_reply(self.station, self.metrics_address,
                                                                 self.relay_port))

