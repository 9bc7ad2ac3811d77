"""A typed client of one station's gRPC service: what the orchestrator calls.

Every call carries a deadline (`timeout_s`). A failed call raises
`StationCallError` with the gRPC status code kept, so the caller can tell a bad
wave (INVALID_ARGUMENT), a full KV (RESOURCE_EXHAUSTED) and a dead or slow
station (UNAVAILABLE, DEADLINE_EXCEEDED) apart. Replies are validated with the
wire functions before anything is returned; a malformed reply raises WireError.
With `token`, every call (health included) carries `authorization: Bearer <token>`;
with `tls`, the channel is mutual TLS and the station must present a certificate
for `tls.server_name` signed by `tls.ca`.

Every Forward and Release reply carries the station's KV occupancy after the call;
the client keeps the newest report (`kv_usage`), so KV figures need no Info call.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh.core.allocator import keep_large_blocks
from mesh.core.transport import StationTls, bearer_metadata
from mesh.core.proto import station_pb2 as pb
from mesh.core.proto import station_pb2_grpc
from mesh.core.wave import KVUsage, StationOutput, WaveEntry, wave_rows
from mesh.core.wire import encode_forward, proto_to_samples
from mesh.core.wire_tensor import WireError, proto_to_tensor
from mesh.core.wire_kv import encode_export, encode_import, kv_rows_from_proto

DEFAULT_MAX_MESSAGE_BYTES = 256 * 2**20


class RelayReply(NamedTuple):
    """What a Forward call brought back: the output, one report per relayed station, the callee's time in the call."""

    output: StationOutput
    hops: list[pb.RelayHop]
    served_seconds: float


class StationCallError(RuntimeError):
    """A station call failed; `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details


class LinkClosed(StationCallError):
    """A call on a client this process had closed (its station retired or replaced): nothing was sent."""


def station_channel(address: str, max_message_bytes: int, tls: StationTls | None) -> grpc.Channel:
    """A channel to a station: plain, or mutual TLS with this side's certificate (checked against `tls.server_name`)."""
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes)]
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)
    options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(address, creds, options=options)


class StationClient:
    """Typed Forward / Release / ExportKV / ImportKV / Info / health calls to the station at `address`."""

    def __init__(self, address: str, timeout_s: float = 30.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 *, hidden_size: int | None = None, vocab_size: int | None = None, token: str | None = None,
                 tls: StationTls | None = None, kv_blocks_total: int | None = None,
                 kv_bytes_total: int | None = None) -> None:
        """`hidden_size` / `vocab_size` / `kv_blocks_total` / `kv_bytes_total`, when given, are checked on
        every reply (shape, token ids, KV occupancy).

        `token`: the cluster token sent on every call; `tls`: this side's certificate, key and the CA.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        keep_large_blocks()  # hidden rows sent and received (hub path): freed buffers reused, not fresh pages
        self.address = address
        self.timeout_s = timeout_s
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.kv_blocks_total = kv_blocks_total
        self.kv_bytes_total = kv_bytes_total
        self._kv_usage: KVUsage | None = None
        self._kv_lock = threading.Lock()
        self._metadata = bearer_metadata(token)
        self._channel = station_channel(address, max_message_bytes, tls)
        self.forward_bytes = [0, 0]  # Forward request bytes sent, reply bytes received (through this caller)
        self._stub = station_pb2_grpc.StationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _call(self, method: str, rpc, request):
        try:
            return rpc(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise StationCallError(method, err.code(), err.details() or "") from None
        except ValueError as err:  # grpc's "Cannot invoke RPC on closed channel!": this link was closed
            raise LinkClosed(method, grpc.StatusCode.CANCELLED, str(err)) from None

    def forward(self, wave_id: int, entries: Sequence[WaveEntry], token_ids: Sequence[int] | torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, steps: int = 1) -> StationOutput:
        """Run one wave on the station: token ids [T] to the first station, hidden [T, d] to the others;
        `steps` decode steps on a station holding every layer (samples step-major, steps x entries)."""
        return self.relay(wave_id, entries, token_ids, hidden, steps=steps).output

    def relay(self, wave_id: int, entries: Sequence[WaveEntry], token_ids: Sequence[int] | torch.Tensor | None = None,
              hidden: torch.Tensor | None = None, relay_to: Sequence[str] = (), steps: int = 1) -> RelayReply:
        """Run one wave on the station, which sends its output on to the stations `relay_to` itself (direct
        transfer); returns the output that came back (the last station's samples), one RelayHop per station of
        `relay_to` (their KV and timings; none without relay_to) and the station's own time in the call."""
        request = encode_forward(wave_id, entries, token_ids, hidden, relay_to, steps)
        reply = self._call("Forward", self._stub.Forward, request)
        return self._relay_reply(request, reply, entries, len(relay_to), steps)

    def forward_steps(self, wave_id: int, entries: Sequence[WaveEntry], token_ids: Sequence[int] | torch.Tensor,
                      steps: int, reply_steps: int, relay_to: Sequence[str] = ()) -> Iterator[RelayReply]:
        """`steps` decode steps of a wave at the first station (alone, or relaying each step through `relay_to`),
        their samples streamed back as they are drawn (ForwardSteps): one RelayReply per `reply_steps` steps
        (fewer where the call was ended early, `end_steps`), samples step-major, with that chunk's hop reports and
        the station's own time serving it. Raises StationCallError or WireError, possibly after some replies came
        (their steps stand). The stream may end before the call's last step only where `end_steps` ended it: the
        caller, who asked for that, counts the steps that came. The call's deadline is a call's (`timeout_s`) for
        each of its parts."""
        request = encode_forward(wave_id, entries, token_ids, None, relay_to, steps, reply_steps)
        parts = -(-steps // (reply_steps or steps))
        stream = self._call("ForwardSteps", lambda r, timeout, **kw: iter(self._stub.ForwardSteps(
            r, timeout=timeout * parts, **kw)), request)
        done = 0
        try:
            while (reply := self._call("ForwardSteps", lambda r, **_: next(stream, None), request)) is not None:
                n, extra = divmod(len(reply.samples.samples), len(entries))
                if extra or not 1 <= n <= min(reply_steps or steps, steps - done):
                    raise WireError(f"ForwardSteps: a reply of {len(reply.samples.samples)} samples for "
                                    f"{len(entries)} entries after {done} of the call's {steps} steps")
                yield self._relay_reply(request if not done else None, reply, entries, len(relay_to), n)
                done += n
        finally:
            stream.cancel()  # nothing once the stream has ended; else (a reply refused, the reader gone) ends it

    def end_steps(self, wave_id: int) -> bool:
        """End the ForwardSteps call of `wave_id` running at the station after its step under way; False when none
        runs there."""
        return self._call("EndSteps", self._stub.EndSteps, pb.EndStepsRequest(wave_id=wave_id)).running

    def _relay_reply(self, request: pb.ForwardRequest | None, reply: pb.ForwardReply, entries: Sequence[WaveEntry],
                     relayed: int, steps: int) -> RelayReply:
        """A Forward reply (or one streamed reply of `steps` steps) checked and decoded; its bytes (and the
        `request`'s, where given) counted."""
        with self._kv_lock:
            self.forward_bytes[0] += request.ByteSize() if request is not None else 0
            self.forward_bytes[1] += reply.ByteSize()
        if len(reply.relayed) != relayed:
            raise WireError(f"relayed: {len(reply.relayed)} hop reports for {relayed} relayed stations")
        result = reply.WhichOneof("result")
        if result == "hidden":
            rows = wave_rows(tuple(entries))
            out = proto_to_tensor(reply.hidden, expect_shape=(rows, self.hidden_size), field="hidden")  # [T, d]
            output = StationOutput(out, None, reply.forward_seconds)
        elif result == "samples":
            samples = proto_to_samples(reply.samples, n_entries=len(entries) * steps, vocab_size=self.vocab_size)
            output = StationOutput(None, samples, reply.forward_seconds)
        else:
            raise WireError("result: the reply carries neither hidden rows nor samples")
        self._note_kv(reply)
        return RelayReply(output, list(reply.relayed), reply.served_seconds)

    def release(self, seq_ids: Sequence[int], queue_if_busy: bool = False) -> int:
        """Free these sequences' KV on the station; returns how many were resident. With `queue_if_busy`, where a
        call holds the station the release is queued for that call to apply before any later one (0 returned)."""
        reply = self._call("Release", self._stub.Release,
                           pb.ReleaseRequest(seq_ids=list(seq_ids), queue_if_busy=queue_if_busy))
        if reply.queued and not queue_if_busy:
            raise WireError("queued: the station queued a release that was to wait for it")
        if not reply.queued:
            self._note_kv(reply)
        return reply.released

    def export_kv(self, entries: Sequence[WaveEntry], layer_start: int, layer_end: int, *, dtype: str,
                  kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [layer_end - layer_start, rows, kv_heads, head_dim] of the entries' positions (checked against
        the shape and `dtype` given)."""
        reply = self._call("ExportKV", self._stub.ExportKV, encode_export(entries, layer_start, layer_end))
        self._note_kv(reply)
        shape = (layer_end - layer_start, wave_rows(tuple(entries)), kv_heads, head_dim)
        return kv_rows_from_proto(reply.k, reply.v, dtype=dtype, shape=shape)

    def import_kv(self, entries: Sequence[WaveEntry], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K, V [the station's layers, rows, kv_heads, head_dim] at the entries' positions."""
        self._note_kv(self._call("ImportKV", self._stub.ImportKV, encode_import(entries, k, v)))

    @property
    def kv_usage(self) -> KVUsage | None:
        """The newest KV occupancy the station reported with a Forward or Release reply (None before any)."""
        return self._kv_usage

    def _note_kv(self, reply: pb.ForwardReply | pb.ReleaseReply | pb.ExportKVReply | pb.ImportKVReply) -> None:
        """Validate the reply's `kv` field and keep it when it is newer than the last report."""
        if not reply.HasField("kv"):
            raise WireError("kv: the reply carries no KV occupancy")
        self.note_kv(reply.kv)

    def note_kv(self, kv: pb.KVUsage) -> None:
        """Keep a KV report of this station (from its own reply, or relayed by the station before it) when it is
        newer than the last one; WireError when it exceeds the station's totals."""
        for name, value, limit in (("bytes_used", kv.bytes_used, self.kv_bytes_total),
                                   ("blocks_used", kv.blocks_used, self.kv_blocks_total)):
            if limit is not None and value > limit:
                raise WireError(f"kv.{name}: {value} exceeds the station's total of {limit}")
        usage = KVUsage(kv.bytes_used, kv.blocks_used, kv.sequences, kv.changes)
        with self._kv_lock:
            if self._kv_usage is None or usage.changes > self._kv_usage.changes:
                self._kv_usage = usage

    def info(self) -> pb.InfoReply:
        """The station's layer range, shape, dtype and KV occupancy."""
        return self._call("Info", self._stub.Info, pb.InfoRequest())

    def health(self, service: str = "") -> bool:
        """True when the standard health service answers SERVING; False on any other status or failure."""
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout_s,
                                       metadata=self._metadata)
        except (grpc.RpcError, ValueError):  # ValueError: the channel was closed
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        """Close the channel; later calls fail."""
        self._channel.close()

    def __enter__(self) -> "StationClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
