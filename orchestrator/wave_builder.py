"""One wave being planned: the rows left, the entries in order, and the KV each entry reserves (no torch).

Scheduler.plan() runs the steps in order over the sequences not in flight: a replayed chunk that could
never fit beside the decodes, one token for each decoding sequence, prompt (or recompute) chunks, then
admissions from the waiting queue. Every step spends the same row budget and entry cap; a sequence that
needs KV when no block is free preempts newer sequences through the scheduler's `preempt`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from mesh.core.wave import WaveEntry
from orchestrator.kv_ledger import NO_HIT, KVBlockLedger, PrefixHit
from orchestrator.sequence import Sequence, SequenceStatus, SequenceTable, WaitingQueue


def _decoding(seq: Sequence) -> bool:
    return seq.status is SequenceStatus.RUNNING and seq.num_pending == 1


class WaveBuilder:
    """The wave plan() is filling: `budget` rows left, `entries` and their `tokens`, what it took to fill it."""

    def __init__(self, budget: int, cap: int, ledger: KVBlockLedger, seqs: SequenceTable,
                 preempt: Callable[[Sequence], None]) -> None:
        """An empty wave of at most `cap` entries and `budget` rows over the scheduler's ledger and table."""
        self.budget, self.cap, self.max_rows = budget, cap, budget
        self._ledger, self._seqs, self._preempt = ledger, seqs, preempt
        self.entries: list[WaveEntry] = []
        self.tokens: list[int] = []  # the entries' token ids, concatenated in entry order
        self.planned: set[int] = set()  # seq ids with an entry in this wave
        self.decode_rows = 0  # entries that feed back a generated token (not a prompt's last token)
        self.preempted = 0  # sequences preempted to make KV room for this wave
        self.admitted: list[tuple[int, int]] = []  # (seq id, cached prompt tokens) of each admission
        self.names: dict[int, list[bytes]] = {}  # seq id -> prefix-cache names of the blocks its entry fills
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up in the prefix cache, and found

    def full(self) -> bool:
        """True once the entry cap is reached or no row is left."""
        return len(self.entries) >= self.cap or self.budget < 1

    def add_oversized_replay(self, ready: list[Sequence]) -> None:
        """Step 0: the first replayed chunk that would never fit beside the decodes goes in before them."""
        decoding = sum(1 for s in ready if _decoding(s))
        for seq in ready:
            if (seq.status is SequenceStatus.RUNNING and seq.replay
                    and self.budget - decoding < seq.replay[0] <= self.budget):
                if self._fit_exact(seq, seq.replay[0]):
                    self._put(seq, seq.replay[0])
                break

    def add_decodes(self, ready: list[Sequence]) -> None:
        """Step 1: one token for each decoding sequence, in running order."""
        for seq in ready:
            if self.full():
                break
            if _decoding(seq) and self._fit(seq, 1):
                self.decode_rows += 1 if seq.output_ids else 0
                self._put(seq, 1)

    def add_chunks(self, ready: list[Sequence]) -> None:
        """Step 2: prompt or recompute chunks within the rows left (a replayed chunk keeps its size or waits)."""
        for seq in ready:
            if self.full():
                break
            if seq.status is SequenceStatus.RUNNING and seq.seq_id not in self.planned and seq.num_pending > 1:
                if seq.replay:
                    if seq.replay[0] <= self.budget and self._fit_exact(seq, seq.replay[0]):
                        self._put(seq, seq.replay[0])
                    continue
                n = self._fit(seq, min(seq.num_pending, self.budget))
                if n:
                    self._put(seq, n)

    def add_admissions(self, waiting: WaitingQueue, max_running: int) -> None:
        """Step 3: start waiting sequences in queue order while the wave, the rows, the KV and the lanes allow."""
        while not self.full() and len(self._seqs.running) < max_running:
            seq = waiting.peek()
            if seq is None:
                break
            hit = self._prefix_hit(seq)
            if hit.next_in_flight:  # a wave in flight is computing its next block: take it from the cache later
                break
            self._ledger.acquire(seq, hit)
            n = min(seq.next_chunk(self.budget), self._ledger.capacity(seq))
            if n < 1 or n > self.budget or (seq.replay and n != seq.replay[0]):
                self._ledger.release(seq)
                seq.num_computed = 0
                break
            waiting.take(seq)
            self._seqs.start_running(seq)
            if self._ledger.prefix_cache and not seq.replay and not seq.history:
                self._count_hit(seq)
            self._ledger.reserve(seq, seq.num_computed + n)
            self.admitted.append((seq.seq_id, seq.cached_tokens))
            self._put(seq, n)

    def decode_steps(self, max_steps: int, max_context: int, queued: int, ready: int) -> int:
        """Step 4: decode steps the stations may run for this wave in one call: 1 unless the wave is all sampled
        decodes, none replaying, nothing is `queued`, and it holds every one of the `ready` sequences (those
        not in flight) or is full at its entry cap (the rest go in the other waves in flight); then up to
        `max_steps`, as many as its member with the most max_tokens left needs, within every sequence's context
        and the free KV (never preempting). A member whose max_tokens ends sooner rides the call to its end as a
        padding row: its later samples are dropped (Scheduler.commit) and its KV goes when the wave lands, so a
        spread of lengths does not cut every call at its shortest member (a call's end is a round trip through
        the orchestrator; a padding row costs only its row of each step, and such calls run only while nothing
        waits). Reserves the blocks and widens each entry's table to cover every step."""
        seqs = [self._seqs[e.seq_id] for e in self.entries]
        if (max_steps < 2 or queued or self.admitted or (len(seqs) != ready and len(seqs) < self.cap)
                or any(e.n_tokens != 1 or e.sample is None for e in self.entries) or any(s.replay for s in seqs)):
            return 1
        steps = min([max_steps, max(s.params.max_tokens - len(s.output_ids) for s in seqs)]
                    + [max_context - s.num_tokens for s in seqs])
        ledger = self._ledger
        while steps > 1 and sum(max(0, ledger.blocks_for(s.num_computed + steps) - len(s.table))
                                for s in seqs) > ledger.free:
            steps -= 1
        if steps > 1:
            for s in seqs:
                ledger.reserve(s, s.num_computed + steps)
            self.entries = [replace(e, blocks=tuple(s.table[:ledger.blocks_for(e.start_pos + steps)]))
                            for e, s in zip(self.entries, seqs)]
        return max(steps, 1)

    def _prefix_hit(self, seq: Sequence) -> PrefixHit:
        """The cached blocks a fresh sequence can start on (none for one that replays its entries)."""
        if seq.replay or seq.num_computed or seq.history:
            return NO_HIT
        return self._ledger.lookup(seq.token_slice(0, seq.num_tokens))

    def _count_hit(self, seq: Sequence) -> None:
        """Count a fresh admission's lookup; its cached tokens enter the history as chunks of at most a wave."""
        hit = seq.num_computed
        if not seq.preemptions:  # a sequence preempted before its first commit looks up again, counted once
            self.prefix_queries += len(seq.prompt_ids)
            self.prefix_hits += hit
        seq.cached_tokens = hit
        seq.history = [min(self.max_rows, hit - i) for i in range(0, hit, self.max_rows)]

    def _put(self, seq: Sequence, n: int) -> None:
        """Append `seq`'s next `n` tokens as an entry (sampling only if they reach its last token)."""
        if seq.replay:
            assert seq.replay.pop(0) == n, "a replayed entry must keep its original size"
        end = seq.num_computed + n
        held = self._ledger.blocks_for(end)  # the table may hold more (reserved for a longer entry of an aborted wave)
        self.entries.append(WaveEntry(seq.seq_id, seq.num_computed, n, seq.params if end == seq.num_tokens else None,
                                      tuple(seq.table[:held])))
        if self._ledger.prefix_cache:  # marked at once, so a later admission of this wave waits for them too
            self.names[seq.seq_id] = names = self._ledger.names_filled(seq, end)
            self._ledger.computing(names, +1)
        self.tokens.extend(seq.token_slice(seq.num_computed, end))
        self.planned.add(seq.seq_id)
        self.budget -= n

    def _fit(self, seq: Sequence, want: int) -> int:
        """Reserve KV for up to `want` more tokens of `seq`, preempting newer sequences if no block
        is free; returns the tokens granted (0: skip it this wave)."""
        while True:
            room = self._ledger.capacity(seq)
            if room >= 1:
                n = min(want, room)
                self._ledger.reserve(seq, seq.num_computed + n)
                return n
            if not self._preempt_newer(seq):
                return 0

    def _fit_exact(self, seq: Sequence, want: int) -> bool:
        """Reserve KV for exactly `want` more tokens (preempting newer sequences if need be), or nothing."""
        while self._ledger.capacity(seq) < want:
            if not self._preempt_newer(seq):
                return False
        self._ledger.reserve(seq, seq.num_computed + want)
        return True

    def _preempt_newer(self, seq: Sequence) -> bool:
        """Preempt the newest running sequence newer than `seq` and not in this wave (False: none is)."""
        victim = self._seqs.newest_victim(seq, self.planned)
        if victim is None:
            return False
        self._preempt(victim)
        self.preempted += 1
        return True
