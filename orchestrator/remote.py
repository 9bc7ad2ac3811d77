"""A station behind gRPC, as the pipeline and the control plane see it."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc
import torch

from mesh.core.transport import StationTls
from mesh.core.wave import StationOutput
from mesh.core.wire import WireError
from orchestrator.pipeline import LinkKV, StationDown
from station.client import LinkClosed, RelayReply, StationCallError, StationClient

log = logging.getLogger(__name__)
_T = TypeVar("_T")
# a wave refused for what it is (a bug upstream), not for the station's state: replay would not help
_WAVE_ERRORS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class RemoteLink:
    """A station behind gRPC (typically a Ray actor)."""

    copies_kv = True  # ExportKV / ImportKV

    def __init__(self, address: str, timeout_s: float = 30.0, max_message_bytes: int = 512 * 2**20, *,
                 token: str | None = None, tls: StationTls | None = None) -> None:
        """`token` / `tls`: the cluster token and mutual-TLS material every call to the station carries."""
        self.client = StationClient(address, timeout_s, max_message_bytes, token=token, tls=tls)
        info = self.client.info()
        self.client.hidden_size, self.client.vocab_size = info.hidden_size, info.vocab_size
        self.client.kv_blocks_total, self.client.kv_bytes_total = info.kv_blocks_total, info.kv_bytes_total
        self.address = address
        self._info = info

    def forward(self, wave_id, entries, token_ids, hidden, steps: int = 1) -> StationOutput:
        """Run the wave (`steps` decode steps) on the remote station; raises StationDown when the station failed
        the call."""
        return self._wave(lambda: self.client.forward(wave_id, entries, token_ids=token_ids, hidden=hidden,
                                                      steps=steps))

    def relay(self, wave_id, entries, token_ids, successors: Sequence[RemoteLink], steps: int = 1) -> RelayReply:
        """Run the wave here and have this station send its rows on through `successors` (direct transfer;
        `steps` decode steps, each relayed, the samples fed back here); their KV reports update their links.
        StationDown when any station of the chain failed the call, or a relayed report is malformed (the wave's
        effect is then unknown: replay)."""
        reply = self._wave(lambda: self.client.relay(wave_id, entries, token_ids=token_ids,
                                                      relay_to=[s.address for s in successors], steps=steps))
        return self._noted(successors, reply)

    def forward_steps(self, wave_id, entries, token_ids, steps: int, reply_steps: int) -> Iterator[StationOutput]:
        """`steps` decode steps of the wave on this station (holding every layer), one output per `reply_steps`
        steps as their samples are drawn (`relay_steps` without successors)."""
        for reply in self.relay_steps(wave_id, entries, token_ids, steps, reply_steps):
            yield reply.output

    def relay_steps(self, wave_id, entries, token_ids, steps: int, reply_steps: int,
                    successors: Sequence[RemoteLink] = ()) -> Iterator[RelayReply]:
        """`steps` decode steps of the wave at this (first) station, alone or relaying each step through
        `successors`, one RelayReply per `reply_steps` steps as their samples are drawn (ForwardSteps); the
        relayed KV reports update the successors' links. StationDown when any station failed the call, after
        the replies that came before (their steps ran: they stand)."""
        replies = self.client.forward_steps(wave_id, entries, token_ids, steps, reply_steps,
                                            relay_to=[s.address for s in successors])
        while (reply := self._wave(lambda: next(replies, None))) is not None:
            yield self._noted(successors, reply)

    def end_steps(self, wave_id: int) -> bool:
        """End the wave's `relay_steps` call early, after its step under way (the station's EndSteps); False when
        it was not running there or the station did not answer (the call then ends at its own last step, or fails)."""
        try:
            return self.client.end_steps(wave_id)
        except StationCallError as e:
            log.debug("station %s: EndSteps of wave %d failed: %s", self.address, wave_id, e)
            return False

    def _noted(self, successors: Sequence[RemoteLink], reply: RelayReply) -> RelayReply:
        """`reply`, its relayed stations' KV reports noted on their links (StationDown where one is malformed)."""
        try:
            for link, hop in zip(successors, reply.hops):
                link.client.note_kv(hop.kv)
        except WireError as e:
            raise StationDown(f"station {self.address} relayed a malformed report: {e}") from e
        return reply

    def _wave(self, call: Callable[[], _T]) -> _T:
        """Make a wave call; a station that failed it raises StationDown (a refused wave raises as it came)."""
        try:
            return call()
        except StationCallError as e:
            if e.code in _WAVE_ERRORS:
                raise
            raise StationDown(f"station {self.address}: {e}") from e
        except WireError as e:
            raise StationDown(f"station {self.address} sent a malformed reply: {e}") from e

    def release(self, seq_ids) -> None:
        """Free KV on the remote station, queued behind its call under way where one runs (station.station_lock:
        applied before any later call, so nothing sent after this meets that KV). Where this link was closed (a
        recovery replaced its station, or a re-plan retired it) there is nothing to free: that process, and its KV,
        are gone."""
        try:
            self.client.release(list(seq_ids), queue_if_busy=True)
        except LinkClosed:
            log.debug("station %s: release after its link was closed (replaced or retired): nothing to free",
                      self.address)

    def kv(self) -> LinkKV:
        """KV geometry (fixed at start) and the occupancy the station reported with its last Forward or
        Release reply (the Info figures before any): no call to the station, so a /metrics scrape costs none."""
        info, usage = self._info, self.client.kv_usage
        used = info.kv_bytes_used if usage is None else usage.bytes_used
        return LinkKV(info.kv_blocks_total, info.block_tokens, used, info.kv_bytes_total,
                      info.prefill_chunk_invariant, info.dtype)

    def layer_range(self) -> tuple[int, int]:
        """The layers the station reported at connect."""
        return self._info.layer_start, self._info.layer_end

    def export_kv(self, entries, layer_start, layer_end) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy KV out of the remote station; StationDown when it failed the call."""
        info = self._info
        return self._wave(lambda: self.client.export_kv(entries, layer_start, layer_end, dtype=info.dtype,
                                                        kv_heads=info.kv_heads, head_dim=info.head_dim))

    def import_kv(self, entries, k, v) -> None:
        """Store copied KV in the remote station; StationDown when it failed the call."""
        self._wave(lambda: self.client.import_kv(entries, k, v))

    def health(self) -> bool:
        """True when the station's gRPC health says SERVING (its forward-path probe passes) within the deadline."""
        return self.client.health()

    def describe(self) -> dict:
        """Layer range, device, dtype, address, health and KV use (one Info and one health call)."""
        try:
            info, healthy = self.client.info(), self.client.health()
        except Exception as e:  # a station that does not answer is reported, not raised
            return {"layers": [self._info.layer_start, self._info.layer_end], "address": self.address,
                    "healthy": False, "error": str(e)}
        return {"layers": [info.layer_start, info.layer_end], "device": info.device, "dtype": info.dtype,
                "address": self.address, "healthy": healthy, "kv_bytes_used": info.kv_bytes_used,
                "kv_bytes_total": info.kv_bytes_total, "sequences": info.sequences,
                "metrics_address": info.metrics_address}

    def close(self) -> None:
        """Close the channel."""
        self.client.close()
