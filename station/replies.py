"""What a station's calls answer besides a step's result: the status and message of a failure (the table in
station.servicer's docstring) and the Info reply."""
from __future__ import annotations

import logging

import grpc

from mesh.core.proto import station_pb2 as pb
from mesh.core.wire_tensor import WireError
from station.kv import KVBudgetError
from station.relay import RelayError
from station.station_lock import StationBusy
from station.step import Station, StepError

log = logging.getLogger(__name__)


def failure_status(err: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call answers with (station.servicer's docstring table)."""
    if isinstance(err, (WireError, StepError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, (KVBudgetError, StationBusy)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)
    if isinstance(err, RelayError):  # the successor's own status, handed on
        return err.code, str(err)
    log.error("%s failed unexpectedly", method, exc_info=err)  # a bug must cost one call, not the server
    return grpc.StatusCode.INTERNAL, f"{method}: {type(err).__name__}: {err}"


def info_reply(station: Station, metrics_address: str = "", relay_port: int = 0) -> pb.InfoReply:
    """The InfoReply of a station: layer range, shape, dtype, KV occupancy, and its relay link's port (0: none)."""
    stats, cfg, spec = station.stats(), station.config, station.spec
    return pb.InfoReply(
        model=station.model_dir.name, layer_start=spec.start, layer_end=spec.end,
        num_layers=cfg.num_hidden_layers, device=spec.device, dtype=spec.dtype,
        kv_bytes_used=stats.kv.bytes_used, kv_bytes_total=stats.kv.bytes_total, sequences=stats.kv.sequences,
        block_tokens=stats.kv.block_tokens, kv_blocks_total=stats.kv.blocks_total,
        kv_blocks_used=stats.kv.blocks_used, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
        metrics_address=metrics_address, prefill_chunk_invariant=station.prefill_chunk_invariant,
        kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, relay_port=relay_port)
