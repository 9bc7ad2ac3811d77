"""The unit of work: a ragged wave of entries, and what the last station returns.

No torch here: the scheduler builds waves and reads sampled tokens without it.
Hidden rows travel beside a wave as a tensor (station side) or raw bytes (wire).
"""
from __future__ import annotations

from dataclasses import dataclass

from mesh.core.params import SamplingParams


@dataclass(frozen=True, slots=True)
class WaveEntry:
    """One sequence's slice of a wave: `n_tokens` rows starting at absolute position `start_pos`."""

    seq_id: int  # the sequence, unique within the cluster
    start_pos: int  # absolute position of the entry's first row (== tokens already in the KV)
    n_tokens: int  # rows this entry contributes (a prompt chunk, or 1 for a decode token)
    sample: SamplingParams | None = None  # how to draw the next token; None = no token wanted

    def __post_init__(self) -> None:
        if not (isinstance(self.seq_id, int) and self.seq_id >= 0):
            raise ValueError(f"seq_id must be a non-negative integer, got {self.seq_id!r}")
        if not (isinstance(self.start_pos, int) and self.start_pos >= 0):
            raise ValueError(f"start_pos must be a non-negative integer, got {self.start_pos!r}")
        if not (isinstance(self.n_tokens, int) and self.n_tokens >= 1):
            raise ValueError(f"n_tokens must be an integer >= 1, got {self.n_tokens!r}")

    @property
    def end_pos(self) -> int:
        """Position one past the entry's last row (the position of the token it samples)."""
        return self.start_pos + self.n_tokens


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The token drawn for one entry, with its logprob and the top-n alternatives when asked."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def wave_rows(entries: tuple[WaveEntry, ...] | list[WaveEntry]) -> int:
    """Total rows (T) of a wave."""
    return sum(e.n_tokens for e in entries)
