"""The prefix cache in the scheduler's ledger, with a fake station that keeps each block's tokens: no model, no torch.

The fake station stores, for every block id the entries name, the token of each position written into it, and
checks that every position an entry reads (below its start) holds that sequence's own token: a cached block that
served another prefix, or a block overwritten while shared, fails the test.
"""
from __future__ import annotations

import random
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.core.config import SchedulerConfig
from mesh.core.params import SamplingParams
from mesh.core.wave import SampledToken
from orchestrator.kv_ledger import KVBlockLedger, block_name
from orchestrator.scheduler import AdmissionError, KVLimits, Scheduler, WavePlan
from orchestrator.sequence import Request, Sequence


def make(kv_blocks=256, block_tokens=16, cache=True, **config) -> Scheduler:
    config = {"max_seqs": 8, "max_wave_tokens": 64, "max_queue": 64, "prefix_cache": cache, **config}
    return Scheduler(SchedulerConfig(**config), KVLimits(8192, kv_blocks, block_tokens, True), (0,))


class BlockStation:
    """A fake station: block id -> the tokens written at each of its offsets; seq id -> its block table."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.bt = sched, sched.limits.block_tokens
        self.content: dict[int, list[int | None]] = defaultdict(lambda: [None] * self.bt)
        self.tables: dict[int, tuple[int, ...]] = {}
        self.tokens: dict[int, tuple[int, ...]] = {}  # seq id -> prompt + output so far
        self.streams: dict[int, list[int]] = defaultdict(list)
        self.computed_rows = 0

    def add(self, seq_id: int, prompt: tuple[int, ...], max_tokens: int, temperature: float = 0.0) -> None:
        self.sched.add(seq_id, f"r{seq_id}", prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                                    seed=seq_id, ignore_eos=True))
        self.tokens[seq_id] = prompt

    def forward(self, plan: WavePlan) -> list[SampledToken | None]:
        """Check every read against what was written, then write the entry's rows."""
        written = {}
        for e in plan.entries:
            full, table = self.tokens[e.seq_id], e.blocks
            assert len(table) == -(-e.end_pos // self.bt)
            for p in range(e.start_pos):  # what the entry's rows attend to: its own tokens, or stale KV
                assert self.content[table[p // self.bt]][p % self.bt] == full[p], (e.seq_id, p)
            for p in range(e.start_pos, e.end_pos):
                block = table[p // self.bt]
                assert written.setdefault(block, e.seq_id) == e.seq_id, "two entries write one block"
                for other, t in self.tables.items():
                    assert other == e.seq_id or block not in t, f"block {block} written while seq {other} holds it"
                self.content[block][p % self.bt] = full[p]
            self.tables[e.seq_id] = table
            self.computed_rows += e.n_tokens
        return [SampledToken((e.seq_id * 31 + e.end_pos * 7) % 997 + 1) if e.sample else None for e in plan.entries]

    def commit(self, plan: WavePlan) -> None:
        result = self.sched.commit(plan, self.forward(plan))
        for ev in result.events:
            self.streams[ev.seq_id].append(ev.token_id)
            self.tokens[ev.seq_id] += (ev.token_id,)
        self.release(result.released)

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            self.tables.pop(sid, None)

    def plan(self) -> WavePlan | None:
        plan = self.sched.plan()
        self.release(self.sched.take_releases())
        self.sched._ledger.check()
        return plan

    def run(self, max_waves=2000) -> None:
        for _ in range(max_waves):
            if not self.sched.has_work():
                return
            plan = self.plan()
            assert plan is not None, "work left but nothing could be planned"
            self.commit(plan)
            self.sched._ledger.check()
        raise AssertionError("did not finish")


def _prompt(prefix_len: int, suffix: int, n: int) -> tuple[int, ...]:
    return tuple(range(1, prefix_len + 1)) + tuple(1000 + 50 * suffix + i for i in range(n))


def test_block_names_chain_from_token_zero():
    a = block_name(block_name(b"root", [1, 2]), [3, 4])
    assert a == block_name(block_name(b"root", (1, 2)), (3, 4))
    assert a != block_name(block_name(b"root", [1, 3]), [3, 4]) and len(a) == 16


def test_shared_prefix_is_computed_once_in_sequence_and_together():
    """12 prompts with one 200-token prefix: the 12 full blocks are computed once, the hit counter shows 11 x 192."""
    for together in (False, True):
        sched = make()
        station = BlockStation(sched)
        for i in range(12):
            station.add(i, _prompt(200, i, 5 + i), max_tokens=6)
            if not together:
                station.run()
        station.run()
        s = sched.stats()
        assert s.prefix_cache_hits == 11 * 192, together
        assert s.prefix_cache_queries == sum(205 + i for i in range(12))
        assert station.computed_rows == sum(205 + i + 5 for i in range(12)) - 11 * 192
        assert s.kv_blocks_used == 0 and s.kv_blocks_cached > 0
        assert all(len(v) == 6 for v in station.streams.values())


def test_whole_prompt_cached_still_computes_its_last_token():
    sched = make()
    station = BlockStation(sched)
    station.add(0, _prompt(32, 0, 0), max_tokens=2)
    station.run()
    station.add(1, _prompt(32, 0, 0), max_tokens=2)
    plan = station.plan()
    (entry,) = plan.entries
    assert (entry.start_pos, entry.n_tokens) == (16, 16)  # one full block reused; the rest computed
    station.commit(plan)
    station.run()
    assert len(station.streams[1]) == 2
    assert sched.stats().prefix_cache_hits == 16


def test_cache_off_and_inexact_stations_never_share():
    for sched in (make(cache=False), Scheduler(SchedulerConfig(max_seqs=8, max_wave_tokens=64),
                                               KVLimits(8192, 256, 16, False), (0,))):
        station = BlockStation(sched)
        station.add(0, _prompt(64, 0, 3), 2)
        station.run()
        station.add(1, _prompt(64, 1, 3), 2)
        station.run()
        assert sched.stats().prefix_cache_hits == 0 and not sched.prefix_cache
        assert station.computed_rows == 2 * (67 + 1)


def test_eviction_takes_least_recent_and_never_a_referenced_block():
    sched = make(kv_blocks=12, max_seqs=2)
    station = BlockStation(sched)
    station.add(0, _prompt(64, 0, 8), 4)  # 5 blocks, 4 named
    station.run()
    station.add(1, _prompt(0, 1, 100), 4)  # 7 blocks, named too: 11 of 12 cached
    station.run()
    assert sched.stats().kv_blocks_cached == 10
    station.add(2, _prompt(64, 2, 8), 60)  # hits seq 0's 4 blocks, needs 5 more: evicts seq 1's first
    plan = station.plan()
    assert plan.entries[0].start_pos == 64
    station.commit(plan)
    station.run()
    assert sched.stats().prefix_cache_hits == 64 and sched._ledger.evictions > 0
    station.add(3, _prompt(64, 3, 1), 2)  # seq 0's prefix survived the eviction (its root released last)
    station.run()
    assert sched.stats().prefix_cache_hits == 128


def test_a_budget_full_of_cached_blocks_admits_by_evicting():
    sched = make(kv_blocks=8, max_seqs=1)
    station = BlockStation(sched)
    station.add(0, _prompt(0, 0, 120), 8)  # 8 blocks: 7 named, all cached at the end
    station.run()
    station.add(1, _prompt(0, 1, 120), 8)  # a different prompt of the whole budget
    station.run()
    assert station.streams[1] and sched.stats().refusals["never_fits"] == 0


def test_preemption_and_cancel_keep_shared_blocks_for_their_other_holders():
    sched = make(kv_blocks=14, max_seqs=6, max_wave_tokens=32)
    station = BlockStation(sched)
    station.add(0, _prompt(96, 0, 4), 4)
    station.run()
    for i in range(1, 6):
        station.add(i, _prompt(96, i, 4 + i), 40)
    for _ in range(6):
        station.commit(station.plan())
    station.release(sched.cancel("r2"))  # it holds the shared blocks with the others
    station.run()
    assert sched.stats().preemptions > 0
    assert all(len(station.streams[i]) == 40 for i in (1, 3, 4, 5))
    assert sched.stats().kv_blocks_used == 0


def test_an_aborted_wave_names_nothing():
    sched = make()
    station = BlockStation(sched)
    station.add(0, _prompt(64, 0, 1), 2)
    plan = station.plan()
    sched.abort_wave(plan)
    station.add(1, _prompt(64, 1, 1), 2)
    station.run()
    assert sched.stats().prefix_cache_hits == 64  # seq 1 found seq 0's blocks once they were committed


def test_rebase_drops_the_cache():
    sched = make()
    station = BlockStation(sched)
    station.add(0, _prompt(64, 0, 1), 2)
    station.run()
    assert sched.stats().kv_blocks_cached
    sched.rebase(KVLimits(8192, 256, 16, True))
    assert sched.stats().kv_blocks_cached == 0
    station = BlockStation(sched)  # new stations: nothing in their blocks
    station.add(1, _prompt(64, 1, 1), 2)
    station.run()
    assert sched.stats().prefix_cache_hits == 0


def test_ledger_refuses_to_start_a_sequence_twice():
    ledger = KVBlockLedger(4, 16, True)
    seq = Sequence(0, Request("r", (1, 2), SamplingParams()), 0)
    ledger.reserve(seq, 2)
    with pytest.raises(ValueError, match="already holds"):
        ledger.acquire(seq, ledger.lookup((1, 2)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_ledger_invariants_hold_over_random_shared_prompts(data):
    """Random prompts from a few shared prefixes, random arrivals, cancels and aborts, waves committed in random
    order: after every plan and commit the ledger's invariants hold, no read sees another prefix's KV, and at
    the end no block is referenced."""
    bt = data.draw(st.sampled_from([4, 16]))
    sched = make(kv_blocks=data.draw(st.integers(12, 60)), block_tokens=bt, max_seqs=data.draw(st.integers(1, 6)),
                 max_wave_tokens=data.draw(st.sampled_from([16, 48])))
    station = BlockStation(sched)
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    prefixes = [tuple(rng.randrange(1, 500) for _ in range(rng.randrange(0, 70))) for _ in range(3)]
    pending = [(rng.choice(prefixes) + tuple(rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))),
                rng.randrange(1, 12)) for _ in range(data.draw(st.integers(2, 10)))]
    in_flight: list[WavePlan] = []
    for _ in range(3000):
        if pending and rng.random() < 0.3:
            prompt, max_tokens = pending.pop()
            try:
                station.add(len(station.tokens), prompt, max_tokens, temperature=rng.choice([0.0, 0.9]))
            except AdmissionError:
                pass
        if station.tokens and rng.random() < 0.03:
            station.release(sched.cancel(f"r{rng.randrange(len(station.tokens))}"))
        while len(in_flight) < 2 and (plan := station.plan()) is not None:
            in_flight.append(plan)
        if in_flight:
            plan = in_flight.pop(rng.randrange(len(in_flight)))
            if rng.random() < 0.05:
                sched.abort_wave(plan)
                station.release(sched.take_releases())
            else:
                station.commit(plan)
            sched._ledger.check()
        elif not pending:
            break
    assert not sched.has_work() and not pending
    s = sched.stats()
    assert s.kv_blocks_used == 0 and s.kv_blocks_cached <= sched.limits.kv_blocks
    assert s.prefix_cache_hits <= s.prefix_cache_queries
