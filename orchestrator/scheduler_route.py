"""The Scheduler's moves onto a new route (a mixin, kept apart from planning and commits).

A route switch (orchestrator/route_switch.py) moves every live sequence onto new stations with no wave in flight:
`rebase` sends each running sequence back to the queue to be prefilled again there (a pause switch, or a recovery);
`adopt` takes the block tables a catch-up built on the new route (orchestrator/catchup.py), with `new_ledger`
giving that catch-up its empty ledger. `_requeue`, the move back to the queue, is also how planning preempts a
sequence. Pure Python, no torch.
"""
from __future__ import annotations

from orchestrator.kv_ledger import KVBlockLedger
from orchestrator.scheduler_types import KVLimits
from orchestrator.sequence import Sequence, SequenceStatus


class RouteMoves:
    """Scheduler methods that move its sequences onto another route (a mixin: the scheduler's table, ledger, queue
    and waves in flight)."""

    def _requeue(self, seq: Sequence) -> None:
        """Drop `seq`'s KV (its station release queued for take_releases) and put it at the front of the waiting
        queue, to be recomputed with the same entry sizes."""
        self._ledger.release(seq)
        self._seqs.stop_running(seq)
        seq.num_computed = 0
        seq.replay, seq.history = seq.history + seq.replay, []  # recompute with the same entry sizes
        seq.status = SequenceStatus.WAITING
        seq.skips = 0
        self._waiting.push_front(seq)
        self._pending_releases.append(seq.seq_id)

    def rebase(self, limits: KVLimits) -> tuple[int, ...]:
        """Move to a new route with new KV limits (no wave may be in flight): every running sequence
        goes back to the front of the queue, keeping its output, to be re-prefilled on the new route.
        Returns the seq ids whose KV the old stations must release."""
        if self._in_flight:
            raise RuntimeError(f"rebase with {len(self._in_flight)} waves in flight")
        for seq in reversed(list(self._seqs.running)):  # newest first, so the oldest ends at the front
            self._requeue(seq)
        self.limits = limits
        self._ledger = self._new_ledger(limits)  # the cache is dropped: the new stations hold no KV
        return self.take_releases()

    def new_ledger(self, limits: KVLimits) -> KVBlockLedger:
        """An empty ledger for a route with these limits (a catch-up fills it before `adopt`)."""
        return self._new_ledger(limits)

    def adopt(self, limits: KVLimits, ledger: KVBlockLedger, shadows: dict[int, Sequence],
              no_room: set[int]) -> tuple[tuple[int, ...], dict[int, int]]:
        """Move to a new route whose KV a catch-up built (no wave may be in flight): each running sequence takes
        its shadow's block table and computed tokens (none if it has no shadow); those in `no_room` go back to
        the queue to be re-prefilled there. A sequence whose shadow holds all its computed tokens (a KV copy) keeps
        its history and replay as they were. Returns the seq ids whose KV the old stations must release, and per
        moved sequence the tokens it has left to compute on the new route."""
        if self._in_flight:
            raise RuntimeError(f"adopt with {len(self._in_flight)} waves in flight")
        for seq in reversed(list(self._seqs.running)):
            if seq.seq_id in no_room:
                self._requeue(seq)
        released = [s.seq_id for s in self._seqs.running] + list(self.take_releases())
        residual = {}
        for seq in self._seqs.running:
            shadow = shadows.get(seq.seq_id)
            if shadow is not None and shadow.num_computed > seq.num_computed:
                raise RuntimeError(f"seq {seq.seq_id}: its new-route KV is not a prefix of its old-route KV")
            caught_up = shadow is not None and shadow.num_computed == seq.num_computed
            seq.table, seq.block_names = (shadow.table, []) if shadow else ([], [])
            if not caught_up:  # a residual chunk follows: exact only where any cut gives the same KV
                seq.num_computed = shadow.num_computed if shadow else 0
                seq.history, seq.replay = list(shadow.history) if shadow else [], []
            residual[seq.seq_id] = seq.num_pending
        self.limits, self._ledger = limits, ledger
        return tuple(released), residual
