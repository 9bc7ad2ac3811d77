"""The prefix cache on real stations: a request that hits the cache gets exactly the tokens it gets cold.

Every comparison is against the same requests with `scheduler.prefix_cache: false` (and, where cheap, against
each request alone): greedy and seeded, on 1 and on 3 in-process stations, submitted together and in sequence,
under a small KV budget (eviction and preemption), with a cancel, and across a route switch (`mesh scale`).
"""
from __future__ import annotations

import time

import pytest
from tokenizers import Tokenizer

from mesh.core.config import ModelConfig, SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from orchestrator.engine import Engine
from orchestrator.pipeline import LocalLink
from station.step import Station

PREFIX = [1] + [(29 * j) % 480 + 7 for j in range(199)]  # 200 tokens shared by every request
BLOCK_BYTES = 16 * 2 * 6 * 2 * 16 * 4  # one 16-token KV block of the whole tiny llama (float32)


def shared_jobs(n=12, max_tokens=24):
    """n prompts of PREFIX + a question of their own, alternately greedy and seeded."""
    prompts = [PREFIX + [(53 * i + 11 * j) % 480 + 9 for j in range(3 + (7 * i) % 29)] for i in range(n)]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.8,
                             top_p=0.9 if i % 4 == 1 else 1.0, seed=300 + i) for i in range(n)]
    return prompts, params


def _engine(model_dir, ranges, cache, kv_blocks=4096, **sched):
    cfg = ModelConfig.from_dir(model_dir)
    per_layer = BLOCK_BYTES // 6
    links = [LocalLink(Station(model_dir, StationSpec(layers=r, kv_bytes=kv_blocks * per_layer * (r[1] - r[0]))))
             for r in ranges]
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return Engine(links, cfg, SchedulerConfig(prefix_cache=cache, **{"max_seqs": 16, "max_wave_tokens": 64, **sched}),
                  tok)


def _run(engine, prompts, params, together):
    if together:
        streams = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        return [s.result(timeout=300)[0].token_ids for s in streams]
    return [engine.submit(p, sp).result(timeout=300)[0].token_ids for p, sp in zip(prompts, params)]


def _assert_clean(engine):
    assert engine.quiesce(30)
    s = engine.stats()
    assert (s.running, s.waiting, s.waves_in_flight, s.kv_bytes_used) == (0, 0, 0, 0)
    ledger = engine.scheduler._ledger
    ledger.check()
    assert ledger.used == 0 and ledger.cached <= ledger.total


@pytest.fixture(scope="module")
def cold(tiny_llama):
    """The 12 requests with the cache off, on one station, submitted together."""
    prompts, params = shared_jobs()
    engine = _engine(tiny_llama, ((0, 6),), cache=False)
    try:
        assert not engine.stats().prefix_cache
        return _run(engine, prompts, params, together=True)
    finally:
        engine.close()


@pytest.mark.parametrize("ranges", [((0, 6),), ((0, 2), (2, 3), (3, 6))], ids=["1-station", "3-stations"])
@pytest.mark.parametrize("together", [True, False], ids=["together", "in-sequence"])
def test_cache_hits_change_no_token(tiny_llama, cold, ranges, together):
    prompts, params = shared_jobs()
    engine = _engine(tiny_llama, ranges, cache=True)
    try:
        assert engine.stats().prefix_cache
        assert _run(engine, prompts, params, together) == cold
        s = engine.stats()
        assert s.prefix_cache_hits == 11 * 192  # the prefix's 12 full blocks, computed once, found 11 times
        assert s.prefix_cache_queries == sum(len(p) for p in prompts)
        assert s.kv_blocks_cached > 0 and s.kv_bytes_cached == s.kv_blocks_cached * BLOCK_BYTES
        _assert_clean(engine)
    finally:
        engine.close()


def test_small_budget_evicts_and_preempts_with_shared_blocks_and_a_cancel(tiny_llama, cold):
    prompts, params = shared_jobs()
    engine = _engine(tiny_llama, ((0, 3), (3, 6)), cache=True, kv_blocks=40)
    try:
        streams = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        assert engine.cancel(streams[3].request_id)  # its shared blocks stay with the others
        outs = [s.result(timeout=300)[0] for s in streams]
        for i, out in enumerate(outs):
            if i == 3:
                assert out.token_ids == cold[3][:len(out.token_ids)]
            else:
                assert out.token_ids == cold[i], i
        s = engine.stats()
        assert s.preemptions > 0 and s.prefix_cache_hits > 0 and engine.scheduler._ledger.evictions > 0
        _assert_clean(engine)
    finally:
        engine.close()


def test_route_switch_with_cached_blocks_keeps_tokens(tiny_llama, cold):
    """`mesh scale` 1 -> 3 -> 1 while requests that share the prefix stream: the cache is dropped at each switch
    (new stations hold no KV) and rebuilt; every token equals the cold run."""
    prompts, params = shared_jobs()
    engine = _engine(tiny_llama, ((0, 6),), cache=True)
    try:
        engine.submit(prompts[0], params[0]).result(timeout=120)  # the prefix is cached before the others come
        streams = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        for step, ranges in enumerate((((0, 1), (1, 4), (4, 6)), ((0, 6),))):
            deadline = time.monotonic() + 60
            while engine.stats().decode_tokens < 60 * (step + 1) and time.monotonic() < deadline:
                time.sleep(0.001)
            engine.switch_route([LocalLink(Station(tiny_llama, StationSpec(layers=r))) for r in ranges])
        assert [s.result(timeout=300)[0].token_ids for s in streams] == cold
        assert engine.submit(prompts[5], params[5]).result(timeout=120)[0].token_ids == cold[5]
        assert engine.stats().prefix_cache_hits >= 12 * 192
        _assert_clean(engine)
    finally:
        engine.close()


def test_station_checks_the_tables_it_is_given(tiny_llama):
    """A station reads shared prefix blocks, and refuses a table that would write a block another sequence holds,
    skips positions, or names blocks outside its pool, keeping its KV as it was."""
    import torch

    from mesh.core.wave import WaveEntry
    from station.step import StepError

    st = Station(tiny_llama, StationSpec(layers=(0, 6), kv_bytes=64 * BLOCK_BYTES))
    greedy = SamplingParams(max_tokens=1)
    prompt = PREFIX[:40]
    cold = st.forward((WaveEntry(1, 0, 40, greedy, (0, 1, 2)),), token_ids=torch.tensor(prompt))
    # seq 2 starts on seq 1's two full blocks and computes the rest into a block of its own: the same token
    warm = st.forward((WaveEntry(2, 32, 8, greedy, (0, 1, 5)),), token_ids=torch.tensor(prompt[32:]))
    assert warm.samples[0].token_id == cold.samples[0].token_id
    assert st.kv.stats().blocks_used == 4  # blocks 0 and 1 counted once
    bad = {
        "written but held by another": WaveEntry(3, 0, 20, None, (1, 6)),
        "block ids for": WaveEntry(3, 0, 20, None, (6,)),
        "distinct and below": WaveEntry(3, 0, 20, None, (6, 999)),
        "mid-block": WaveEntry(3, 8, 12, None, (0, 6)),
    }
    for message, entry in bad.items():
        with pytest.raises(StepError, match=message):
            st.forward((entry,), token_ids=torch.tensor(prompt[entry.start_pos:entry.end_pos]))
    with pytest.raises(StepError, match="written by seq_id 4 in this wave and read by seq_id 5"):
        st.forward((WaveEntry(4, 0, 16, None, (7,)), WaveEntry(5, 16, 1, None, (7, 8))), token_ids=torch.tensor(prompt[:17]))
    assert st.kv.stats().blocks_used == 4 and st.kv.length(3) is None
    st.release([1, 2])
    assert st.kv.stats().blocks_used == 0
