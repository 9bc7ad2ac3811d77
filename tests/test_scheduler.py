"""Scheduler tests with fake station outputs: no model, no torch."""
from __future__ import annotations

import random
import subprocess
import sys
from collections import defaultdict, deque
from pathlib import Path

import pytest

from mesh.core.config import SchedulerConfig
from mesh.core.params import SamplingParams
from mesh.core.wave import SampledToken
from orchestrator.scheduler import AdmissionError, KVLimits, Scheduler, WavePlan
from orchestrator.scheduler_counts import TokenRates

VOCAB, EOS = 1000, 0
REPO = Path(__file__).resolve().parents[1]


def fake_token(seq_id: int, position: int) -> int:
    """A deterministic 'model': the token drawn at `position` depends only on (seq, position)."""
    token = (seq_id * 31 + position * 7) % VOCAB
    return token if token != EOS else 1


def fake_samples(plan: WavePlan) -> list[SampledToken | None]:
    return [SampledToken(fake_token(e.seq_id, e.end_pos), -0.5) if e.sample else None for e in plan.entries]


def make(max_context=8192, kv_blocks=4096, block_tokens=16, **config) -> Scheduler:
    config = {"max_seqs": 4, "max_wave_tokens": 64, "max_queue": 64, **config}
    return Scheduler(SchedulerConfig(**config), KVLimits(max_context, kv_blocks, block_tokens), (EOS,))


class Driver:
    """Drives plan -> fake station -> commit loops and checks the station's KV against the ledger."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.streams: dict[int, list[int]] = defaultdict(list)
        self.reasons: dict[int, str] = {}
        self.station: dict[int, int] = {}  # seq_id -> tokens of KV held by the fake station
        self.preempted: list[int] = []
        self.plans: list[WavePlan] = []
        self.events_per_wave: list[dict[int, int]] = []

    def add(self, seq_id, prompt_len, max_tokens=8, request_id=None, **params) -> None:
        prompt = tuple((seq_id * 13 + i) % (VOCAB - 1) + 1 for i in range(prompt_len))
        self.sched.add(seq_id, request_id or f"req-{seq_id}", prompt, SamplingParams(max_tokens=max_tokens, **params))
        self.prompts[seq_id] = prompt

    def station_blocks(self) -> int:
        bt = self.sched.limits.block_tokens
        return sum(-(-t // bt) for t in self.station.values())

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            assert sid in self.station, f"release of seq {sid} the station does not hold"
            del self.station[sid]

    def plan(self, max_entries=None) -> WavePlan | None:
        plan = self.sched.plan(max_entries)
        preempted = self.sched.take_releases()
        self.preempted.extend(preempted)
        self.release(preempted)
        if plan is None:
            return None
        assert len(plan.token_ids) <= self.sched.config.max_wave_tokens
        assert len({e.seq_id for e in plan.entries}) == len(plan.entries)
        offset = 0
        for e in plan.entries:
            full = self.prompts[e.seq_id] + tuple(self.streams[e.seq_id])
            assert plan.token_ids[offset:offset + e.n_tokens] == full[e.start_pos:e.end_pos]
            assert (e.sample is not None) == (e.end_pos == len(full))
            assert e.start_pos <= self.station.get(e.seq_id, 0)
            self.station[e.seq_id] = max(self.station.get(e.seq_id, 0), e.end_pos)
            offset += e.n_tokens
        assert self.station_blocks() == self.sched.stats().kv_blocks_used <= self.sched.limits.kv_blocks
        self.plans.append(plan)
        return plan

    def commit(self, plan: WavePlan, samples=None):
        result = self.sched.commit(plan, fake_samples(plan) if samples is None else samples)
        got: dict[int, int] = defaultdict(int)
        for ev in result.events:
            assert ev.seq_id not in self.reasons
            self.streams[ev.seq_id].append(ev.token_id)
            got[ev.seq_id] += 1
            if ev.finish_reason:
                self.reasons[ev.seq_id] = ev.finish_reason
        self.events_per_wave.append(dict(got))
        self.release(result.released)
        return result

    def run(self, depth=1, rng=None, max_iters=10_000) -> None:
        """Plan up to `depth` waves ahead, commit them (in random order with `rng`) until idle."""
        in_flight: deque[WavePlan] = deque()
        cap = -(-self.sched.config.max_seqs // depth)
        for _ in range(max_iters):
            if not self.sched.has_work():
                return
            while len(in_flight) < depth and (plan := self.plan(cap if depth > 1 else None)):
                in_flight.append(plan)
            assert in_flight, "work left but nothing could be planned"
            i = rng.randrange(len(in_flight)) if rng else 0
            plan = in_flight[i]
            del in_flight[i]
            self.commit(plan)
        raise AssertionError("did not finish")

    def assert_idle(self) -> None:
        s = self.sched.stats()
        assert (s.kv_blocks_used, s.running, s.waiting, s.in_flight_waves) == (0, 0, 0, 0)
        assert self.station == {} and not self.sched.has_work()


def admission_order(d: Driver) -> list[int]:
    seen: list[int] = []
    for plan in d.plans:
        seen += [e.seq_id for e in plan.entries if e.seq_id not in seen]
    return seen


def expected_stream(seq_id: int, prompt_len: int, max_tokens: int) -> list[int]:
    return [fake_token(seq_id, prompt_len + i) for i in range(max_tokens)]


def test_fifo_admission_order():
    d = Driver(make(max_seqs=1))
    for sid, n in enumerate([30, 3, 12, 2]):
        d.add(sid, n, max_tokens=3)
    d.run()
    assert admission_order(d) == [0, 1, 2, 3]
    assert all(d.streams[sid] == expected_stream(sid, n, 3) for sid, n in enumerate([30, 3, 12, 2]))
    d.assert_idle()


def test_short_first_with_ageing():
    d = Driver(make(max_seqs=1, short_first=True, short_prompt_tokens=4, max_skips=2))
    d.add(0, 40, max_tokens=2)
    for sid in range(1, 6):
        d.add(sid, 3, max_tokens=2)
    d.run()
    assert admission_order(d) == [1, 2, 0, 3, 4, 5]  # the long prompt waits exactly max_skips admissions
    d.assert_idle()


def test_long_prompt_chunked_while_three_decode_every_wave():
    budget = 256
    d = Driver(make(max_wave_tokens=budget))
    for sid in range(3):
        d.add(sid, 4, max_tokens=200)
    d.add(3, 5000, max_tokens=2)
    d.commit(d.plan())  # admits all four; the three short prompts sample their first token
    chunk_waves = 0
    while d.sched.stats().running == 4 and chunk_waves < 100:
        plan = d.plan()
        by_seq = {e.seq_id: e for e in plan.entries}
        assert len(plan.token_ids) <= budget
        assert [by_seq[s].n_tokens for s in range(3)] == [1, 1, 1]
        if by_seq[3].sample is None:
            assert by_seq[3].n_tokens == budget - 3  # the rest of the budget goes to the long read
            chunk_waves += 1
        d.commit(plan)
        assert {s: d.events_per_wave[-1].get(s) for s in range(3)} == {0: 1, 1: 1, 2: 1}
        if by_seq[3].sample is not None:
            break
    assert chunk_waves == (5000 - (budget - 12)) // (budget - 3)
    d.run()
    assert d.streams[3] == expected_stream(3, 5000, 2)
    d.assert_idle()


def test_budget_shared_across_prompts_and_max_seqs():
    d = Driver(make(max_seqs=3, max_wave_tokens=64))
    for sid in range(6):
        d.add(sid, 40, max_tokens=5)
    first = d.plan()
    assert [(e.seq_id, e.n_tokens) for e in first.entries] == [(0, 40), (1, 24)]
    d.commit(first)
    second = d.plan()
    assert [(e.seq_id, e.n_tokens) for e in second.entries] == [(0, 1), (1, 16), (2, 40)]
    d.commit(second)
    while d.sched.has_work():
        plan = d.plan()
        assert len(plan.entries) <= 3 and d.sched.stats().running <= 3
        d.commit(plan)
    assert all(d.streams[s] == expected_stream(s, 40, 5) for s in range(6))
    assert d.sched.stats().finished == {"length": 6}
    d.assert_idle()


def test_cancel_in_every_state():
    d = Driver(make(max_seqs=3, max_wave_tokens=64))
    d.add(0, 10, max_tokens=50)   # will be decoding
    d.add(1, 10, max_tokens=50)   # will be in flight
    d.add(2, 200, max_tokens=5)   # will be mid-prefill
    d.add(3, 10, max_tokens=5)    # stays waiting (max_seqs=3)
    d.commit(d.plan())
    d.commit(d.plan())
    s = d.sched
    assert s.cancel("req-3") == () and s.stats().waiting == 0
    assert 0 < d.station[2] < 200 and s.cancel("req-2") == (2,)
    d.release((2,))
    assert d.streams[0] and s.cancel("req-0") == (0,)
    d.release((0,))
    plan = d.plan()
    assert [e.seq_id for e in plan.entries] == [1]
    assert s.cancel("req-1") == ()
    result = d.commit(plan)
    assert result.events == () and result.released == (1,) and result.finished == ()
    assert s.stats().finished == {"cancelled": 4} and s.cancel("no-such") == ()
    d.assert_idle()


def test_finish_by_engine_and_stop_tokens():
    d = Driver(make())
    d.add(0, 5, max_tokens=50)
    d.add(1, 5, max_tokens=50, stop_token_ids=(fake_token(1, 7),))
    d.add(2, 5, max_tokens=3)
    plan = d.plan()
    samples = fake_samples(plan)
    samples[2] = SampledToken(EOS)
    d.commit(plan, samples)
    assert d.reasons == {2: "stop"}
    d.commit(d.plan())
    assert d.sched.finish(0, "stop") == (0,)
    d.release((0,))
    d.commit(d.plan())
    assert d.reasons == {2: "stop", 1: "stop"} and d.streams[1][-1] == fake_token(1, 7)
    d.assert_idle()


def test_preemption_recomputes_to_identical_streams():
    def run(kv_blocks):
        d = Driver(make(max_context=64, kv_blocks=kv_blocks, block_tokens=4, max_seqs=3, max_wave_tokens=16))
        for sid in range(3):
            d.add(sid, 8, max_tokens=20)
        d.run()
        d.assert_idle()
        return d

    ample, tight = run(1000), run(10)
    assert ample.sched.stats().preemptions == 0 and tight.sched.stats().preemptions > 0
    assert tight.preempted[0] == 2  # the newest sequence goes first
    assert tight.streams == ample.streams
    assert tight.sched.stats().finished == {"length": 3}


def test_preempted_sequence_resumes_from_front_with_its_output():
    d = Driver(make(max_context=64, kv_blocks=6, block_tokens=4, max_seqs=2, max_wave_tokens=32))
    d.add(0, 12, max_tokens=10)
    d.add(1, 12, max_tokens=10)
    d.add(2, 3, max_tokens=1)
    d.commit(d.plan())  # 3 + 3 blocks: full
    plan = d.plan()  # seq 0 needs a 4th block for position 12: the newer seq 1 is preempted
    assert d.preempted == [1] and [e.seq_id for e in plan.entries] == [0]
    assert d.sched.stats().waiting == 2 and d.sched.stats().preemptions == 1
    d.commit(plan)
    d.run()
    resumed = next(e for p in d.plans[2:] for e in p.entries if e.seq_id == 1)
    assert resumed.start_pos == 0 and resumed.sample is None  # re-reads prompt + output from 0
    assert admission_order(d) == [0, 1, 2] and d.streams[1] == expected_stream(1, 12, 10)
    d.assert_idle()


def test_refusals_and_stats():
    s = make(max_context=100, kv_blocks=4, block_tokens=16, max_queue=2)
    cases = [((), 16, "invalid", 400, "prompt"), ((1,) * 90, 20, "never_fits", 400, "max_tokens"),
             ((1,) * 100, 1, "never_fits", 400, "prompt"), ((1,) * 60, 10, "never_fits", 400, "max_tokens")]
    for i, (prompt, max_tokens, reason, status, param) in enumerate(cases):
        with pytest.raises(AdmissionError) as err:
            s.add(i, "r", prompt, SamplingParams(max_tokens=max_tokens))
        assert (err.value.reason, err.value.status, err.value.param) == (reason, status, param)
    with pytest.raises(AdmissionError, match=r"110 tokens exceeds the context of 100"):
        s.add(9, "r", (1,) * 90, SamplingParams(max_tokens=20))
    for sid in range(10, 16):  # the bound is max_seqs (4) + max_queue (2) live sequences
        s.add(sid, f"r{sid}", (1, 2), SamplingParams(max_tokens=4))
    with pytest.raises(AdmissionError) as err:
        s.add(16, "c", (1, 2), SamplingParams())
    assert (err.value.reason, err.value.status) == ("queue_full", 503)
    assert s.stats().refusals == {"never_fits": 4, "queue_full": 1, "invalid": 1}
    d = Driver(s)
    d.prompts.update({sid: (1, 2) for sid in range(10, 16)})
    d.run()
    st = s.stats()
    assert st.finished == {"length": 6} and st.decode_tokens == 6 * 3 and st.prefill_tokens == 12
    assert st.last_wave_tokens == 2 and st.max_wave_entries == 4
    assert 0 < st.mean_wave_occupancy <= st.max_wave_occupancy == 8 / 64


def test_token_rates_over_the_window():
    """The engine's rates: tokens since the oldest commit kept, per second; marks older than the window dropped."""
    rates = TokenRates(window_s=10.0)
    assert rates.rates(5.0, 100, 100) == (0.0, 0.0)  # no commit yet
    rates.mark(0.0, 0, 0)
    rates.mark(4.0, 40, 8)
    assert rates.rates(4.0, 40, 8) == (10.0, 2.0)
    rates.mark(12.0, 100, 40)  # the mark at 0 s is now 12 s old: the window starts at 4 s
    assert rates.rates(12.0, 100, 40) == (60 / 8, 32 / 8)
    rates.mark(30.0, 100, 40)  # only itself within the window
    assert rates.rates(32.0, 120, 40) == (10.0, 0.0)


def test_burst_up_to_lanes_plus_queue_is_admitted_and_the_excess_refused():
    """A burst fills the free lanes and the queue before any plan() moves it: exactly max_seqs + max_queue."""
    s = make(max_seqs=4, max_queue=2)
    for sid in range(6):
        s.add(sid, f"r{sid}", (1, 2, 3), SamplingParams(max_tokens=8))
    refused = 0
    for sid in range(6, 9):
        with pytest.raises(AdmissionError) as err:
            s.add(sid, f"r{sid}", (1, 2, 3), SamplingParams(max_tokens=8))
        refused += err.value.reason == "queue_full"
    assert refused == 3
    plan = s.plan()
    assert len(plan.entries) == 4 and s.stats().waiting == 2
    with pytest.raises(AdmissionError):  # lanes taken, queue full: still the same bound
        s.add(9, "r9", (1, 2, 3), SamplingParams(max_tokens=8))
    s.cancel("r0")
    s.add(10, "r10", (1, 2, 3), SamplingParams(max_tokens=8))  # a place came free


def test_probe_takes_no_place_and_goes_first():
    """A health probe is admitted past the bound, runs in a lane of its own, and frees nothing it did not take."""
    d = Driver(make(max_seqs=2, max_queue=1))
    for sid in range(3):
        d.add(sid, 3, max_tokens=8)
    d.sched.add(99, "probe", (1,), SamplingParams(max_tokens=1), probe=True)
    d.prompts[99] = (1,)
    with pytest.raises(AdmissionError):
        d.add(3, 3)
    first = d.plan()
    assert [e.seq_id for e in first.entries] == [99, 0, 1]  # first, and beside both lanes
    d.commit(first)
    assert d.reasons[99] == "length"
    with pytest.raises(AdmissionError):  # the probe's end frees no user's place
        d.add(3, 3)
    d.run()
    d.assert_idle()


def test_several_waves_in_flight_out_of_order_commits():
    d = Driver(make(max_seqs=4))
    for sid in range(4):
        d.add(sid, 6, max_tokens=4)
    a, b = d.plan(2), d.plan(2)
    assert not {e.seq_id for e in a.entries} & {e.seq_id for e in b.entries}
    assert d.plan(2) is None and d.sched.stats().in_flight_waves == 2
    d.commit(b)
    d.commit(a)
    with pytest.raises(ValueError):
        d.sched.commit(a, fake_samples(a))
    d.run(depth=3, rng=random.Random(1))
    assert all(d.streams[s] == expected_stream(s, 6, 4) for s in range(4))
    d.assert_idle()


def test_aborted_wave_is_replanned_identically():
    d = Driver(make())
    d.add(0, 20, max_tokens=3)
    d.add(1, 5, max_tokens=3)
    plan = d.plan()
    d.sched.cancel("req-1")
    d.sched.abort_wave(plan)
    d.release(d.sched.take_releases())
    again = d.plan()
    assert again.entries == plan.entries[:1] and again.wave_id != plan.wave_id
    d.commit(again)
    d.run()
    d.assert_idle()


@pytest.mark.parametrize("seed", range(6))
def test_no_leak_after_random_mix(seed):
    rng = random.Random(seed)
    d = Driver(make(max_context=256, kv_blocks=24, block_tokens=8, max_seqs=5, max_wave_tokens=48,
                    short_first=seed % 2 == 1, short_prompt_tokens=10, max_skips=2))
    in_flight: list[WavePlan] = []
    for step in range(3000):
        if step < 200 and rng.random() < 0.3:
            try:
                d.add(step, rng.randint(1, 90), max_tokens=rng.randint(1, 60))
            except AdmissionError as e:
                assert e.reason in ("never_fits", "queue_full")
        live = sorted({sid for sid in d.prompts if sid not in d.reasons})
        if live and rng.random() < 0.05:
            d.release(d.sched.cancel(f"req-{rng.choice(live)}"))
        if live and rng.random() < 0.03:
            d.release(d.sched.finish(rng.choice(live), "stop"))
        if len(in_flight) < 2 and (plan := d.plan(3)):
            in_flight.append(plan)
        if in_flight and rng.random() < 0.7:
            plan = in_flight.pop(rng.randrange(len(in_flight)))
            if rng.random() < 0.05:
                d.sched.abort_wave(plan)
                d.release(d.sched.take_releases())
            else:
                d.commit(plan)
        if step > 200 and not in_flight and not d.sched.has_work():
            break
    for plan in in_flight:
        d.commit(plan)
    d.run()
    d.assert_idle()


def test_scheduler_does_not_import_torch():
    code = "import sys, orchestrator.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_recompute_replays_the_original_entry_sizes():
    """After a rebase (or preemption) a sequence's KV is rebuilt with exactly the entries that first built
    it (prompt chunks, then one row per generated token), so the stations compute bit-identical KV."""
    s = make(max_wave_tokens=16, max_seqs=4)
    s.add(0, "r0", tuple(range(1, 40)), SamplingParams(max_tokens=6, ignore_eos=True))
    seen: dict[int, list[int]] = {}
    first = None
    for _ in range(40):
        plan = s.plan()
        if plan is None:
            break
        for e in plan.entries:
            seen.setdefault(e.seq_id, []).append(e.n_tokens)
        s.commit(plan, fake_samples(plan))
        if first is None and len(seen[0]) == 6:  # mid-stream: move to a new route
            first = list(seen[0])
            s.rebase(KVLimits(8192, 4096, 16))
            seen[0] = []
    assert first == [16, 16, 7, 1, 1, 1]
    assert seen[0][: len(first)] == first and seen[0][len(first):] == [1, 1]  # replay, then the last 2 tokens
    assert s.stats().running == 0 and s.stats().kv_blocks_used == 0
