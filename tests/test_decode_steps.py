"""Several decode steps in one station call (`scheduler.decode_steps`, Forward's `steps`): the same tokens as one
step per call, in process and over gRPC; refused where it cannot run; all or nothing at the station."""
from __future__ import annotations

from contextlib import contextmanager

import grpc
import pytest
import torch
from tokenizers import Tokenizer

from mesh.core.config import ConfigError, ModelConfig, SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from mesh.core.proto import station_pb2_grpc
from mesh.core.wave import SampledToken, WaveEntry
from mesh.core.wire import WireError, encode_forward
from orchestrator.engine import Engine
from orchestrator.pipeline import LocalLink
from orchestrator.scheduler import KVLimits, Scheduler
from station.client import StationCallError, StationClient
from station.generate import generate_one
from station.kv import StepError
from station.server import start_server
from station.step import Station

PROMPT = [1, 17, 300, 45, 99, 7, 250, 11, 64, 3]
WHOLE = StationSpec(layers=(0, 6))


def _jobs(n=12):
    """Greedy, seeded, nucleus and top-k requests of several lengths, one with logprobs."""
    prompts = [[1] + [(41 * i + 13 * j) % 500 + 5 for j in range(3 + (11 * i) % 29)] for i in range(n)]
    params = [SamplingParams(max_tokens=2 + (5 * i) % 19, temperature=0.0 if i % 3 == 0 else 0.9,
                             top_p=0.8 if i % 3 == 1 else 1.0, top_k=20 if i % 3 == 2 else 0, seed=5 + i,
                             logprobs=2 if i == 4 else 0, ignore_eos=True) for i in range(n)]
    return prompts, params


def _serve(model_dir, decode_steps, prompts, params, ranges=((0, 6),), reply_steps=0):
    """Every request at once through an engine over in-process stations; (outputs, waves committed)."""
    links = [LocalLink(Station(model_dir, StationSpec(layers=r))) for r in ranges]
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    engine = Engine(links, ModelConfig.from_dir(model_dir),
                    SchedulerConfig(max_seqs=16, max_wave_tokens=512, decode_steps=decode_steps,
                                    reply_steps=reply_steps), tok)
    try:
        streams = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        outs = [s.result(timeout=120)[0] for s in streams]
        assert engine.quiesce(30)
        s = engine.stats()
        assert (s.running, s.waiting, s.kv_bytes_used) == (0, 0, 0)
        return outs, s.waves
    finally:
        engine.close()


def test_engine_tokens_are_the_same_at_any_decode_steps(tiny_llama):
    """1, 4 and 7 steps per call: the same tokens, logprobs and finish reasons; fewer wave calls with steps."""
    prompts, params = _jobs()
    runs = {steps: _serve(tiny_llama, steps, prompts, params) for steps in (1, 4, 7)}
    want = [(o.token_ids, o.finish_reason, o.logprobs) for o in runs[1][0]]
    for steps in (4, 7):
        assert [(o.token_ids, o.finish_reason, o.logprobs) for o in runs[steps][0]] == want, steps
    # fewer wave calls with steps; 7 against 4 is left unordered: the requests are submitted while the loop already
    # plans, and a wave planned before the last arrives may run its steps or not (one suite run saw 14 against 13)
    assert max(runs[4][1], runs[7][1]) < runs[1][1], {k: v[1] for k, v in runs.items()}
    alone = Station(tiny_llama, WHOLE)
    assert [o.token_ids for o in runs[4][0]] == [generate_one(alone, p, sp)[0] for p, sp in zip(prompts, params)]


def test_a_stop_inside_a_multi_step_wave_ends_the_sequence_there(tiny_llama):
    """A stop token or a stop string met in step k of a call (with 12 steps, in its second streamed part of 4): the
    output ends there, the KV is all released though the call ran on."""
    free, _ = _serve(tiny_llama, 1, [PROMPT], [SamplingParams(max_tokens=12, ignore_eos=True)])
    tokens, text = free[0].token_ids, free[0].text
    stop_id = tokens[5]
    assert stop_id not in tokens[:5]
    stop_text = text[len(text) // 2:len(text) // 2 + 2]
    assert stop_text and text.index(stop_text) > 0
    params = [SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,)),
              SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop_text,))]
    for steps, reply_steps in ((1, 0), (4, 0), (12, 4)):
        outs, _ = _serve(tiny_llama, steps, [PROMPT, PROMPT], params, reply_steps=reply_steps)
        assert outs[0].token_ids == tokens[:6] and outs[0].finish_reason == "stop", steps
        assert outs[1].text == text[:text.index(stop_text)] and outs[1].finish_reason == "stop", steps


def test_a_chain_of_stations_keeps_one_step_per_call(tiny_llama):
    """Two in-process stations: each wave is one step (a station alone cannot feed its tokens back)."""
    prompts, params = _jobs(4)
    one, _ = _serve(tiny_llama, 1, prompts, params)
    chain, _ = _serve(tiny_llama, 8, prompts, params, ranges=((0, 3), (3, 6)))
    assert [o.token_ids for o in chain] == [o.token_ids for o in one]


def test_a_lone_station_runs_4_steps_a_call_by_default(tiny_llama, monkeypatch):
    """At the default decode_steps (0: by route) a lone station's calls run up to 4 steps with one reply each
    (SchedulerConfig.call_steps); the tokens are those of one step per call."""
    asked: list[tuple[int, int]] = []
    real = Scheduler.plan

    def recorded(self, max_entries=None, max_steps=1, reply_steps=0):
        plan = real(self, max_entries, max_steps, reply_steps)
        if plan is not None:
            asked.append((plan.steps, plan.reply_steps))
        return plan

    monkeypatch.setattr(Scheduler, "plan", recorded)
    prompts, params = _jobs(4)
    got, _ = _serve(tiny_llama, 0, prompts, params)
    one, _ = _serve(tiny_llama, 1, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in one]
    assert max(s for s, _ in asked) == 4 and {r for _, r in asked} == {0}, asked


def test_call_steps_by_route():
    """decode_steps 0 picks the call's shape by route; a set decode_steps is used as given on any route."""
    auto = SchedulerConfig()
    assert (auto.call_steps(1), auto.call_steps(2), auto.call_steps(8)) == ((4, 0), (16, 4), (16, 4))
    assert SchedulerConfig(reply_steps=2).call_steps(3) == (16, 2)
    assert SchedulerConfig(reply_steps=2).call_steps(1) == (4, 2)
    assert SchedulerConfig(decode_steps=8).call_steps(2) == (8, 0) == SchedulerConfig(decode_steps=8).call_steps(1)
    assert SchedulerConfig(decode_steps=1, reply_steps=4).call_steps(2) == (1, 4)
    for bad in (-1, 65, 2.5):
        with pytest.raises(ConfigError, match="decode_steps"):
            SchedulerConfig(decode_steps=bad)


@contextmanager
def whole_station_server(model_dir, token=None):
    """A gRPC server over a whole-model station (with the cluster token where given), and a client of it."""
    server = start_server(Station(model_dir, WHOLE), token=token)
    client = StationClient(server.address, timeout_s=30, hidden_size=64, vocab_size=512, token=token)
    try:
        yield server, client
    finally:
        client.close()
        server.stop(grace=0)


@pytest.fixture(scope="module")
def full_server(tiny_llama):
    """A gRPC server over a whole-model station, and a client of it."""
    with whole_station_server(tiny_llama) as both:
        yield both


def _prefill(client, seq_id, params):
    out = client.forward(0, (WaveEntry(seq_id, 0, len(PROMPT), params),), token_ids=PROMPT)
    return out.samples[0].token_id


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=13, ignore_eos=True),
                                    SamplingParams(max_tokens=13, ignore_eos=True, temperature=0.8, seed=3,
                                                   logprobs=3)])
def test_steps_over_grpc_give_the_tokens_of_one_step_per_call(tiny_llama, full_server, params):
    """Prefill, then calls of 4, 1 and 7 decode steps for two sequences: each gets its one-step tokens."""
    _, client = full_server
    want, _ = generate_one(Station(tiny_llama, WHOLE), PROMPT, params)
    got = {seq: [_prefill(client, seq, params)] for seq in (31, 32)}
    try:
        pos = len(PROMPT)
        for steps in (4, 1, 7):
            entries = tuple(WaveEntry(seq, pos, 1, params) for seq in got)
            out = client.forward(1, entries, token_ids=[got[seq][-1] for seq in got], steps=steps)
            assert len(out.samples) == steps * len(entries)
            for k in range(steps):
                for i, seq in enumerate(got):
                    sample = out.samples[k * len(entries) + i]
                    assert isinstance(sample, SampledToken)
                    assert (sample.logprob is not None) == bool(params.logprobs)
                    got[seq].append(sample.token_id)
            pos += steps
        assert got[31] == want and got[32] == want
    finally:
        client.release(list(got))


def _raw(address, request):
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            station_pb2_grpc.StationStub(ch).Forward(request, timeout=30)
    return err.value


def test_steps_are_refused_where_they_cannot_run(tiny_llama, full_server):
    """Too many steps, steps relayed on from the last station, a prompt chunk, a wrong table, a station without every layer: each
    INVALID_ARGUMENT naming the problem, the station's KV as before, and it goes on serving."""
    server, client = full_server
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    token = _prefill(client, 41, params)
    pos = len(PROMPT)
    try:
        with pytest.raises(WireError, match="steps"):
            encode_forward(1, (WaveEntry(41, pos, 1, params),), [token], None, steps=65)
        request = encode_forward(1, (WaveEntry(41, pos, 1, params),), [token], None, steps=2)
        request.steps = 65
        assert "steps: 65 exceeds 64" in _raw(server.address, request).details()
        request.steps = 2
        request.relay_to.append("127.0.0.1:1")
        assert "cannot relay (it holds the last layer" in _raw(server.address, request).details()
        chunk = encode_forward(1, (WaveEntry(41, pos, 2, params),), [token, token], None, steps=2)
        assert "1-token entries" in _raw(server.address, chunk).details()
        with pytest.raises(StationCallError) as err:  # a table for one step where two are asked
            client.forward(1, (WaveEntry(41, pos, 1, params, tuple(range(1))),), token_ids=[token], steps=40)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "blocks" in str(err.value)
        assert client.info().sequences == 1 and client.kv_usage.sequences == 1
        out = client.forward(2, (WaveEntry(41, pos, 1, params),), token_ids=[token], steps=3)  # still serving
        assert len(out.samples) == 3
    finally:
        client.release([41])
    half = start_server(Station(tiny_llama, StationSpec(layers=(0, 3))))
    try:
        request = encode_forward(1, (WaveEntry(5, 0, 1, params),), [1], None, steps=2)
        assert "every layer" in _raw(half.address, request).details()
    finally:
        half.stop(grace=0)


def test_a_failing_step_rolls_every_sequence_back(tiny_llama, monkeypatch):
    """A failure in the third step of a call: the station's KV is where it was before the call."""
    st = Station(tiny_llama, WHOLE)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = st.forward((WaveEntry(7, 0, len(PROMPT), params),), token_ids=_ids(PROMPT)).samples[0].token_id
    calls = []
    real = Station._compute

    def third_fails(self, entries, x, want_logits, rows_out=None):
        calls.append(len(calls))
        if len(calls) == 3:
            raise StepError("injected failure in step 3")
        return real(self, entries, x, want_logits, rows_out)

    monkeypatch.setattr(Station, "_compute", third_fails)
    with pytest.raises(StepError, match="step 3"):
        st.forward((WaveEntry(7, len(PROMPT), 1, params),), token_ids=_ids([first]), steps=4)
    assert st.kv.length(7) == len(PROMPT)
    monkeypatch.setattr(Station, "_compute", real)
    out = st.forward((WaveEntry(7, len(PROMPT), 1, params),), token_ids=_ids([first]), steps=4)
    want, _ = generate_one(Station(tiny_llama, WHOLE), PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [first] + [s.token_id for s in out.samples] == want


def _ids(tokens):
    return torch.tensor(tokens, dtype=torch.long)


@pytest.mark.parametrize("kv_blocks, steps", [(8, 5), (7, 3)])
def test_scheduler_steps_only_when_nothing_else_waits_and_within_limits(kv_blocks, steps):
    """Steps: 1 with a request waiting or a prompt chunk in the wave; else bounded by max_steps, the most max_tokens
    any sequence has left and the free KV blocks (never preempting); the entries' tables cover every step. A
    sequence whose max_tokens ends sooner rides the call: it ends at its own last token, its later samples
    dropped, and its KV goes when the wave lands."""
    cfg = SchedulerConfig(max_seqs=2, max_wave_tokens=64, max_queue=8)
    sched = Scheduler(cfg, KVLimits(max_context=40, kv_blocks=kv_blocks, block_tokens=4), eos_token_ids=(0,))
    sched.add(1, "a", tuple(range(1, 11)), SamplingParams(max_tokens=6, ignore_eos=True))
    sched.add(2, "b", tuple(range(1, 9)), SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add(3, "c", (5, 6), SamplingParams(max_tokens=3, ignore_eos=True))
    plan = sched.plan(max_steps=8)
    assert plan.steps == 1  # prompt chunks
    sched.commit(plan, [SampledToken(9), SampledToken(9)])
    plan = sched.plan(max_steps=8)
    assert plan.steps == 1 and len(plan.entries) == 2  # request c waits for a lane
    sched.commit(plan, [SampledToken(9), SampledToken(9)])
    sched.cancel("c")
    # seq 1 holds 11 positions (3 blocks of 4) and 2 of its 6 tokens (4 more at most), seq 2 holds 9 (3 blocks) and
    # 2 of its 20: seq 2's 18 tokens left allow max_steps (8), the KV less: with 8 blocks (2 free) 5 steps fit
    # (positions to 16 and 14: one more block each), with 7 blocks (1 free) 3 (to 14 and 12: one more for seq 1)
    plan = sched.plan(max_steps=8)
    assert plan.steps == steps
    for e in plan.entries:
        assert len(e.blocks) == -(-(e.start_pos + steps) // 4)
    result = sched.commit(plan, [SampledToken(9)] * (2 * steps))
    ends = [ev.finish_reason for ev in result.events if ev.seq_id == 1]
    assert ends == ([None] * 3 + ["length"] if steps == 5 else [None] * 3)  # seq 1's 5th sample dropped
    assert result.released == ((1,) if steps == 5 else ())
    assert sched.stats().decode_tokens == 2 + len(ends) + steps
    if steps == 5:
        plan = sched.plan(max_steps=8)  # seq 2 alone, 4 blocks free: max_steps bounds it
        assert plan.steps == 8 and len(plan.entries[0].blocks) == -(-(plan.entries[0].start_pos + 8) // 4)
        assert plan.entries[0].start_pos == 9 + 5


def test_only_links_whose_forward_takes_steps_are_asked_for_several(tiny_llama):
    """The engine reads the capability from the link's class: a subclass overriding forward without `steps`
    keeps one step per call and serves every request; the stock links take them."""
    from orchestrator.pipeline import runs_steps
    from orchestrator.remote import RemoteLink

    class OneStep(LocalLink):
        def forward(self, wave_id, entries, token_ids, hidden):
            return super().forward(wave_id, entries, token_ids, hidden)

    assert runs_steps(LocalLink(None)) and runs_steps(RemoteLink.__new__(RemoteLink))
    assert not runs_steps(OneStep(None))
    prompts, params = _jobs(4)
    want, _ = _serve(tiny_llama, 1, prompts, params)
    engine = Engine([OneStep(Station(tiny_llama, WHOLE))], ModelConfig.from_dir(tiny_llama),
                    SchedulerConfig(max_seqs=16, max_wave_tokens=512, decode_steps=8))
    try:
        outs = [s.result(timeout=120)[0] for s in [engine.submit(p, sp) for p, sp in zip(prompts, params)]]
        # steps= passed to this forward would raise TypeError and end the requests with an error
        assert [o.token_ids for o in outs] == [o.token_ids for o in want] and not any(o.error for o in outs)
    finally:
        engine.close()
