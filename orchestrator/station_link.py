"""A station as the orchestrator sees it: the link protocol (in process or over gRPC), its KV figures, its failure,
and what a link can run (several decode steps in one call, their samples streamed back in parts)."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Protocol

import torch

from mesh.core.wave import StationOutput, WaveEntry
from orchestrator.scheduler_types import WavePlan


class StationDown(RuntimeError):
    """A station could not serve a wave: dead, hung past its deadline, or the call was lost.

    The wave's effect at the stations is unknown, so the engine rebuilds the route's KV by replay."""


@dataclass(frozen=True, slots=True)
class LinkKV:
    """A station's KV geometry, for the scheduler's ledger."""

    blocks_total: int
    block_tokens: int
    bytes_used: int
    bytes_total: int
    prefill_chunk_invariant: bool = False  # one chunk or several give a prompt the same KV bits (prefix reuse is exact)
    dtype: str = "float32"  # the KV's dtype (a KV copy needs the same on both sides)


class StationLink(Protocol):
    """One station as the orchestrator and the control plane see it: in-process or over gRPC."""

    address: str  # where the station serves ("host:port", or "in-process")
    copies_kv: bool  # the station can export and import KV (ExportKV / ImportKV)

    def forward(self, wave_id: int, entries: tuple[WaveEntry, ...], token_ids: list[int] | None,
                hidden: torch.Tensor | None) -> StationOutput:
        """Run one wave through the station (a link whose forward also takes `steps=` runs several decode steps in
        one call where the engine asks: `runs_steps`)."""
        ...

    def release(self, seq_ids: tuple[int, ...]) -> None:
        """Free these sequences' KV."""
        ...

    def kv(self) -> LinkKV:
        """KV geometry and occupancy (no call to the station)."""
        ...

    def layer_range(self) -> tuple[int, int]:
        """The model layers [start, end) the station holds."""
        ...

    def export_kv(self, entries: tuple[WaveEntry, ...], layer_start: int,
                  layer_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [layers, rows, KVH, D] of the entries' positions in model layers [layer_start, layer_end)."""
        ...

    def import_kv(self, entries: tuple[WaveEntry, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K, V [the station's layers, rows, KVH, D] copied from other stations at the entries' positions."""
        ...

    def health(self) -> bool:
        """True while the station can serve waves."""
        ...

    def describe(self) -> dict:
        """Layer range, device, dtype, address, health and KV use, for status pages."""
        ...

    def close(self) -> None:
        """Let go of the station; later calls fail."""
        ...


@functools.lru_cache(maxsize=None)
def _forward_takes_steps(cls: type) -> bool:
    try:
        return "steps" in inspect.signature(cls.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def streams_steps(link: StationLink, plan: WavePlan) -> bool:
    """True when `plan` is a several-step wave whose samples come back in parts (`reply_steps`) and the link can
    stream them (its `forward_steps`); else the call's samples come back at its end."""
    return 0 < plan.reply_steps < plan.steps and callable(getattr(link, "forward_steps", None))


def runs_steps(link: StationLink) -> bool:
    """True when the link's forward takes `steps` (several decode steps in one call), read from its class: a link
    class that overrides forward without it keeps one step per call."""
    return _forward_takes_steps(type(link))
