"""Make before break (issue 14): the new route catches up while the old one decodes, then switches with a
short chunk per sequence left; every stream's tokens equal a cluster that never changed."""
from __future__ import annotations

import statistics
import threading
import time

import pytest

from mesh.core.config import ModelConfig, SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from orchestrator.catchup import CatchUp
from orchestrator.engine import CatchUpFailed, Engine
from orchestrator.kv_ledger import KVBlockLedger
from orchestrator.metrics import MetricsRegistry
from orchestrator.pipeline import LocalLink, StationDown
from orchestrator.sequence import Request, Sequence, SequenceStatus
from reference import reference_tokens
from station.step import Station

KV = 64 * 2**20
MAX_TOKENS = 700  # long enough that every stream still decodes at the third switch (each catch-up takes ~100)


def _jobs(n=16, prompt=300, max_tokens=160):
    """n/2 greedy and n/2 seeded streams with `prompt`-token prompts."""
    prompts = [[1] + [(31 * i + 7 * j) % 500 + 5 for j in range(prompt - 1)] for i in range(n)]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.9,
                             seed=500 + i) for i in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Every stream on one full-model station that never changed (tests/reference.py)."""
    return reference_tokens(tiny_llama, *_jobs(max_tokens=MAX_TOKENS))


def _links(model_dir, ranges, kv_bytes=KV):
    return [LocalLink(Station(model_dir, StationSpec(layers=r, kv_bytes=kv_bytes))) for r in ranges]


class _Follower:
    """Timestamps every token of every stream (one reader per stream)."""

    def __init__(self, streams):
        self.times = [[] for _ in streams]
        self.threads = [threading.Thread(target=self._follow, args=(i, s), daemon=True) for i, s in enumerate(streams)]
        self.tokens = [[] for _ in streams]
        for t in self.threads:
            t.start()

    def _follow(self, i, stream):
        for ev in stream:
            if ev.token_ids:
                self.times[i].append(time.monotonic())
                self.tokens[i].extend(ev.token_ids)

    def wait(self, n, timeout=120):
        deadline = time.monotonic() + timeout
        while min(len(t) for t in self.times) < n and time.monotonic() < deadline:
            time.sleep(0.005)
        assert min(len(t) for t in self.times) >= n, "streams stalled"

    def join(self, timeout=300):
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads)


@pytest.mark.parametrize("source", ["copy", "recompute"])
def test_scale_1_2_3_1_catches_up_while_decoding(tiny_llama, reference, source):
    """1 -> 2 -> 3 -> 1 mid-stream, 8 greedy + 8 seeded streams of 300-token prompts: identical tokens; while each
    new route caught up the old one committed tokens of every stream, and at each switch every sequence had at
    most one short chunk left (all of them together within one wave)."""
    prompts, params = _jobs(max_tokens=MAX_TOKENS)
    cfg = ModelConfig.from_dir(tiny_llama)
    sched = SchedulerConfig(max_seqs=16, max_wave_tokens=512, catchup_wave_tokens=96, catchup_slowdown=0,
                            catchup_kv=source)
    engine = Engine(_links(tiny_llama, ((0, 6),)), cfg, sched)
    try:
        follow = _Follower([engine.submit(p, sp) for p, sp in zip(prompts, params)])
        routes = (((0, 3), (3, 6)), ((0, 2), (2, 4), (4, 6)), ((0, 6),))
        switch_at = []
        for step, ranges in enumerate(routes):
            links = _links(tiny_llama, ranges)  # loaded beside the serving route
            follow.wait(min(len(t) for t in follow.times) + 10)
            switch_at.append(time.monotonic())
            report = engine.switch_route(links)
            live = set(report.residual)
            print(f"\nswitch to {len(ranges)} station(s): catch-up {report.catchup_seconds * 1e3:.0f} ms, "
                  f"{report.catchup_waves} waves, {report.catchup_tokens} tokens; pause {report.pause_seconds * 1e3:.1f} ms;"
                  f" residual max {max(report.residual.values())}; engine pause {engine.switch_pauses.pauses[-1:]}")
            assert report.mode == "catchup" and report.kv_source == source and report.replayed == () and len(live) == 16
            assert all(report.decoded_during_catchup.get(s, 0) >= 1 for s in live), report.decoded_during_catchup
            old_depth = 1 if step == 0 else len(routes[step - 1])
            # a copy ends with the rest copied after the drain: the sampled token alone; a recompute leaves at
            # most the loosest lag limit + the drained waves + the sampled one
            limit = 1 if source == "copy" else 16 + old_depth + 1
            assert max(report.residual.values()) <= limit and sum(report.residual.values()) <= sched.max_wave_tokens
        follow.join()
        assert follow.tokens == reference
        gaps = [b - a for t in follow.times for a, b in zip(t, t[1:])]
        median = statistics.median(gaps)
        for at, pause in zip(switch_at, engine.stats().route_switch_pauses):
            longest = max(b - a for t in follow.times for a, b in zip(t, t[1:]) if b >= at)
            print(f"switch: engine pause {pause * 1e3:.1f} ms, longest gap after {longest * 1e3:.1f} ms, "
                  f"median gap {median * 1e3:.2f} ms")
        s = engine.stats()
        assert s.route_switches == 3 and s.route_catchup is None and s.route_catchup_tokens >= 16 * 300 * 3
        assert s.route_replayed_sequences == 0
        assert engine.quiesce(30) and engine.stats().kv_bytes_used == 0
    finally:
        engine.close()


def test_new_route_without_room_falls_back_for_the_sequences_that_do_not_fit(tiny_llama, reference):
    """New stations whose KV holds about half the live sequences: those re-prefill after the switch (counted in
    the metric), the rest move by catch-up, and every token is unchanged."""
    prompts, params = _jobs(max_tokens=MAX_TOKENS)
    cfg = ModelConfig.from_dir(tiny_llama)
    engine = Engine(_links(tiny_llama, ((0, 6),)), cfg, SchedulerConfig(max_seqs=16, max_wave_tokens=512))
    try:
        follow = _Follower([engine.submit(p, sp) for p, sp in zip(prompts, params)])
        per_token = 2 * 3 * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, 3 layers, float32
        small = _links(tiny_llama, ((0, 3), (3, 6)), kv_bytes=8 * 480 * per_token)
        follow.wait(10)
        report = engine.switch_route(small)
        assert report.mode == "catchup" and 0 < len(report.replayed) < 16, report.replayed
        follow.join()
        assert follow.tokens == reference
        s = engine.stats()
        assert s.route_replayed_sequences == len(report.replayed)
        text = MetricsRegistry(lambda: s).render().decode()
        assert f"wavemesh_route_replayed_sequences_total {float(len(report.replayed))}" in text
        assert "wavemesh_route_catchup_tokens_total" in text
    finally:
        engine.close()


def test_station_in_both_routes_and_pause_setting_use_pause_and_re_prefill(tiny_llama):
    """A route that keeps a station of the old one (it would hold two copies of a sequence) and the `pause`
    setting switch by pause and re-prefill, saying why; tokens unchanged."""
    prompts, params = _jobs(4, prompt=40, max_tokens=60)
    ref = reference_tokens(tiny_llama, prompts, params)
    cfg = ModelConfig.from_dir(tiny_llama)
    for mode in ("catchup", "pause"):
        links = _links(tiny_llama, ((0, 3), (3, 6)))
        engine = Engine(links, cfg, SchedulerConfig(max_seqs=4, max_wave_tokens=64, route_switch=mode))
        try:
            follow = _Follower([engine.submit(p, sp) for p, sp in zip(prompts, params)])
            follow.wait(5)
            report = engine.switch_route(_links(tiny_llama, ((0, 3),)) + [links[1]])
            assert report.mode == "pause"
            assert ("serve both routes" if mode == "catchup" else "route_switch is pause") in report.reason
            follow.join()
            assert follow.tokens == ref
            assert engine.stats().route_replayed_sequences == len(report.replayed) > 0
        finally:
            engine.close()


@pytest.mark.parametrize("source", ["copy", "recompute"])
def test_catchup_past_its_deadline_is_abandoned_and_the_old_route_serves_on(tiny_llama, reference, source):
    """A re-plan whose new route has not caught up by the deadline raises CatchUpFailed naming it; the old route
    never stopped, and every token is unchanged."""
    prompts, params = _jobs(max_tokens=MAX_TOKENS)
    cfg = ModelConfig.from_dir(tiny_llama)
    old = _links(tiny_llama, ((0, 6),))
    engine = Engine(old, cfg, SchedulerConfig(max_seqs=16, max_wave_tokens=512, catchup_wave_tokens=16,
                                              catchup_copy_tokens=16, catchup_kv=source))
    try:
        follow = _Follower([engine.submit(p, sp) for p, sp in zip(prompts, params)])
        follow.wait(5)
        with pytest.raises(CatchUpFailed, match=r"did not catch up within 0 s"):
            engine.switch_route(_links(tiny_llama, ((0, 3), (3, 6))), timeout=0.2)
        assert engine.pipeline.links == old and engine.stats().route_catchup is None
        follow.join()
        assert follow.tokens == reference
    finally:
        engine.close()


class _Failing(LocalLink):
    """An in-process station whose forward fails with StationDown once `armed` is set."""

    def __init__(self, station):
        super().__init__(station)
        self.armed = threading.Event()

    def _check(self):
        if self.armed.is_set():
            raise StationDown("station lost (test)")

    def forward(self, wave_id, entries, token_ids, hidden, steps=1):
        self._check()
        return super().forward(wave_id, entries, token_ids, hidden, steps)

    def export_kv(self, entries, layer_start, layer_end):
        self._check()
        return super().export_kv(entries, layer_start, layer_end)

    def import_kv(self, entries, k, v):
        self._check()
        super().import_kv(entries, k, v)


@pytest.mark.parametrize("source", ["copy", "recompute"])
@pytest.mark.parametrize("which", ["new", "old"])
def test_station_lost_during_catchup(tiny_llama, reference, which, source):
    """A new-route station lost mid catch-up: the catch-up is abandoned, the call says why, the old route serves
    on. An old-route station lost mid catch-up: the switch happens at once. Either way every token is unchanged.
    (The same with SIGKILLed station processes: tests/test_route_catchup_ray.py.)"""
    prompts, params = _jobs(max_tokens=MAX_TOKENS)
    cfg = ModelConfig.from_dir(tiny_llama)
    old = [_Failing(Station(tiny_llama, StationSpec(layers=(0, 6), kv_bytes=KV)))]
    engine = Engine(old, cfg, SchedulerConfig(max_seqs=16, max_wave_tokens=512, catchup_wave_tokens=16,
                                              catchup_copy_tokens=16, catchup_kv=source))
    try:
        follow = _Follower([engine.submit(p, sp) for p, sp in zip(prompts, params)])
        new = [_Failing(Station(tiny_llama, StationSpec(layers=r, kv_bytes=KV))) for r in ((0, 3), (3, 6))]
        follow.wait(5)
        result = {}
        switch = threading.Thread(target=lambda: result.update(r=_try(engine.switch_route, new)))
        switch.start()
        deadline = time.monotonic() + 60
        while (engine.stats().route_catchup is None or engine.stats().route_catchup.waves < 3) \
                and time.monotonic() < deadline and switch.is_alive():
            time.sleep(0.002)
        (new[1] if which == "new" else old[0]).armed.set()
        switch.join(120)
        if which == "new":
            assert isinstance(result["r"], CatchUpFailed) and "new-route station failed" in str(result["r"])
            assert engine.pipeline.links == old
        else:
            assert result["r"].mode == "catchup" and engine.pipeline.links == new, result["r"]
        follow.join()
        assert follow.tokens == reference
        assert engine.stats().route_catchup is None
    finally:
        engine.close()


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return e


def _catchup_over(blocks: int, wave_tokens: int, computed: tuple[int, ...]):
    """A CatchUp over a ledger of `blocks` blocks of 16, and running sequences with these computed tokens."""
    ids = iter(range(100))
    cu = CatchUp(KVBlockLedger(blocks, 16), wave_tokens=wave_tokens, max_entries=8, ready_lag=2,
                 new_wave_id=lambda: next(ids), started=0.0)
    seqs = []
    for i, done in enumerate(computed):
        s = Sequence(i, Request(f"r{i}", tuple(range(5, 5 + done)), SamplingParams(max_tokens=10)), arrival=i)
        s.status, s.num_computed = SequenceStatus.RUNNING, done
        seqs.append(s)
    return cu, seqs


def test_catchup_plans_committed_tokens_and_forgets_ended_sequences():
    """CatchUp alone: waves carry only tokens the old route committed, oldest first, within the row budget; a
    sequence that ends mid-wave is released when that wave comes back; no room marks a sequence for re-prefill."""
    cu, seqs = _catchup_over(8, 40, (50, 30, 100))
    w1 = cu.plan(seqs)
    assert [(e.seq_id, e.start_pos, e.n_tokens, e.sample) for e in w1.entries] == [(0, 0, 40, None)]
    assert list(w1.token_ids) == list(range(5, 45))
    w2 = cu.plan(seqs)  # seq 0 is in flight: seq 1 whole, then 10 rows of seq 2
    assert [(e.seq_id, e.n_tokens) for e in w2.entries] == [(1, 30), (2, 10)]
    assert cu.forget((1,)) == ()  # in flight: released when its wave ends
    assert cu.commit(w2) == (1,) and 1 not in cu.shadows
    cu.commit(w1)
    assert cu.shadows[0].num_computed == 40 and cu.lag_limit(3) == 2  # the waves in flight of both routes
    assert not cu.ready(seqs)  # seq 2 is 90 tokens behind
    live = [seqs[0], seqs[2]]  # seq 1 ended
    w3 = cu.plan(live)
    assert [(e.seq_id, e.start_pos, e.n_tokens) for e in w3.entries] == [(0, 40, 10), (2, 10, 30)]
    cu.commit(w3)
    assert cu.plan(live) is None  # seq 2 needs 2 more blocks for its next 40 tokens and 1 is free: no room
    assert cu.no_room == {2} and cu.take_releases() == (2,) and 2 not in cu.shadows
    assert cu.ready(live)  # seq 0 caught up; seq 2 falls back to re-prefill
    cu.ledger.check()
    assert cu.ledger.used == 4


def test_catchup_skipped_plans_forgotten_sequences_and_the_last_plan():
    """A plan an old station could not carry out leaves its shadows where they were; a sequence that leaves the
    old route while its plan is in flight is `forgotten` until the plan ends; the last plan (final) takes every
    token each sequence lacks, past the row budget and after closing."""
    cu, seqs = _catchup_over(64, 32, (70, 40, 20))
    p1 = cu.plan(seqs)
    assert [(e.seq_id, e.n_tokens) for e in p1.entries] == [(0, 32)]
    cu.skip(p1)  # the old station could not export
    assert cu.shadows[0].num_computed == 0
    p2 = cu.plan(seqs)
    assert cu.forget((0, 2)) == () and cu.forgotten(0) and not cu.forgotten(2)  # 0 is in p2: released after it
    assert cu.commit(p2) == (0,) and not cu.forgotten(0)
    live = seqs[1:2]
    cu.closing = True
    assert cu.plan(live) is None
    last = cu.plan(live, final=True)
    assert [(e.seq_id, e.start_pos, e.n_tokens) for e in last.entries] == [(1, 0, 40)]
    cu.commit(last)
    assert cu.ready(live) and {s.seq_id: s.num_computed for s in cu.shadows.values()} == {1: 40}


def test_catchup_waves_are_paced_by_the_old_routes_wave_time():
    """Catch-up waves start at 16 rows, grow by 16 while the old route's waves keep within 1.75x their time
    before the catch-up, shrink by a quarter when one is slower (never below 16), and without a baseline (an idle
    old route) run at the full size at once."""
    cu = CatchUp(KVBlockLedger(64, 16), wave_tokens=64, max_entries=8, ready_lag=2, new_wave_id=lambda: 0,
                 started=0.0, baseline_s=0.1)
    assert cu.rows == 16
    sizes = []
    for seconds in (0.1, 0.15, 0.17, 0.1, 0.1, 0.2, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3):
        cu.old_wave(seconds)
        sizes.append(cu.rows)
    assert sizes == [32, 48, 64, 64, 64, 48, 36, 27, 20, 16, 16, 16]
    s = Sequence(0, Request("r", tuple(range(5, 105)), SamplingParams(max_tokens=4)), arrival=0)
    s.status, s.num_computed = SequenceStatus.RUNNING, 100
    assert cu.plan([s]).entries[0].n_tokens == 16  # the wave keeps to the paced size
    idle = CatchUp(KVBlockLedger(64, 16), wave_tokens=64, max_entries=8, ready_lag=2, new_wave_id=lambda: 0,
                   started=0.0)
    idle.old_wave(5.0)
    assert idle.rows == 64 and idle.plan([s]).entries[0].n_tokens == 64


def test_a_busy_route_of_several_step_calls_learns_its_baseline():
    """An old route busy with several-step calls only has no one-step wave time to pace by (its time per step in
    a long call is no measure of the one-step calls it runs during a catch-up): the plans stay at their floor until
    three one-step old-route waves set the baseline (their median), a several-step wave landing meanwhile not
    counted; then the pacing is as usual. Unpaced (slowdown 0) it runs at the full size at once."""
    def catchup(**kw):
        return CatchUp(KVBlockLedger(64, 16), wave_tokens=64, max_entries=8, ready_lag=2, new_wave_id=lambda: 0,
                       started=0.0, learn=True, **kw)
    cu = catchup()
    assert cu.rows == 16 and cu.baseline_s is None
    cu.old_wave(0.01, steps=16)  # a long call sent before the catch-up began
    cu.old_wave(0.1)
    cu.old_wave(0.3)
    assert cu.rows == 16 and cu.baseline_s is None
    cu.old_wave(0.2)
    assert cu.baseline_s == 0.2 and cu.rows == 16
    cu.old_wave(0.3)  # within 1.75 x 0.2: grows
    assert cu.rows == 32
    cu.old_wave(0.4)  # slower: a quarter off
    assert cu.rows == 24
    assert catchup(slowdown=0).rows == 64


@pytest.mark.parametrize("switch", ["catchup", "pause"])
def test_a_switch_forgets_the_old_routes_wave_times(tiny_llama, switch):
    """The pace a catch-up keeps to is the route's own: after a switch (make before break, or pause) the old route's
    one-step wave times are no baseline for the next one."""
    engine = Engine(_links(tiny_llama, ((0, 6),)), ModelConfig.from_dir(tiny_llama),
                    SchedulerConfig(max_seqs=4, max_wave_tokens=64, route_switch=switch))
    try:
        engine._wave_seconds.extend([0.05] * 3)  # an idle engine: no wave adds to them meanwhile
        engine.switch_route(_links(tiny_llama, ((0, 3), (3, 6))))
        assert len(engine.pipeline.links) == 2 and not engine._wave_seconds
    finally:
        engine.close()


def test_one_step_wave_times_do_not_outlive_several_step_calls(tiny_llama):
    """The catch-up's baseline is the one-step waves' time since the route last ran several steps a call: times
    from before (here planted) do not survive a several-step call, so a switch then learns the route's pace afresh."""
    engine = Engine(_links(tiny_llama, ((0, 6),)), ModelConfig.from_dir(tiny_llama),
                    SchedulerConfig(max_seqs=4, max_wave_tokens=64))  # a lone station: 4 steps a call by default
    try:
        engine._wave_seconds.extend([0.05] * 3)
        engine.generate([1, 5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True), timeout=60)
        assert 0.05 not in engine._wave_seconds
    finally:
        engine.close()
