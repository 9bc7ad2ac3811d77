"""What one station server accepts (wave size, threads, waiting calls, message bytes), checked on construction."""
from __future__ import annotations

from dataclasses import dataclass

from mesh.core.config import DTYPE_BYTES, ConfigError, is_int
from mesh.core.wire_kv import MAX_COPY_BYTES

GRPC_MAX_MESSAGE = 2**31 - 1  # gRPC counts message lengths in a signed int32


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one station server accepts: wave size, worker threads, waiting calls, message bytes."""

    max_entries: int = 256  # entries (sequences) in one wave
    max_rows: int = 8192  # rows (sum of n_tokens) in one wave
    max_workers: int = 8  # gRPC worker threads
    max_pending: int = 4  # Forward/Release calls holding or waiting for the station at once
    headroom_bytes: int = 1 << 20  # added to the largest payload for framing and metadata

    def __post_init__(self) -> None:
        for name in ("max_entries", "max_rows", "max_workers", "max_pending"):
            v = getattr(self, name)
            if not (is_int(v) and v > 0):
                raise ConfigError(f"server.{name} must be a positive integer, got {v!r}")
        if self.max_pending >= self.max_workers:
            raise ConfigError(f"server.max_pending ({self.max_pending}) must be below max_workers "
                              f"({self.max_workers}) so health and Info always find a free worker")
        if not (isinstance(self.headroom_bytes, int) and self.headroom_bytes >= 0):
            raise ConfigError(f"server.headroom_bytes must be >= 0, got {self.headroom_bytes!r}")

    def message_bytes(self, hidden_size: int, kv_row_bytes: int = 0) -> int:
        """Largest message either way: a full wave of float32 hidden rows, token ids, entries and samples, or a
        KV copy of max_rows rows of `kv_row_bytes` each (K and V of every layer; at most MAX_COPY_BYTES, as the
        orchestrator cuts copies), whichever is larger."""
        hidden = self.max_rows * hidden_size * DTYPE_BYTES["float32"]
        ids = self.max_rows * 10  # a varint int32 takes at most 10 bytes
        per_entry = self.max_entries * 512  # an entry, or a sample with up to 20 top logprobs
        copy = min(MAX_COPY_BYTES, self.max_rows * kv_row_bytes)
        return min(GRPC_MAX_MESSAGE, max(hidden + ids, copy) + per_entry + self.headroom_bytes)
