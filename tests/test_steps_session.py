"""Steps sessions on a relay link (station/steps_session.py): a several-step decode wave sent once, then each step's
rows alone. A session's steps answer as whole requests would; what a session refuses is named and the station goes
on; a chain whose successor takes no sessions (an earlier build) sends whole requests; logprobs and every station's
KV report come through a session unchanged."""
from __future__ import annotations

import socket

import grpc
import numpy as np
import pytest
import torch

from mesh.core.params import SamplingParams
from mesh.core.proto import station_pb2 as pb
from mesh.core.wave import WaveEntry
from mesh.core.wire import entries_to_proto
from mesh.core.wire_tensor import WireError, tensor_to_proto
from orchestrator.remote import RemoteLink
from station.link_frames import ERROR, REPLY, REQUEST, STEP, STEP_INDEX, STEP_REPLY, STEPS
from station.step_answers import HopReport, pack_step_answer, unpack_step_answer

from test_relay import TOKEN, _run, chains, reference  # noqa: F401 - fixtures
from test_relay_link import _closed, _connect, _frame, _read, last_station  # noqa: F401 - fixtures

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _prompt(sock: socket.socket, seq_id: int, rows: torch.Tensor) -> None:
    """A 2-row prompt of `seq_id` through a whole request (the KV a decode wave then extends)."""
    request = pb.ForwardRequest(wave_id=seq_id, entries=entries_to_proto((WaveEntry(seq_id, 0, len(rows), GREEDY),)))
    tensor_to_proto(rows, into=request.hidden)
    sock.sendall(_frame(REQUEST, request.SerializeToString()))
    assert _read(sock)[0] == REPLY


def _steps(seq_ids: list[int], start: int, steps: int) -> bytes:
    """A STEPS request: 1-token greedy entries at `start` for `steps` steps."""
    entries = tuple(WaveEntry(s, start, 1, GREEDY) for s in seq_ids)
    return pb.ForwardRequest(wave_id=seq_ids[0], entries=entries_to_proto(entries), steps=steps).SerializeToString()


def _step(sock: socket.socket, k: int, rows: torch.Tensor) -> tuple[int, int, bytes]:
    sock.sendall(_frame(STEP, STEP_INDEX.pack(k), rows=rows.numpy().tobytes()))
    return _read(sock)


def test_a_session_answers_each_step_as_a_whole_request(last_station):
    """Two sequences with the same prompt: one decoded by whole requests, one in a session; the same tokens, the
    session's answer holding the station's report, the ids and the samples' message."""
    station = last_station.servicer.station
    hidden = station.config.hidden_size
    torch.manual_seed(5)
    prompt, steps = torch.randn(2, hidden), [torch.randn(1, hidden) for _ in range(3)]
    try:
        with _connect(last_station) as sock:
            assert _read(sock)[0] == REPLY
            _prompt(sock, 950, prompt)
            _prompt(sock, 951, prompt)
            whole = []
            for k, rows in enumerate(steps):
                request = pb.ForwardRequest(wave_id=9, entries=entries_to_proto((WaveEntry(950, 2 + k, 1, GREEDY),)))
                tensor_to_proto(rows, into=request.hidden)
                sock.sendall(_frame(REQUEST, request.SerializeToString()))
                kind, _, body = _read(sock)
                whole.append(pb.ForwardReply.FromString(body).samples.samples[0].token_id)
            before = last_station.relay_link.session_steps
            sock.sendall(_frame(STEPS, _steps([951], 2, 3)))
            got = []
            for k, rows in enumerate(steps):
                kind, _, body = _step(sock, k, rows)
                assert kind == STEP_REPLY
                answer = unpack_step_answer(body, n_entries=1, vocab_size=station.config.vocab_size)
                assert len(answer.hops) == 1 and answer.hops[0].forward_seconds > 0
                assert answer.hops[0].sequences == 2 and answer.hops[0].call_seconds == 0.0
                assert [s.token_id for s in pb.Samples.FromString(answer.samples).samples] == answer.ids.tolist()
                got.append(int(answer.ids[0]))
            assert got == whole and last_station.relay_link.session_steps == before + 3
            assert station.kv.length(951) == station.kv.length(950) == 5
            sock.sendall(_frame(REQUEST, b"\xff"))  # the session over, the connection takes whole requests again
            assert _read(sock)[:2] == (ERROR, INVALID)
    finally:
        station.release([950, 951])


@pytest.mark.parametrize("case, problem", [
    ("outside", "a STEP frame outside a steps session"),
    ("order", "step 1 where step 0 of 2 was expected"),
    ("size", "hidden: 8 bytes of rows, expected"),
    ("nan", "hidden[0]: holds NaN or infinite values"),
    ("garbage", "steps: not a valid protobuf message"),
    ("prompt", "several decode steps take 1-token entries that sample"),
    ("payload", "a session takes hidden rows step by step"),
    ("unknown", "unknown seq_id 959"),
])
def test_what_a_session_refuses_is_named_and_the_station_goes_on(last_station, case, problem):
    station = last_station.servicer.station
    hidden = station.config.hidden_size
    rows = torch.randn(1, hidden)
    try:
        with _connect(last_station) as sock:
            assert _read(sock)[0] == REPLY
            if case != "outside":
                _prompt(sock, 958, torch.randn(2, hidden))
            opened = {"garbage": b"\xff\xff", "unknown": _steps([959], 2, 2),
                      "prompt": pb.ForwardRequest(wave_id=1, steps=2, entries=entries_to_proto(
                          (WaveEntry(958, 2, 2, GREEDY),))).SerializeToString()}.get(case, _steps([958], 2, 2))
            if case == "payload":
                request = pb.ForwardRequest.FromString(opened)
                tensor_to_proto(rows, into=request.hidden)
                opened = request.SerializeToString()
            if case != "outside":
                sock.sendall(_frame(STEPS, opened))
            sent = {"order": (1, rows), "size": (0, torch.zeros(2)),
                    "nan": (0, torch.full((1, hidden), float("nan")))}.get(case, (0, rows))
            kind, status, body = _step(sock, *sent)
            assert (kind, status) == (ERROR, INVALID) and problem.encode() in body, body
            if case != "outside":  # the session ended with its error: no step is taken now
                kind, status, body = _step(sock, 0, rows)
                assert (kind, status) == (ERROR, INVALID) and b"outside a steps session" in body
            assert _closed(sock)
        with _connect(last_station) as sock:  # the station goes on
            assert _read(sock)[0] == REPLY
            _prompt(sock, 957, torch.randn(2, hidden))
    finally:
        station.release([957, 958])
    assert station.kv.length(958) is None


def test_a_successor_that_takes_no_sessions_gets_whole_requests(tiny_llama, reference, chains):
    """A chain whose second station takes no sessions (as an earlier build's link): the first station relays each
    step as a whole request, with one station's tokens; with sessions, the same tokens and no whole request for a
    decode step."""
    prompts, params, ref = reference
    link, successors = chains[2][1].relay_link, chains[2][0].servicer.successors
    opener, link._steps_opener = link._steps_opener, None
    successors.close()  # the first station's connections learn what the link speaks when they open
    try:
        steps, requests = link.session_steps, link.requests
        assert _run(tiny_llama, chains[2], "direct", prompts, params)[0] == ref
        assert link.session_steps == steps and link.requests > requests
    finally:
        link._steps_opener = opener
        successors.close()
    steps, requests = link.session_steps, link.requests
    assert _run(tiny_llama, chains[2], "direct", prompts, params, decode_steps=16)[0] == ref
    assert link.session_steps > steps
    # the requests left whole: prompt waves and a wave's first decode step when it mixes in prompt rows
    assert link.requests - requests < link.session_steps - steps


def test_logprobs_and_every_stations_report_come_through_sessions(tiny_llama, chains):
    """A 3-station chain: a relayed several-step call (sessions at both hops) draws the tokens and logprobs of
    single-step relayed calls (whole requests), and its reply holds one RelayHop per relayed station with its KV."""
    first = RemoteLink(chains[3][0].address, timeout_s=30, token=TOKEN)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, temperature=0.8, seed=3)
    relay_to = [s.address for s in chains[3][1:]]
    sessions = [s.relay_link.session_steps for s in chains[3][1:]]
    try:
        for seq in (961, 962):
            first.client.relay(seq, (WaveEntry(seq, 0, 3, params),), token_ids=[4, 5, 6], relay_to=relay_to)
        reply = first.client.relay(2, (WaveEntry(961, 3, 1, params),), token_ids=[7], relay_to=relay_to, steps=4)
        assert [s.relay_link.session_steps - n for s, n in zip(chains[3][1:], sessions)] == [4, 4]
        singles, token = [], 7
        for k in range(4):
            single = first.client.relay(3 + k, (WaveEntry(962, 3 + k, 1, params),), token_ids=[token],
                                        relay_to=relay_to).output.samples[0]
            singles.append(single)
            token = single.token_id
        assert reply.output.samples == singles and all(len(s.top_logprobs) == 2 for s in singles)
        assert [h.kv.sequences for h in reply.hops] == [2, 2] and all(h.forward_seconds > 0 for h in reply.hops)
        assert [s.servicer.station.kv.length(961) for s in chains[3]] == [7, 7, 7]
    finally:
        for s in chains[3]:
            s.servicer.station.release([961, 962])
        first.close()


def test_an_answer_is_checked_before_its_ids_are_fed_on():
    hop = HopReport(0.01, 0.02, 0.0, 1, 2, 3, 4)
    body = pack_step_answer((hop,), np.array([5, 6]), b"")
    answer = unpack_step_answer(body, n_entries=2, vocab_size=10)
    assert answer.hops == (hop,) and answer.ids.tolist() == [5, 6]
    for bad, problem in [(body[:3], "shorter than its"), (body[:-1], "short of its"),
                         (pack_step_answer((hop,), np.array([5]), b""), "expected 1 to"),
                         (pack_step_answer((), np.array([5, 6]), b""), "0 station reports"),
                         (pack_step_answer((hop,), np.array([5, 10]), b""), "token id 10 is outside")]:
        with pytest.raises(WireError, match=problem):
            unpack_step_answer(bad, n_entries=2, vocab_size=10)
