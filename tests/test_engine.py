"""The engine: the parity gate, the concurrency sweep, cancellation, stop strings, no leaks."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from tokenizers import Tokenizer

from mesh.core.config import ModelConfig, SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from orchestrator.engine import AdmissionError, Engine
from orchestrator.pipeline import LocalLink
from station.generate import generate_one
from station.step import Station

N = 16


def _jobs(n=N):
    prompts = [[1] + [(37 * i + 11 * j) % 500 + 5 for j in range(2 + (13 * i) % 45)] for i in range(n)]
    params = [SamplingParams(max_tokens=3 + (7 * i) % 22, temperature=0.0 if i % 2 == 0 else 0.85,
                             top_p=0.9 if i % 4 == 1 else 1.0, seed=77 + i) for i in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def reference(tiny_llama):
    st = Station(tiny_llama, StationSpec(layers=(0, 6)))
    prompts, params = _jobs()
    return [generate_one(st, p, sp)[0] for p, sp in zip(prompts, params)]


def _engine(model_dir, ranges=((0, 6),), kv_bytes=64 * 2**20, **sched):
    cfg = ModelConfig.from_dir(model_dir)
    links = [LocalLink(Station(model_dir, StationSpec(layers=r, kv_bytes=kv_bytes))) for r in ranges]
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return Engine(links, cfg, SchedulerConfig(**sched), tok)


def _assert_empty(engine):
    assert engine.quiesce(30)
    s = engine.stats()
    assert (s.running, s.waiting, s.waves_in_flight, s.kv_bytes_used) == (0, 0, 0, 0)
    assert not engine.requests and not engine.requests.seq_ids()


@pytest.mark.parametrize("max_seqs", [1, 2, 4, 8, 16])
def test_parity_gate(tiny_llama, reference, max_seqs):
    """N concurrent requests give, per request, the tokens it gets alone (greedy and seeded)."""
    engine = _engine(tiny_llama, max_seqs=max_seqs, max_wave_tokens=48)
    try:
        prompts, params = _jobs()
        streams = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        got = [s.result(timeout=120)[0].token_ids for s in streams]
        assert got == reference
        _assert_empty(engine)
    finally:
        engine.close()


def test_concurrency_sweep(tiny_llama, reference):
    """Occupancy rises and waves fall with concurrency; every request's tokens stay the reference."""
    prompts, params = _jobs()
    figures = []
    for c in (1, 2, 4, 8, 16):
        engine = _engine(tiny_llama, max_seqs=c, max_wave_tokens=512)
        try:
            streams = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
            assert [s.result(timeout=120)[0].token_ids for s in streams] == reference
            s = engine.stats()
            figures.append((c, s.wave_occupancy_mean, s.waves))
        finally:
            engine.close()
    occupancy = [f[1] for f in figures]
    waves = [f[2] for f in figures]
    assert occupancy == sorted(occupancy) and occupancy[-1] > 4 * occupancy[0], figures
    assert waves == sorted(waves, reverse=True) and waves[-1] * 4 < waves[0], figures


@pytest.mark.parametrize("ranges", [((0, 2), (2, 6)), ((0, 1), (1, 4), (4, 6))])
def test_pipelined_stations_keep_parity(tiny_llama, reference, ranges):
    engine = _engine(tiny_llama, ranges, max_seqs=16, max_wave_tokens=64)
    try:
        prompts, params = _jobs()
        streams = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        assert [s.result(timeout=120)[0].token_ids for s in streams] == reference
        _assert_empty(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("ranges", [((0, 6),), ((0, 2), (2, 6))])
def test_extra_waves_in_flight_keep_parity(tiny_llama, reference, ranges):
    """More waves in flight than stations: smaller groups queue at each station; tokens unchanged."""
    engine = _engine(tiny_llama, ranges, max_seqs=16, max_wave_tokens=64, extra_waves=2)
    in_flight = []  # the engine's count each time it sends a wave
    send = engine.pipeline.submit
    engine.pipeline.submit = lambda plan: (in_flight.append(engine._in_flight), send(plan))
    try:
        prompts, params = _jobs()
        streams = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        assert [s.result(timeout=120)[0].token_ids for s in streams] == reference
        assert max(in_flight) == len(ranges) + 2  # the extra waves really were in flight
        _assert_empty(engine)
    finally:
        engine.close()


def test_cancel_preempt_and_finish_leave_nothing(tiny_llama, reference):
    # a KV budget of 12 blocks forces preemptions among 16 requests
    block = 16 * 2 * 6 * 2 * 16 * 4
    engine = _engine(tiny_llama, kv_bytes=12 * block, max_seqs=16, max_wave_tokens=64)
    try:
        prompts, params = _jobs()
        streams = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        cancelled = {3, 8, 11}
        for i in cancelled:
            assert engine.cancel(streams[i].request_id)
        assert not engine.cancel("no-such-request")
        for i, s in enumerate(streams):
            out = s.result(timeout=120)[0]
            if i in cancelled:
                assert out.finish_reason == "cancelled"
                assert out.token_ids == reference[i][: len(out.token_ids)]
            else:
                assert out.token_ids == reference[i], i
        assert engine.stats().preemptions > 0
        _assert_empty(engine)
    finally:
        engine.close()


def test_cancel_mid_stream_frees_kv(tiny_llama):
    engine = _engine(tiny_llama, max_seqs=4, max_wave_tokens=64)
    try:
        stream = engine.submit([1, 5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))
        seen = 0
        for ev in stream:
            seen += len(ev.token_ids)
            if seen == 5:
                engine.cancel(stream.request_id)
            if ev.finish_reason:
                assert ev.finish_reason == "cancelled"
        assert 5 <= seen < 500
        _assert_empty(engine)
    finally:
        engine.close()


def test_stop_strings_and_stop_ids(tiny_llama):
    engine = _engine(tiny_llama)
    try:
        base = engine.generate([1, 50, 60, 70], SamplingParams(max_tokens=20))[0]
        assert len(base.text) > 6
        stop = base.text[3:6]
        cut = engine.generate([1, 50, 60, 70], SamplingParams(max_tokens=20, stop=(stop,)))[0]
        assert cut.finish_reason == "stop" and stop not in cut.text and base.text.startswith(cut.text)
        assert cut.text == base.text[: base.text.find(stop)]
        by_id = engine.generate([1, 50, 60, 70], SamplingParams(max_tokens=20, stop_token_ids=(base.token_ids[4],)))[0]
        assert by_id.finish_reason == "stop" and by_id.token_ids == base.token_ids[:5]
        _assert_empty(engine)
    finally:
        engine.close()


def test_admission_refusals(tiny_llama):
    engine = _engine(tiny_llama, max_seqs=1, max_wave_tokens=16, max_queue=2)
    try:
        with pytest.raises(AdmissionError) as never:
            engine.submit([1] * 1000, SamplingParams(max_tokens=100))
        assert never.value.status == 400 and "1000" in str(never.value) and "1024" in str(never.value)
        streams = []
        with pytest.raises(AdmissionError) as full:
            for _ in range(5):  # max_seqs 1 + max_queue 2 fit, running or not yet: the fourth is refused
                streams.append(engine.submit([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True)))
        assert full.value.status == 503 and len(streams) == 3
        for s in streams:
            engine.cancel(s.request_id)
        assert engine.stats().refusals.get("queue_full", 0) >= 1
        _assert_empty(engine)
    finally:
        engine.close()


def test_async_streams_and_n_choices(tiny_llama, reference):
    engine = _engine(tiny_llama, max_seqs=8)
    prompts, params = _jobs(4)

    async def consume(p, sp):
        stream = engine.submit(p, sp, n=2)
        tokens = {0: [], 1: []}
        async for ev in stream:
            tokens[ev.index].extend(ev.token_ids)
        return tokens

    async def main():
        return await asyncio.gather(*(consume(p, sp) for p, sp in zip(prompts, params)))

    try:
        results = asyncio.run(main())
        for i, got in enumerate(results):
            assert got[0] == reference[i]
            if params[i].temperature == 0:
                assert got[1] == reference[i]
        _assert_empty(engine)
    finally:
        engine.close()


def test_submit_from_many_threads(tiny_llama, reference):
    engine = _engine(tiny_llama, max_seqs=8)
    prompts, params = _jobs()
    got = [None] * N

    def worker(i):
        got[i] = engine.generate(prompts[i], params[i], timeout=120)[0].token_ids

    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert got == reference
    finally:
        engine.close()


def test_switch_route_mid_stream_keeps_tokens(tiny_llama):
    """Grow 1 -> 3 stations and back to 1 while requests stream: every token equals the reference."""
    prompts, _ = _jobs(8)
    params = [SamplingParams(max_tokens=120, ignore_eos=True, temperature=0.8 * (i % 2), seed=i) for i in range(8)]
    one = Station(tiny_llama, StationSpec(layers=(0, 6)))
    reference = [generate_one(one, p, sp)[0] for p, sp in zip(prompts, params)]
    engine = _engine(tiny_llama, max_seqs=16, max_wave_tokens=64)
    try:
        routes = [[LocalLink(Station(tiny_llama, StationSpec(layers=r))) for r in ranges]  # loaded beside
                  for ranges in (((0, 1), (1, 4), (4, 6)), ((0, 6),))]
        streams = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        for step, links in enumerate(routes):
            deadline = time.monotonic() + 60
            while engine.stats().decode_tokens < 100 * (step + 1) and time.monotonic() < deadline:
                time.sleep(0.001)
            assert not any(s.done for s in streams), [(o.finish_reason, o.error, len(o.token_ids)) for s in streams for o in s.outputs]
            engine.switch_route(links)
        assert [s.result(timeout=120)[0].token_ids for s in streams] == reference
        stats = engine.stats()
        assert stats.route_switches == 2 and len(stats.route_switch_pauses) == 2 and min(stats.route_switch_pauses) > 0
        print(f"\nswitch pauses (longest wait of a stream for its next token): {stats.route_switch_pauses}")
        _assert_empty(engine)
    finally:
        engine.close()
