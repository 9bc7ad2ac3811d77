"""A typed client of one station's gRPC service: what the orchestrator calls.

Every call carries a deadline (`timeout_s`). A failed call raises
`StationCallError` with the gRPC status code kept, so the caller can tell a bad
wave (INVALID_ARGUMENT), a full KV (RESOURCE_EXHAUSTED) and a dead or slow
station (UNAVAILABLE, DEADLINE_EXCEEDED) apart. Replies are validated with the
wire functions before anything is returned; a malformed reply raises WireError.
With `token`, every call (health included) carries `authorization: Bearer <token>`;
with `tls`, the channel is mutual TLS and the station must present a certificate
for `tls.server_name` signed by `tls.ca`.
"""
from __future__ import annotations

from collections.abc import Sequence

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh.core.transport import StationTls, bearer_metadata
from mesh.core.proto import station_pb2 as pb
from mesh.core.proto import station_pb2_grpc
from mesh.core.wave import StationOutput, WaveEntry, wave_rows
from mesh.core.wire import WireError, encode_forward, proto_to_samples, proto_to_tensor

DEFAULT_MAX_MESSAGE_BYTES = 256 * 2**20


class StationCallError(RuntimeError):
    """A station call failed; `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details


class StationClient:
    """Typed Forward / Release / Info / health calls to the station at `address` ("host:port")."""

    def __init__(self, address: str, timeout_s: float = 30.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 *, hidden_size: int | None = None, vocab_size: int | None = None, token: str | None = None,
                 tls: StationTls | None = None) -> None:
        """`hidden_size` / `vocab_size`, when given, are checked on every reply (shape, token ids).

        `token`: the cluster token sent on every call; `tls`: this side's certificate, key and the CA.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        self._metadata = bearer_metadata(token)
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                                 certificate_chain=tls.cert)
            options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(address, creds, options=options)
        self._stub = station_pb2_grpc.StationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _call(self, method: str, rpc, request):
        try:
            return rpc(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise StationCallError(method, err.code(), err.details() or "") from None
        except ValueError as err:  # grpc's "Cannot invoke RPC on closed channel!": this link was closed
            raise StationCallError(method, grpc.StatusCode.CANCELLED, str(err)) from None

    def forward(self, wave_id: int, entries: Sequence[WaveEntry], token_ids: Sequence[int] | torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> StationOutput:
        """Run one wave on the station: token ids [T] to the first station, hidden [T, d] to the others."""
        request = encode_forward(wave_id, entries, token_ids, hidden)
        reply = self._call("Forward", self._stub.Forward, request)
        result = reply.WhichOneof("result")
        if result == "hidden":
            rows = wave_rows(tuple(entries))
            out = proto_to_tensor(reply.hidden, expect_shape=(rows, self.hidden_size), field="hidden")  # [T, d]
            return StationOutput(out, None, reply.forward_seconds)
        if result == "samples":
            samples = proto_to_samples(reply.samples, n_entries=len(entries), vocab_size=self.vocab_size)
            return StationOutput(None, samples, reply.forward_seconds)
        raise WireError("result: the reply carries neither hidden rows nor samples")

    def release(self, seq_ids: Sequence[int]) -> int:
        """Free these sequences' KV on the station; returns how many were resident."""
        return self._call("Release", self._stub.Release, pb.ReleaseRequest(seq_ids=list(seq_ids))).released

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
