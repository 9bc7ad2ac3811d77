"""The unit of work: a ragged wave of entries, and what a station returns for it.

No torch at run time: the scheduler builds waves and reads sampled tokens without it
(`torch` is imported for type checking only; tensors are StationOutput's, station side).
Hidden rows travel beside a wave as a tensor (station side) or raw bytes (wire).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from mesh.core.params import SamplingParams

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True, slots=True)
class WaveEntry:
    """One sequence's slice of a wave: `n_tokens` rows starting at absolute position `start_pos`."""

    seq_id: int  # the sequence, unique within the cluster
    start_pos: int  # absolute position of the entry's first row (== tokens already in the KV)
    n_tokens: int  # rows this entry contributes (a prompt chunk, or 1 for a decode token)
    sample: SamplingParams | None = None  # how to draw the next token; None = no token wanted
    blocks: tuple[int, ...] = ()  # KV block table for [0, end_pos) as the ledger assigned it; () = station allocates

    def __post_init__(self) -> None:
        if not (isinstance(self.seq_id, int) and self.seq_id >= 0):
            raise ValueError(f"seq_id must be a non-negative integer, got {self.seq_id!r}")
        if not (isinstance(self.start_pos, int) and self.start_pos >= 0):
            raise ValueError(f"start_pos must be a non-negative integer, got {self.start_pos!r}")
        if not (isinstance(self.n_tokens, int) and self.n_tokens >= 1):
            raise ValueError(f"n_tokens must be an integer >= 1, got {self.n_tokens!r}")
        if not isinstance(self.blocks, tuple):
            raise ValueError(f"blocks must be a tuple of block ids, got {type(self.blocks).__name__}")

    @property
    def end_pos(self) -> int:
        """Position one past the entry's last row (the position of the token it samples)."""
        return self.start_pos + self.n_tokens


_new_object = object.__new__
_ENTRY_FIELDS = ("seq_id", "start_pos", "n_tokens", "sample", "blocks")
if {f.name for f in fields(WaveEntry)} != set(_ENTRY_FIELDS):
    raise TypeError("entry_unchecked sets WaveEntry's fields by name: a field added must be set there too")
_SET_SEQ, _SET_START, _SET_N, _SET_SAMPLE, _SET_BLOCKS = (getattr(WaveEntry, name).__set__ for name in _ENTRY_FIELDS)


def entry_unchecked(seq_id: int, start_pos: int, n_tokens: int, sample: SamplingParams | None,
                    blocks: tuple[int, ...]) -> WaveEntry:
    """A WaveEntry from values its checks would pass, which the caller guarantees (decoded from the wire's unsigned
    fields with n_tokens checked, or moved on from an entry already built): built without `__post_init__`, 0.33
    against 0.86 us, for the 64 entries every station decodes on every step."""
    e = _new_object(WaveEntry)
    _SET_SEQ(e, seq_id)
    _SET_START(e, start_pos)
    _SET_N(e, n_tokens)
    _SET_SAMPLE(e, sample)
    _SET_BLOCKS(e, blocks)
    return e


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The token drawn for one entry, with its logprob and the top-n alternatives when asked."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def wave_rows(entries: tuple[WaveEntry, ...] | list[WaveEntry]) -> int:
    """Total rows (T) of a wave."""
    return sum(e.n_tokens for e in entries)


def _blocks_for(positions: int, block_tokens: int) -> int:
    """Blocks of `block_tokens` positions that hold `positions` positions."""
    return -(-positions // block_tokens)


def decode_steps_problem(entries: tuple[WaveEntry, ...], steps: int, block_tokens: int) -> str | None:
    """Why `entries` cannot run `steps` decode steps in one call (None when they can): every entry must be one
    token that samples, and a block table given must cover every step's position."""
    for i, e in enumerate(entries):
        if not isinstance(e, WaveEntry) or e.n_tokens != 1 or e.sample is None:
            return f"entries[{i}]: several decode steps take 1-token entries that sample"
        need = _blocks_for(e.start_pos + steps, block_tokens)
        if e.blocks and len(e.blocks) != need:
            return (f"entries[{i}].blocks: {len(e.blocks)} block ids for {steps} steps from position "
                    f"{e.start_pos} (needs {need})")
    return None


def decode_step_entries(entries: tuple[WaveEntry, ...], k: int, block_tokens: int, steps: int = 1
                        ) -> tuple[WaveEntry, ...]:
    """Step k (from 0) of a several-step decode wave, as the wave of its `steps` steps from k: each entry k
    positions on, its block table cut to the blocks those steps' positions need."""
    # built directly, not with dataclasses.replace (0.27 ms for 64 entries) or WaveEntry() (0.06 ms): on every step
    # of a several-step wave; every field is named (a field added to WaveEntry must be carried here too)
    return tuple(entry_unchecked(e.seq_id, e.start_pos + k, e.n_tokens, e.sample,
                                 e.blocks[:_blocks_for(e.start_pos + k + steps, block_tokens)]) for e in entries)


@dataclass(frozen=True, slots=True)
class StationOutput:
    """What one station returns for a wave, in process or over gRPC: hidden rows for the next
    station, or (last station) one sample per entry, None where the entry asked for no token."""

    hidden: Tensor | None  # [T, d] rows for the next station; None from the last station
    samples: list[SampledToken | None] | None  # one per entry, from the last station only
    seconds: float  # the station's own compute time for the wave
    logits: Tensor | None = None  # [R, V] float32 of the sampled rows, only when asked (in process)


@dataclass(frozen=True, slots=True)
class KVUsage:
    """A station's KV occupancy as it reports it after a Forward or a Release.

    `changes` counts the forwards and releases the station has applied, so of two reports
    the one with more changes is the newer, whichever reply arrived last."""

    bytes_used: int
    blocks_used: int
    sequences: int
    changes: int

    def __post_init__(self) -> None:
        for name in ("bytes_used", "blocks_used", "sequences", "changes"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
