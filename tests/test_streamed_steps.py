"""Several decode steps per call with their samples streamed back in parts (`scheduler.reply_steps`, the station's
ForwardSteps): the scheduler commits a wave part by part and releases what ended inside it only when it lands; the
engine's tokens equal one step per call's, in process and over gRPC; a station refuses what ForwardSteps cannot run,
with the same checks as Forward, and keeps serving."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import grpc
import pytest

from mesh.core.config import ConfigError, ModelConfig, SchedulerConfig
from mesh.core.params import SamplingParams
from mesh.core.proto import station_pb2 as pb
from mesh.core.proto import station_pb2_grpc
from mesh.core.wave import SampledToken, WaveEntry
from mesh.core.wire import encode_forward
from orchestrator.engine import Engine
from orchestrator.pipeline import LocalLink, StationDown
from orchestrator.scheduler import KVLimits, Scheduler
from station.client import StationCallError, StationClient
from station.generate import generate_one
from station.step import Station

from test_decode_steps import PROMPT, WHOLE, _prefill, whole_station_server

TOKEN = "steps-token"


# ---- the scheduler, with hand-made samples ---------------------------------------------------------------------
def _decoding():
    """A scheduler with three prefilled sequences (seq 2 ends on token 0, the EOS), ready for a decode wave."""
    sched = Scheduler(SchedulerConfig(max_seqs=4, max_wave_tokens=64),
                      KVLimits(max_context=64, kv_blocks=32, block_tokens=4), eos_token_ids=(0,))
    sched.add(1, "a", (5, 6, 7), SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add(2, "b", (5, 6), SamplingParams(max_tokens=20))
    sched.add(3, "c", (8,), SamplingParams(max_tokens=20, ignore_eos=True))
    sched.commit(sched.plan(), [SampledToken(9)] * 3)
    return sched


def test_a_wave_commits_part_by_part_and_releases_what_ended_when_it_lands():
    sched = _decoding()
    plan = sched.plan(max_steps=6, reply_steps=2)
    assert (plan.steps, plan.reply_steps) == (6, 2)
    used = sched.stats().kv_blocks_used
    part = sched.commit(plan, [SampledToken(11), SampledToken(12), SampledToken(13),
                               SampledToken(11), SampledToken(0), SampledToken(13)])
    assert [(e.seq_id, e.token_id, e.finish_reason) for e in part.events if e.seq_id == 2] == [
        (2, 12, None), (2, 0, "stop")]
    assert part.finished == (2,) and part.released == ()  # its later steps still run at the stations
    assert part.landed_steps == 0  # the wave stays in flight
    assert sched.plan(max_steps=6) is None  # every sequence is still in flight
    assert sched.cancel("c") == ()  # cancelled between parts: released when the wave lands
    with pytest.raises(ValueError, match="from step 0"):  # a part again, or out of order, is refused
        sched.commit(plan, [SampledToken(1)] * 6)
    part = sched.commit(plan, [SampledToken(14)] * 6, first_step=2)
    assert [e.seq_id for e in part.events] == [1, 1] and part.released == ()
    with pytest.raises(ValueError, match="seq 1 asked for a token at step 4"):
        sched.commit(plan, [None, SampledToken(15), SampledToken(15)] * 2, first_step=4)
    last = sched.commit(plan, [SampledToken(15)] * 6, first_step=4)
    assert [e.token_id for e in last.events] == [15, 15] and last.released == (2, 3)
    assert last.landed_steps == 6
    assert sched.stats().kv_blocks_used < used and sched.stats().running == 1
    nxt = sched.plan(max_steps=1)
    assert [(e.seq_id, e.start_pos) for e in nxt.entries] == [(1, 3 + 6)]


def test_an_aborted_wave_keeps_the_parts_it_committed():
    """A wave that fails after a part: its sequences leave flight where that part left them, and are replanned
    from there; a sequence cancelled meanwhile is released."""
    sched = _decoding()
    plan = sched.plan(max_steps=4, reply_steps=2)
    sched.commit(plan, [SampledToken(11), SampledToken(12), SampledToken(13)] * 2)
    sched.cancel("b")
    sched.abort_wave(plan)
    assert sched.take_releases() == (2,)
    assert sched.stats().decode_tokens == 6  # the part it committed: 3 sequences x 2 steps
    nxt = sched.plan(max_steps=1)
    assert [(e.seq_id, e.start_pos) for e in nxt.entries] == [(1, 3 + 2), (3, 1 + 2)]


def test_reply_steps_are_validated():
    with pytest.raises(ConfigError, match="reply_steps"):
        SchedulerConfig(reply_steps=-1)
    with pytest.raises(ConfigError, match="reply_steps"):
        SchedulerConfig(reply_steps=65)
    sched = _decoding()
    assert sched.plan(max_steps=4, reply_steps=8).reply_steps == 0  # a part as long as the call: one reply at its end


# ---- an engine over an in-process station ----------------------------------------------------------------------
class _Parts(LocalLink):
    """A LocalLink that notes the steps of each part it streams."""

    def __init__(self, station, parts):
        super().__init__(station)
        self.parts = parts

    def forward_steps(self, wave_id, entries, token_ids, steps, reply_steps):
        for out in super().forward_steps(wave_id, entries, token_ids, steps, reply_steps):
            self.parts.append(len(out.samples) // len(entries))
            yield out


def _serve(model_dir, prompts, params, decode_steps=1, reply_steps=0, parts=None):
    link = _Parts(Station(model_dir, WHOLE), [] if parts is None else parts)
    engine = Engine([link], ModelConfig.from_dir(model_dir),
                    SchedulerConfig(max_seqs=16, max_wave_tokens=512, decode_steps=decode_steps,
                                    reply_steps=reply_steps))
    try:
        outs = [s.result(timeout=120)[0] for s in [engine.submit(p, sp) for p, sp in zip(prompts, params)]]
        assert engine.quiesce(30)
        s = engine.stats()
        assert (s.running, s.waiting, s.kv_bytes_used) == (0, 0, 0)
        return outs
    finally:
        engine.close()


def test_streamed_parts_give_the_tokens_of_one_step_per_call(tiny_llama):
    """Greedy, seeded and logprob requests ending at different lengths; 8 steps a call in parts of 3: the same
    tokens, logprobs and finish reasons as one step a call, and the parts did stream."""
    prompts = [[1] + [(29 * i + 7 * j) % 500 + 5 for j in range(3 + (5 * i) % 11)] for i in range(6)]
    params = [SamplingParams(max_tokens=9 + 3 * i, temperature=0.0 if i % 2 else 0.9, seed=40 + i,
                             logprobs=2 if i == 3 else 0, ignore_eos=True) for i in range(6)]
    want = [(o.token_ids, o.finish_reason, o.logprobs) for o in _serve(tiny_llama, prompts, params)]
    parts: list[int] = []
    got = _serve(tiny_llama, prompts, params, decode_steps=8, reply_steps=3, parts=parts)
    assert [(o.token_ids, o.finish_reason, o.logprobs) for o in got] == want
    assert parts and set(parts) <= {1, 2, 3} and 3 in parts, parts


# ---- ForwardSteps over gRPC --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def steps_server(tiny_llama):
    """A gRPC server over a whole-model station with the cluster token, and a client of it."""
    with whole_station_server(tiny_llama, token=TOKEN) as both:
        yield both


def _refusal(address, request, metadata=(("authorization", f"Bearer {TOKEN}"),), raw=False):
    with grpc.insecure_channel(address) as ch:
        if raw:
            call = ch.unary_stream("/wavemesh.v1.Station/ForwardSteps", request_serializer=lambda b: b,
                                   response_deserializer=pb.ForwardReply.FromString)
        else:
            call = station_pb2_grpc.StationStub(ch).ForwardSteps
        with pytest.raises(grpc.RpcError) as err:
            list(call(request, timeout=30, metadata=metadata))
    return err.value


def test_forward_steps_streams_the_samples_of_each_part(tiny_llama, steps_server):
    """7 steps in parts of 3 for two sequences: replies of 3, 3 and 1 steps, each sequence's tokens those it gets
    alone, its KV report and the station's time with each."""
    _, client = steps_server
    params = SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.7, seed=5, logprobs=1)
    want, _ = generate_one(Station(tiny_llama, WHOLE), PROMPT, params)
    got = {seq: [_prefill(client, seq, params)] for seq in (71, 72)}
    try:
        entries = tuple(WaveEntry(seq, len(PROMPT), 1, params) for seq in got)
        sizes = []
        for reply in client.forward_steps(1, entries, [got[seq][-1] for seq in got], steps=7, reply_steps=3):
            n = len(reply.output.samples) // 2
            sizes.append(n)
            assert reply.output.seconds > 0 and reply.served_seconds > 0 and reply.hops == []
            for k in range(n):
                for i, seq in enumerate(got):
                    sample = reply.output.samples[2 * k + i]
                    assert sample.logprob is not None
                    got[seq].append(sample.token_id)
        assert sizes == [3, 3, 1]
        assert got[71] == want[:8] and got[72] == want[:8]
        assert client.kv_usage.sequences >= 2
    finally:
        client.release(list(got))


def test_forward_steps_refuses_what_it_cannot_run_and_keeps_serving(tiny_llama, steps_server):
    """No token, bytes that do not parse, hidden rows in, more steps a reply than the call has, a prompt chunk:
    each refused with its status and a message naming the problem; the KV as before; then a good call runs."""
    server, client = steps_server
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    token = _prefill(client, 81, params)
    pos = len(PROMPT)
    try:
        request = encode_forward(1, (WaveEntry(81, pos, 1, params),), [token], None, steps=3, reply_steps=1)
        assert _refusal(server.address, request, metadata=()).code() == grpc.StatusCode.UNAUTHENTICATED
        bad = _refusal(server.address, b"\xff\xff\xff", raw=True)
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid protobuf" in bad.details()
        request.reply_steps = 4
        assert "reply_steps: 4 exceeds the call's 3 steps" in _refusal(server.address, request).details()
        rows = encode_forward(1, (WaveEntry(81, pos, 1, params),), None, _hidden(), steps=3)
        assert "starts at the first station" in _refusal(server.address, rows).details()
        chunk = encode_forward(1, (WaveEntry(81, pos, 2, params),), [token, token], None, steps=2)
        assert "1-token entries" in _refusal(server.address, chunk).details()
        with pytest.raises(StationCallError) as err:
            list(client.forward_steps(1, (WaveEntry(81, pos + 1, 1, params),), [token], steps=2, reply_steps=1))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "skips ahead" in str(err.value)
        assert client.info().sequences == 1
        replies = list(client.forward_steps(2, (WaveEntry(81, pos, 1, params),), [token], steps=3, reply_steps=2))
        assert [len(r.output.samples) for r in replies] == [2, 1]
    finally:
        client.release([81])


def _hidden():
    import torch
    return torch.zeros(1, 64)


# ---- ending a streamed call early ------------------------------------------------------------------------------
def test_a_wave_ended_early_lands_at_its_committed_steps():
    sched = _decoding()
    plan = sched.plan(max_steps=6, reply_steps=2)
    with pytest.raises(ValueError):  # nothing committed yet: not a wave that ran and was ended
        sched.commit(plan, [])
    sched.commit(plan, [SampledToken(11), SampledToken(0), SampledToken(13)] * 2)  # seq 2 ends on the EOS
    assert not sched.admissible()
    sched.add(4, "d", (3, 4), SamplingParams(max_tokens=5))
    assert sched.admissible()  # a lane is free for it
    landed = sched.commit(plan, [], first_step=2)
    assert landed.events == () and landed.released == (2,) and landed.landed_steps == 2
    nxt = sched.plan(max_steps=1)
    assert [(e.seq_id, e.start_pos) for e in nxt.entries] == [(1, 5), (3, 3), (4, 0)]
    assert len(nxt.entries[0].blocks) == 2  # the table cut to the positions held, its reserved block kept aside
    assert not sched.admissible()


class _EndsAfterParts(_Parts):
    """A LocalLink that submits a request once the first streamed call has sent `after` parts."""

    def __init__(self, station, parts, submit, after=1):
        super().__init__(station, parts)
        self.submit, self.after = submit, after

    def forward_steps(self, wave_id, entries, token_ids, steps, reply_steps):
        for i, out in enumerate(super().forward_steps(wave_id, entries, token_ids, steps, reply_steps)):
            if i + 1 == self.after and self.submit is not None:
                submit, self.submit = self.submit, None
                submit()
            yield out


def test_a_request_that_arrives_ends_the_streamed_calls_within_a_part(tiny_llama):
    """A 32-step call in parts of 2; a request submitted after its first part ends it within a part or two (the
    wave lands early, the newcomer is admitted), and every token is as each request gets it alone."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    late_prompt, late_params = [1, 90, 91, 92], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=3)
    alone = Station(tiny_llama, WHOLE)
    want = generate_one(alone, PROMPT, params)[0]
    want_late = generate_one(Station(tiny_llama, WHOLE), late_prompt, late_params)[0]
    parts, late = [], []
    link = _EndsAfterParts(Station(tiny_llama, WHOLE), parts,
                           lambda: late.append(engine.submit(late_prompt, late_params)))
    engine = Engine([link], ModelConfig.from_dir(tiny_llama),
                    SchedulerConfig(max_seqs=4, max_wave_tokens=64, decode_steps=32, reply_steps=2))
    try:
        first = engine.submit(PROMPT, params)
        assert first.result(timeout=120)[0].token_ids == want
        assert late and late[0].result(timeout=120)[0].token_ids == want_late
        assert engine.quiesce(30) and engine.stats().kv_bytes_used == 0
        assert engine.stats().waves_ended_early >= 1  # wavemesh_waves_ended_early_total
    finally:
        engine.close()
    # the first streamed call: parts of 2 until the newcomer ended it (a part or two after it came), not 16 of them
    assert parts[:2] == [2, 2] and sum(parts) < 40 and len(parts) > 3, parts


class _Calls(LocalLink):
    """A LocalLink that notes each streamed call's entries and the steps of each of its parts, each part taking 20
    ms more (a station slower than the engine's turn, as a real one is). Its one-step calls wait for `opened` (set
    unless a test clears it: requests submitted meanwhile meet in the waves after, however late the test thread
    runs)."""

    def __init__(self, station):
        super().__init__(station)
        self.calls: list[tuple[int, list[int]]] = []
        self.opened = threading.Event()
        self.opened.set()

    def forward(self, wave_id, entries, token_ids, hidden, steps=1):
        assert self.opened.wait(60), "the test never opened the link"
        return super().forward(wave_id, entries, token_ids, hidden, steps)

    def forward_steps(self, wave_id, entries, token_ids, steps, reply_steps):
        parts: list[int] = []
        self.calls.append((len(entries), parts))
        for out in super().forward_steps(wave_id, entries, token_ids, steps, reply_steps):
            parts.append(len(out.samples) // len(entries))
            time.sleep(0.02)
            yield out


@pytest.mark.parametrize("how", ["stop", "cancel"])
def test_a_sequence_that_ends_inside_a_streamed_call_ends_the_call(tiny_llama, how):
    """Two sequences in one 32-step call in parts of 2; one ends after its third token (a stop token, or its
    request is cancelled): the call ends within a part or two instead of computing the ended row to step 32, the
    other sequence goes on in a new call with the tokens it gets alone, and the first stops where it should."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    other_prompt = [1, 90, 91, 92]
    want = generate_one(Station(tiny_llama, WHOLE), PROMPT, params)[0]
    other = generate_one(Station(tiny_llama, WHOLE), other_prompt, params)[0]
    stop_at = next(i for i in range(2, len(other)) if other[i] not in other[:i])  # a token new to the sequence
    link = _Calls(Station(tiny_llama, WHOLE))
    engine = Engine([link], ModelConfig.from_dir(tiny_llama),
                    SchedulerConfig(max_seqs=4, max_wave_tokens=64, decode_steps=32, reply_steps=2))

    def shared_steps() -> list[int]:  # the steps of each streamed call holding both sequences, so far
        return [sum(parts) for n, parts in list(link.calls) if n == 2]

    before_end = 0  # steps the first shared call had run when the request was cancelled
    link.opened.clear()  # the first wave waits at the station until both requests are in: they decode together
    try:
        if how == "stop":
            ending = engine.submit(other_prompt, replace(params, stop_token_ids=(other[stop_at],)))
        else:
            ending = engine.submit(other_prompt, params)
        first = engine.submit(PROMPT, params)
        link.opened.set()
        if how == "cancel":
            deadline = time.monotonic() + 60
            while len(ending.outputs[0].token_ids) < 3 and time.monotonic() < deadline:
                time.sleep(0.001)
            before_end = (shared_steps() or [0])[0]
            engine.cancel(ending.request_id)
        assert first.result(timeout=120)[0].token_ids == want
        out = ending.result(timeout=120)[0]
        if how == "stop":
            assert (out.token_ids, out.finish_reason) == (other[:stop_at + 1], "stop")
        else:
            assert out.finish_reason == "cancelled" and out.token_ids == other[:len(out.token_ids)]
        assert engine.quiesce(30) and engine.stats().kv_bytes_used == 0
        assert engine.stats().waves_ended_early >= 1
    finally:
        engine.close()
    shared = shared_steps()
    # a stop token after the third token, or a cancel however late the polling thread saw the third token: the
    # call ends within the part under way and one or two more (2 steps a part), not at step 32
    assert shared and shared[0] <= max(6, before_end) + 6, link.calls


def test_a_sequence_whose_length_ends_inside_a_streamed_call_rides_it_to_its_end(tiny_llama):
    """Two sequences in one 16-step call in parts of 2, one with 5 tokens, the other 40: the call is planned for
    the longer one and not ended when the shorter reaches its length (a planned end, unlike a stop or a cancel):
    the short one ends at its 5th token, its later rows dropped, the long one runs on in the same call; both
    exact, no call ended early, every KV block back."""
    short, long = SamplingParams(max_tokens=5, ignore_eos=True), SamplingParams(max_tokens=40, ignore_eos=True)
    other_prompt = [1, 90, 91, 92]
    want_short = generate_one(Station(tiny_llama, WHOLE), other_prompt, short)[0]
    want_long = generate_one(Station(tiny_llama, WHOLE), PROMPT, long)[0]
    link = _Calls(Station(tiny_llama, WHOLE))
    engine = Engine([link], ModelConfig.from_dir(tiny_llama),
                    SchedulerConfig(max_seqs=4, max_wave_tokens=64, decode_steps=16, reply_steps=2))
    try:
        ending = engine.submit(other_prompt, short)
        first = engine.submit(PROMPT, long)
        out = ending.result(timeout=120)[0]
        assert (out.token_ids, out.finish_reason) == (want_short, "length")
        assert first.result(timeout=120)[0].token_ids == want_long
        assert engine.quiesce(30) and engine.stats().kv_bytes_used == 0
        assert engine.stats().waves_ended_early == 0
    finally:
        engine.close()
    shared = [sum(parts) for n, parts in list(link.calls) if n == 2]
    # the short sequence had at most 4 tokens to go when the call holding both began: cut at its length, the call
    # would have run at most 4 steps
    assert shared and shared[0] == 16, link.calls


def test_end_steps_ends_a_forward_steps_call_after_its_step_under_way(tiny_llama, steps_server):
    """EndSteps during a 20-step ForwardSteps: the stream ends OK with fewer steps, each reply's samples those the
    sequence gets alone, and the station's KV holds exactly the steps that came (the next call goes on from
    there); EndSteps of a wave not running says so."""
    _, client = steps_server
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want, _ = generate_one(Station(tiny_llama, WHOLE), PROMPT, params)
    got = [_prefill(client, 91, params)]
    try:
        assert client.end_steps(12345) is False
        replies = client.forward_steps(5, (WaveEntry(91, len(PROMPT), 1, params),), [got[-1]], steps=20,
                                       reply_steps=1)
        got += [s.token_id for s in next(replies).output.samples]
        assert client.end_steps(5) is True
        got += [s.token_id for r in replies for s in r.output.samples]
        assert 1 <= len(got) - 1 < 20  # the first step, and any under way when the end came
        out = client.forward(6, (WaveEntry(91, len(PROMPT) + len(got) - 1, 1, params),), token_ids=[got[-1]])
        got.append(out.samples[0].token_id)
        assert got == want[:len(got)]
    finally:
        client.release([91])


def test_a_stream_that_ends_short_unasked_is_a_station_failure(tiny_llama):
    """A link whose stream stops after its first part though nobody ended it: the wave fails as a dead station's
    would (StationDown), and its request ends with an error (no recovery here) instead of hanging."""

    class Short(_Parts):
        def forward_steps(self, wave_id, entries, token_ids, steps, reply_steps):
            yield next(iter(super().forward_steps(wave_id, entries, token_ids, steps, reply_steps)))

    engine = Engine([Short(Station(tiny_llama, WHOLE), [])], ModelConfig.from_dir(tiny_llama),
                    SchedulerConfig(max_seqs=4, max_wave_tokens=64, decode_steps=8, reply_steps=2))
    try:
        out = engine.submit(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True)).result(timeout=120)[0]
        assert out.finish_reason == "error" and "ended after 2 of its 8 steps, unasked" in out.error
    finally:
        engine.close()


def test_a_stream_that_breaks_after_its_last_part_fails_no_wave(tiny_llama):
    """A link whose stream raises StationDown once every part came (a station stopped before its call's end): the
    wave landed with its last part, so its tokens stand and the engine serves on, the same tokens as one step a
    call (a failure report on a landed wave once stopped the wave loop)."""

    class BreaksAtEnd(_Parts):
        def forward_steps(self, wave_id, entries, token_ids, steps, reply_steps):
            ran = 0
            for out in super().forward_steps(wave_id, entries, token_ids, steps, reply_steps):
                ran += len(out.samples) // len(entries)
                yield out
            # only a call that ran every step breaks: one ended early (as a request submitted while it runs asks)
            # and then broken is a stream short of its steps, which fails its wave (the test before this one)
            if ran == steps:
                raise StationDown("the stream broke after its last part")

    prompts = [[1, 7 + i, 40, 9 * i + 3] for i in range(3)]
    params = [SamplingParams(max_tokens=14 + i, ignore_eos=True) for i in range(3)]
    want = [o.token_ids for o in _serve(tiny_llama, prompts, params)]
    engine = Engine([BreaksAtEnd(Station(tiny_llama, WHOLE), [])], ModelConfig.from_dir(tiny_llama),
                    SchedulerConfig(max_seqs=4, max_wave_tokens=64, decode_steps=4, reply_steps=2))
    try:
        for _ in range(2):  # and again, on the same loop
            outs = [s.result(timeout=60)[0] for s in [engine.submit(p, sp) for p, sp in zip(prompts, params)]]
            assert [o.token_ids for o in outs] == want
            assert {o.finish_reason for o in outs} == {"length"}
    finally:
        engine.close()


def test_a_failure_reported_for_a_landed_wave_is_ignored(tiny_llama):
    """A pipeline reporting a failure for a wave whose samples it already delivered: the engine leaves it (nothing
    of it is in flight to end or replay) and the requests after it are served."""
    engine = Engine([LocalLink(Station(tiny_llama, WHOLE))], ModelConfig.from_dir(tiny_llama),
                    SchedulerConfig(max_seqs=4, max_wave_tokens=64))
    landed = []
    submit = engine.pipeline.submit
    engine.pipeline.submit = lambda plan: (landed.append(plan), submit(plan))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    try:
        first = engine.submit(PROMPT, params).result(timeout=60)[0]
        assert engine.quiesce(30) and landed
        engine._on_wave_done(landed[0], None, StationDown("late report"))
        again = engine.submit(PROMPT, params).result(timeout=60)[0]
        assert again.token_ids == first.token_ids and again.finish_reason == "length"
        assert engine.stats().waves_in_flight == 0
    finally:
        engine.close()


def test_a_fault_of_the_wave_loop_ends_every_request_with_its_error(tiny_llama):
    """The wave loop itself fails (here the scheduler's commit raises): the live requests end with an error naming
    it instead of waiting for ever, and new ones are refused (503) rather than queued on a loop that is gone."""
    from orchestrator.engine import AdmissionError

    engine = Engine([LocalLink(Station(tiny_llama, WHOLE))], ModelConfig.from_dir(tiny_llama),
                    SchedulerConfig(max_seqs=4, max_wave_tokens=64))

    def broken_commit(*args, **kw):
        raise RuntimeError("a planted fault")

    engine.scheduler.commit = broken_commit
    try:
        streams = [engine.submit(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True)) for _ in range(2)]
        outs = [s.result(timeout=60)[0] for s in streams]
        assert all(o.finish_reason == "error" and "wave loop failed: RuntimeError: a planted fault" in o.error
                   for o in outs), outs
        with pytest.raises(AdmissionError) as refused:
            engine.submit(PROMPT, SamplingParams(max_tokens=6))
        assert refused.value.status == 503
    finally:
        engine.close()


def test_each_part_has_the_time_of_one_call(tiny_llama):
    """A streamed call whose parts each take half the client's timeout runs past that timeout as a whole and
    completes: the deadline is a call's for each part."""
    with whole_station_server(tiny_llama) as (server, _):
        slow = StationClient(server.address, timeout_s=1.0, hidden_size=64, vocab_size=512)
        station = server.servicer.station
        forward = station.forward

        def slow_forward(*args, **kw):
            if kw.get("steps", 1) > 1:
                time.sleep(0.5)
            return forward(*args, **kw)

        station.forward = slow_forward
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        try:
            token = _prefill(slow, 95, params)
            t0 = time.monotonic()
            replies = list(slow.forward_steps(1, (WaveEntry(95, len(PROMPT), 1, params),), [token], steps=8,
                                              reply_steps=2))
            assert time.monotonic() - t0 > 1.5 and [len(r.output.samples) for r in replies] == [2, 2, 2, 2]
        finally:
            slow.release([95])
            slow.close()
