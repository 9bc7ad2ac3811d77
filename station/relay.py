"""Direct transfer: a station sends its hidden rows straight to the next station (station.proto's `relay_to`).

The orchestrator calls the first station with the addresses of the others; each station runs its step,
calls its successor with its output and the rest of the list, and replies with what came back: the
last station's samples and one RelayHop (KV occupancy, timings) per station after it. Only token ids go
out of the orchestrator and only samples come back to it.

Why a nested call and not a push with the wave id: the orchestrator keeps ONE call per wave, so it
still plans every wave, owns its deadline (each station gives its successor the time left of the call it
serves, `context.time_remaining()`) and sees every failure on that call. A successor that cannot be
reached fails the call with the successor's own status (UNAVAILABLE for a dead station, the deadline
for a hung one), which the orchestrator treats exactly as a dead first station: recovery and replay are
unchanged. A push would have the orchestrator serve a callback endpoint, match late results to waves and
time each wave out itself, with failures arriving on another connection than the one that sent the
wave. What the nested call costs: a relaying station holds one gRPC worker thread per wave in flight
while the stations after it run (not the station lock: its next wave computes meanwhile), and the
samples travel back through every station (a few bytes per entry).

Calls to a successor carry this station's cluster token and mutual-TLS certificate, the same
credentials the orchestrator's calls carry, so every hop is authenticated. Only callers holding the
token can name a successor, so a station dials no address a stranger chose.

A call goes over the successor's relay link (station.relay_link: the same messages framed on plain TCP or
TLS, half a gRPC call's latency and CPU for a MiB of rows) where its Info names one, else as a gRPC Forward
call. The link's address is asked for once per successor and forgotten when the link becomes unreachable.
Over a link, a relaying station announces the onward request (entries, relay list) before it computes its rows and
sends only the rows after: its successor decodes the entries meanwhile instead of in the moment when, in a full
chain, every station hands its wave on at once (a step that fails after its announcement closes that connection,
and the successor drops the request). A several-step decode wave goes once, as a steps session, and each step after
as its rows alone (station.relay_steps, station.step_hops, station.steps_session).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import grpc
import torch

from mesh.core.proto import station_pb2 as pb
from mesh.core.transport import StationTls, address_host, bearer_metadata
from mesh.core.wave import StationOutput
from mesh.core.wire_tensor import tensor_bytes, tensor_header, tensor_to_proto
from station.client import station_channel
from station.interceptors import FORWARD_METHOD, INFO_METHOD, WireBytes
from station.link_frames import LinkError
from station.link_shm import SEGMENT_BYTES
from station.relay_link_client import Announced, RelayLinkClient, StepsCall
from station.step_answers import StepAnswer

_R = TypeVar("_R")


class RelayError(RuntimeError):
    """The call to a successor failed; `code` is its gRPC status, handed on to this station's caller."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def onward_request(request: pb.ForwardRequest) -> pb.ForwardRequest:
    """What a relaying station sends its successor for `request` (one decode step or a prompt wave through a
    chain): its wave id and entries, and the relay list less the successor's own address; the rows go beside it.
    A copy of the whole message in one call, then the rest cleared: 0.010 against 0.035 ms for 64 entries built
    field by field."""
    onward = pb.ForwardRequest()
    onward.CopyFrom(request)
    for name in ("payload", "steps", "reply_steps"):
        onward.ClearField(name)
    del onward.relay_to[0]
    return onward


class Successors:
    """Channels to the stations this one relays to (one per address, the least recently used closed beyond
    `max_channels`), with this station's own token and TLS material."""

    def __init__(self, token: str | None, tls: StationTls | None, max_message_bytes: int, wire: WireBytes,
                 default_timeout_s: float = 30.0, max_channels: int = 16, use_links: bool = True,
                 shm_bytes: int = SEGMENT_BYTES) -> None:
        """`wire`: where the bytes of relayed requests ("out") and their answers ("in") are counted (the station's
        own Forward counts); `use_links`: relay over a successor's relay link where it offers one
        (station.relay_link), else always as gRPC Forward calls; `shm_bytes`: each link connection's shared-memory
        segment for its rows where the successor shares this host (station.link_shm; 0: rows always by TCP)."""
        self._token = token
        self._use_links = use_links
        self._shm_bytes = shm_bytes
        self._links: dict[str, RelayLinkClient | None] = {}  # by gRPC address; None: that station offers no link
        self._metadata = bearer_metadata(token)
        self._wire = wire
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._default_timeout_s = default_timeout_s
        self._max_channels = max_channels
        self._stubs: OrderedDict[str, tuple[grpc.Channel, grpc.UnaryUnaryMultiCallable]] = OrderedDict()
        self._lock = threading.Lock()

    def _forward(self, address: str) -> grpc.UnaryUnaryMultiCallable:
        """The Forward call of the station at `address`, its bytes counted as they are encoded and decoded."""
        with self._lock:
            if address in self._stubs:
                self._stubs.move_to_end(address)
                return self._stubs[address][1]
            channel = station_channel(address, self._max_message_bytes, self._tls)
            parse, serialize = self._wire.counting(pb.ForwardReply.FromString, pb.ForwardRequest.SerializeToString,
                                                   received="in", sent="out")
            self._stubs[address] = (channel, channel.unary_unary(FORWARD_METHOD, request_serializer=serialize,
                                                                 response_deserializer=parse))
            while len(self._stubs) > self._max_channels:
                evicted, (channel, _) = self._stubs.popitem(last=False)
                channel.close()
                self._drop_link(evicted)
            return self._stubs[address][1]

    def _drop_link(self, address: str) -> None:
        """Forget the relay link of `address` (closed; asked for again on the next call). Holds self._lock."""
        if (link := self._links.pop(address, None)) is not None:
            link.close()

    def _link(self, address: str, timeout: float) -> RelayLinkClient | None:
        """The relay link of the station at `address`, asked for once (its Info's relay_port); None where it
        offers none or this station does not use links."""
        if not self._use_links:
            return None
        with self._lock:
            if address in self._links:
                return self._links[address]
            channel = self._stubs[address][0] if address in self._stubs else None
        if channel is None:
            self._forward(address)
            with self._lock:
                channel = self._stubs[address][0]
        info = channel.unary_unary(INFO_METHOD, request_serializer=pb.InfoRequest.SerializeToString,
                                   response_deserializer=pb.InfoReply.FromString)
        port = info(pb.InfoRequest(), timeout=timeout, metadata=self._metadata).relay_port
        link = (RelayLinkClient(address_host(address), port, token=self._token, tls=self._tls,
                                max_message_bytes=self._max_message_bytes, wire=self._wire,
                                shm_bytes=self._shm_bytes) if port else None)
        with self._lock:
            if address in self._links:  # another wave asked at the same time
                if link is not None:
                    link.close()
                return self._links[address]
            self._links[address] = link
            return link

    def _call(self, address: str, request: pb.ForwardRequest, hidden: torch.Tensor, timeout: float
              ) -> pb.ForwardReply:
        """Forward `request` with its `hidden` rows to the station at `address`: over its relay link, the rows' bytes
        beside the message, else in it as a gRPC call; RelayError on failure."""
        def call() -> pb.ForwardReply:
            link = self._link(address, timeout)
            if link is None:
                tensor_to_proto(hidden, into=request.hidden)
                return self._forward(address)(request, timeout=timeout, metadata=self._metadata)
            tensor_header(hidden, into=request.hidden)
            return link.forward(request, timeout, rows=tensor_bytes(hidden))
        return self._relayed(address, call)

    def _relayed(self, address: str, call: Callable[[], _R]) -> _R:
        """`call()`, a call to the station at `address`, its failure as a RelayError with the status it stands for
        (a link that became unreachable forgotten)."""
        try:
            return call()
        except LinkError as err:
            if err.code == grpc.StatusCode.UNAVAILABLE:
                with self._lock:
                    self._drop_link(address)
            raise RelayError(err.code, f"relay to {address}: {err}") from None
        except grpc.RpcError as err:
            raise RelayError(err.code(), f"relay to {address}: {err.details() or err.code().name}") from None
        except ValueError as err:  # the channel was closed under us (evicted)
            raise RelayError(grpc.StatusCode.UNAVAILABLE, f"relay to {address}: {err}") from None

    def has_link(self, successor: str, time_left_s: float | None) -> bool:
        """Whether relays to `successor` go over its relay link (its Info asked once); False where it offers none
        or could not be asked now (the relay then reports why)."""
        try:
            return self._relayed(successor, lambda: self._link(successor, self._timeout(time_left_s))) is not None
        except RelayError:
            return False

    def announce(self, onward: pb.ForwardRequest, successor: str, time_left_s: float | None) -> Announced | None:
        """Send `successor` the wave's `onward` request (`onward_request`) before this station computes its rows,
        where its relay link takes announcements (station.relay_link): it decodes the entries meanwhile. None where
        it does not, or the announcement could not be sent (`relay` then makes the whole call and reports any
        failure)."""
        timeout = self._timeout(time_left_s)

        def send() -> Announced | None:
            link = self._link(successor, timeout)
            if link is None:  # a gRPC successor: the whole request goes with the rows
                return None
            return link.announce(onward, timeout)
        try:
            return self._relayed(successor, send)
        except RelayError:
            return None

    @staticmethod
    def unless_failed(announcement: Announced | None, step: Callable[[], _R]) -> _R:
        """Run this station's `step`; where it fails, abandon the `announcement` made for its rows (the successor
        drops the announced request)."""
        try:
            return step()
        except BaseException:
            if announcement is not None:
                announcement.client.abandon(announcement)
            raise

    def open_steps(self, request: pb.ForwardRequest, successor: str, time_left_s: float | None, *, n_entries: int,
                   vocab_size: int) -> StepsCall | None:
        """Open a steps session with `successor` for a several-step wave (station.steps_session; `request`: its
        entries as of its first step, its steps and the relay list after the successor), where its relay link takes
        sessions; None where it does not (each step then goes as a whole request); RelayError where it cannot be
        reached."""
        timeout = self._timeout(time_left_s)

        def send() -> StepsCall | None:
            link = self._link(successor, timeout)
            return None if link is None else link.open_steps(request, timeout, n_entries=n_entries,
                                                             vocab_size=vocab_size)
        return self._relayed(successor, send)

    def session_send(self, call: StepsCall, successor: str, k: int, rows: torch.Tensor, time_left_s: float | None
                     ) -> None:
        """Step `k`'s `rows` out to `successor` in an open session (where the step wrote them into the session's
        segment, only the frame: no view of them made, no copy); RelayError on failure."""
        timeout, nbytes = self._timeout(time_left_s), rows.numel() * rows.element_size()
        if call.segment is not None and call.segment.holds_at(rows.data_ptr(), nbytes):
            self._relayed(successor, lambda: call.client.send_step_in_place(call, k, nbytes, timeout))
        else:
            self._relayed(successor, lambda: call.client.send_step(call, k, tensor_bytes(rows), timeout))

    def session_answer(self, call: StepsCall, successor: str, time_left_s: float | None,
                       meanwhile: Callable[[], object] | None = None) -> StepAnswer:
        """The answer to the step last sent in an open session with `successor` (`meanwhile()` run first);
        RelayError on failure, WireError for an answer that does not check."""
        timeout = self._timeout(time_left_s)
        return self._relayed(successor, lambda: call.client.step_answer(call, timeout, meanwhile))

    def _timeout(self, time_left_s: float | None) -> float:
        return self._default_timeout_s if time_left_s is None else max(0.0, time_left_s)

    def relay(self, onward: pb.ForwardRequest, successor: str, out: StationOutput, kv: pb.KVUsage,
              time_left_s: float | None, announcement: Announced | None = None) -> pb.ForwardReply:
        """Send `out.hidden` with the wave's `onward` request (`onward_request`) to `successor` within `time_left_s`
        (None: the caller set no deadline, use the default), and build this station's reply from the answer.
        `announcement`: the request was announced to `successor` (`announce`): only the rows go now."""
        if out.hidden is None:
            if announcement is not None:
                announcement.client.abandon(announcement)
            raise RelayError(grpc.StatusCode.INVALID_ARGUMENT,
                             "relay_to: this station samples (it holds the last layer); there is nothing to relay")
        t0 = time.perf_counter()
        if announcement is not None:
            sent, hidden = announcement, out.hidden
            answer = self._relayed(successor, lambda: sent.client.complete(sent, tensor_header(hidden),
                                                                           tensor_bytes(hidden)))
        else:
            answer = self._call(successor, onward, out.hidden, self._timeout(time_left_s))
        hop = pb.RelayHop(address=successor, kv=answer.kv, forward_seconds=answer.forward_seconds,
                          served_seconds=answer.served_seconds, call_seconds=time.perf_counter() - t0)
        reply = pb.ForwardReply(forward_seconds=out.seconds, kv=kv, relayed=[hop, *answer.relayed])
        result = answer.WhichOneof("result")
        if result == "samples":
            reply.samples.CopyFrom(answer.samples)
        elif result == "hidden":  # a relay list that stops short of the last station: its rows come back
            reply.hidden.CopyFrom(answer.hidden)
        else:
            raise RelayError(grpc.StatusCode.INTERNAL, f"relay to {successor}: the reply carries no result")
        return reply

    def close(self) -> None:
        """Close every channel."""
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()
            for address in list(self._links):
                self._drop_link(address)
