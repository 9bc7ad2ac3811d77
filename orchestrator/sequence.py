"""Request and Sequence state, the waiting queue and the table of live sequences (no torch).

A Sequence follows vLLM v1's invariant: `num_computed` tokens (their KV lives at
the stations) catch up with `num_tokens` (prompt + generated). There is no prefill
mode: one pending token means decoding, more means a prompt (or recompute) chunk.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from enum import Enum

from mesh.core.params import SamplingParams


@dataclass(frozen=True, slots=True)
class Request:
    """What the engine asked for: the prompt token ids and how to sample them."""

    request_id: str  # the API request; several sequences may share it (n > 1)
    prompt_ids: tuple[int, ...]  # tokenized prompt, never empty
    params: SamplingParams  # sampling and stop rules


class SequenceStatus(Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"  # in the waiting queue, no KV at the stations
    RUNNING = "running"  # admitted: holds KV blocks, planned into waves
    FINISHED = "finished"  # done; its KV is released (or is released at its wave's commit)


@dataclass(slots=True, eq=False)
class Sequence:
    """One generation stream: a request's prompt, its output so far, and its KV progress.

    Mutable state, compared by identity; only the scheduler changes it.
    """

    seq_id: int  # unique within the cluster
    request: Request  # the immutable part
    arrival: int  # order of add(); smaller is older (preemption takes the largest)
    output_ids: list[int] = field(default_factory=list)  # generated tokens
    num_computed: int = 0  # tokens whose KV is at the stations
    table: list[int] = field(default_factory=list)  # its KV block ids, in position order (the ledger's)
    block_names: list[bytes] = field(default_factory=list)  # prefix-cache names of its committed full blocks
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was admitted
    status: SequenceStatus = SequenceStatus.WAITING
    in_flight_wave: int | None = None  # wave id carrying it now, if any
    skips: int = 0  # times a later request was admitted ahead of it (short-first ageing)
    preemptions: int = 0  # times its KV was dropped to make room
    finish_reason: str | None = None  # set once it finished (stop, length, cancelled, ...)
    history: list[int] = field(default_factory=list)  # n_tokens of each committed entry (sums to num_computed)
    replay: list[int] = field(default_factory=list)  # entry sizes still to recompute after its KV was dropped

    @property
    def request_id(self) -> str:
        """The API request this sequence belongs to."""
        return self.request.request_id

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """The prompt token ids."""
        return self.request.prompt_ids

    @property
    def params(self) -> SamplingParams:
        """The request's sampling parameters."""
        return self.request.params

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV at the stations (1 while decoding)."""
        return self.num_tokens - self.num_computed

    def next_chunk(self, budget: int) -> int:
        """Rows its next entry wants: a replayed entry exactly as first computed (so the rebuilt KV is
        bit-identical and its tokens cannot change), else as much of what is pending as the budget allows."""
        return self.replay[0] if self.replay else min(self.num_pending, budget)

    def token_slice(self, start: int, stop: int) -> tuple[int, ...]:
        """Token ids at absolute positions [start, stop) of prompt + output."""
        prompt = self.request.prompt_ids
        n_prompt = len(prompt)
        if stop <= n_prompt:
            return prompt[start:stop]
        if start >= n_prompt:
            return tuple(self.output_ids[start - n_prompt:stop - n_prompt])
        return prompt[start:] + tuple(self.output_ids[:stop - n_prompt])


class WaitingQueue:
    """Requests not yet running, oldest first; preempted sequences go back to the front.

    FIFO by default. With short-first, a prompt of at most `short_tokens` tokens jumps
    ahead of longer ones, but a request passed over `max_skips` times is taken next
    regardless (ageing), and a preempted sequence is always resumed first.
    """

    def __init__(self, short_first: bool, short_tokens: int, max_skips: int) -> None:
        """An empty queue with the given admission order."""
        self._items: list[Sequence] = []
        self._short_first = short_first
        self._short_tokens = short_tokens
        self._max_skips = max_skips

    def __len__(self) -> int:
        return len(self._items)

    def push_back(self, seq: Sequence) -> None:
        """Queue a newly added request behind every other."""
        self._items.append(seq)

    def push_front(self, seq: Sequence) -> None:
        """Queue a preempted sequence ahead of every other (behind earlier preempted, older ones)."""
        i = 0
        while i < len(self._items) and self._items[i].preemptions > 0 and self._items[i].arrival < seq.arrival:
            i += 1
        self._items.insert(i, seq)

    def remove(self, seq: Sequence) -> bool:
        """Drop `seq` from the queue; False if it was not there."""
        try:
            self._items.remove(seq)
        except ValueError:
            return False
        return True

    def peek(self) -> Sequence | None:
        """The sequence the next admission should take (None when empty)."""
        if not self._items:
            return None
        head = self._items[0]
        if not self._short_first or head.preemptions > 0:
            return head
        for seq in self._items:
            if seq.skips >= self._max_skips:
                return seq
        for seq in self._items:
            if seq.num_pending <= self._short_tokens:
                return seq
        return head

    def take(self, seq: Sequence) -> None:
        """Remove `seq` for admission; every request it overtook counts one more skip."""
        i = self._items.index(seq)
        for passed in self._items[:i]:
            passed.skips += 1
        del self._items[i]


class SequenceTable:
    """Every sequence not yet forgotten, by id and by request; the running ones in arrival order."""

    def __init__(self) -> None:
        """An empty table."""
        self._by_id: dict[int, Sequence] = {}
        self._by_request: dict[str, list[int]] = {}
        self.running: list[Sequence] = []  # oldest first

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._by_id

    def __getitem__(self, seq_id: int) -> Sequence:
        return self._by_id[seq_id]

    def get(self, seq_id: int) -> Sequence | None:
        """The sequence with this id, or None."""
        return self._by_id.get(seq_id)

    def of_request(self, request_id: str) -> tuple[int, ...]:
        """Seq ids of a request that are not yet forgotten."""
        return tuple(self._by_request.get(request_id, ()))

    def add(self, seq: Sequence) -> None:
        """Remember a new sequence."""
        self._by_id[seq.seq_id] = seq
        self._by_request.setdefault(seq.request_id, []).append(seq.seq_id)

    def forget(self, seq: Sequence) -> None:
        """Drop a finished sequence whose KV is released."""
        del self._by_id[seq.seq_id]
        ids = self._by_request[seq.request_id]
        ids.remove(seq.seq_id)
        if not ids:
            del self._by_request[seq.request_id]

    def start_running(self, seq: Sequence) -> None:
        """Mark `seq` running, keeping the running list in arrival order."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)

    def stop_running(self, seq: Sequence) -> None:
        """Take `seq` out of the running list (its status is the caller's to set)."""
        self.running.remove(seq)

    def newest_victim(self, newer_than: Sequence, spare: set[int]) -> Sequence | None:
        """The newest running sequence after `newer_than` that holds KV, is not in flight and is not
        in `spare` (the wave being planned); None if there is none."""
        for seq in reversed(self.running):
            if seq.arrival <= newer_than.arrival:
                return None
            if seq.table and seq.in_flight_wave is None and seq.seq_id not in spare:
                return seq
        return None
