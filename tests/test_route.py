"""The route's state machine alone, then a drain through a real engine on in-process stations."""
from __future__ import annotations

import threading

import pytest
from tokenizers import Tokenizer

from mesh.core.config import ModelConfig, SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from orchestrator.engine import AdmissionError, Engine
from orchestrator.pipeline import LocalLink
from orchestrator.route import TRANSITIONS, IllegalTransition, RouteMachine, RouteState, check_transition
from station.step import Station

S = RouteState
SHUTTING_DOWN = "the server is shutting down; retry elsewhere or later"


def _machine() -> RouteMachine:
    return RouteMachine(threading.Condition(threading.RLock()))


def _admits(m: RouteMachine) -> bool:
    return m.refusal() is None


def _refused(m: RouteMachine) -> tuple[str, int, str]:
    r = m.refusal()
    assert r is not None, m.state
    return r.reason, r.status, r.message


def test_every_state_has_a_row_and_close_is_legal_from_each():
    assert set(TRANSITIONS) == set(RouteState)
    for state in RouteState:
        check_transition(state, S.CLOSED)


def test_serve_switch_serve():
    m = _machine()
    assert (m.state, m.paused, _admits(m)) == (S.SERVING, False, True)
    m.begin_switch()
    assert (m.state, m.paused, _admits(m)) == (S.SWITCHING, True, True)  # requests queue while the route moves
    m.end_switch()
    assert (m.state, m.paused, _admits(m)) == (S.SERVING, False, True)


def test_serve_recover_serve_without_an_error():
    m = _machine()
    assert m.begin_recovery()
    assert not m.begin_recovery()  # one recovery at a time
    assert (m.state, m.paused, _admits(m), m.error) == (S.RECOVERING, True, True, None)
    m.end_recovery()
    assert (m.state, m.paused, _admits(m), m.error) == (S.SERVING, False, True, None)


def test_serve_recover_serve_with_a_route_error_set_and_cleared():
    m = _machine()
    assert not m.fail_recovery("too early")  # no recovery under way: nothing to fail
    assert m.begin_recovery()
    assert m.fail_recovery("StationCallError: gone")  # first failure: end the requests
    assert not m.fail_recovery("StationCallError: still gone")  # later ones keep the first reason
    assert m.error == "StationCallError: gone"
    assert _refused(m) == ("route_down", 503, "a station is down and not back yet (StationCallError: gone)")
    m.end_recovery()
    assert (m.state, m.error, _admits(m), m.paused) == (S.SERVING, None, True, False)


def test_serve_drain_closed():
    m = _machine()
    m.drain()
    assert (m.state, m.paused, m.draining) == (S.DRAINING, False, True)  # admitted requests keep running
    assert _refused(m) == ("shutting_down", 503, SHUTTING_DOWN)
    m.drain()  # a second signal changes nothing
    assert m.state is S.DRAINING
    m.close()
    assert (m.state, m.closed, m.paused) == (S.CLOSED, True, False)
    assert _refused(m) == ("shutting_down", 503, SHUTTING_DOWN)


def _into(m: RouteMachine, state: RouteState) -> RouteMachine:
    {S.SERVING: lambda: None, S.SWITCHING: m.begin_switch, S.RECOVERING: m.begin_recovery,
     S.DRAINING: m.drain, S.CLOSED: m.close}[state]()
    assert m.state is state
    return m


@pytest.mark.parametrize("state", list(RouteState))
def test_close_from_each_state(state):
    m = _into(_machine(), state)
    m.close()
    assert (m.state, m.paused, m.error) == (S.CLOSED, False, None)
    assert _refused(m)[0] == "shutting_down"
    m.end_switch()  # a switch or recovery that outlives the close does not reopen the route
    m.end_recovery()
    assert not m.begin_recovery()
    assert m.state is S.CLOSED


@pytest.mark.parametrize(("source", "target"), [(S.CLOSED, S.SERVING), (S.DRAINING, S.SERVING),
                                                (S.CLOSED, S.SWITCHING), (S.SWITCHING, S.SWITCHING)])
def test_illegal_transitions_name_both_ends(source, target):
    with pytest.raises(IllegalTransition, match=f"from {source.value} to {target.value}") as err:
        check_transition(source, target)
    assert (err.value.source, err.value.target) == (source, target)


def test_a_switch_is_refused_when_closed_or_already_switching():
    m = _into(_machine(), S.SWITCHING)
    with pytest.raises(IllegalTransition, match="from switching to switching"):
        m.begin_switch()
    m.close()
    with pytest.raises(IllegalTransition, match="from closed to switching"):
        m.begin_switch()
    assert m.state is S.CLOSED


def test_a_station_dies_mid_switch_and_the_switch_ends_first():
    m = _into(_machine(), S.SWITCHING)
    assert m.begin_recovery()
    m.end_switch()
    assert (m.state, m.paused) == (S.RECOVERING, True)  # the recovery still owns the pause
    m.end_recovery()
    assert (m.state, m.paused) == (S.SERVING, False)


def test_a_station_dies_mid_switch_and_the_recovery_ends_first():
    m = _into(_machine(), S.SWITCHING)
    assert m.begin_recovery()
    m.end_recovery()
    assert (m.state, m.paused) == (S.SWITCHING, True)  # back to the unfinished switch: still no planning
    m.end_switch()
    assert (m.state, m.paused) == (S.SERVING, False)


def test_a_switch_during_a_recovery_runs_under_its_pause():
    m = _into(_machine(), S.RECOVERING)
    m.begin_switch()
    assert m.state is S.RECOVERING
    with pytest.raises(IllegalTransition):
        m.begin_switch()
    m.end_recovery()
    assert (m.state, m.paused) == (S.SWITCHING, True)
    m.end_switch()
    assert m.state is S.SERVING


@pytest.mark.parametrize("busy", [S.SWITCHING, S.RECOVERING])
def test_a_drain_begun_while_busy_refuses_at_once_and_ends_into_draining(busy):
    m = _into(_machine(), busy)
    m.drain()
    assert (m.state, m.paused, m.draining) == (busy, True, True)
    assert _refused(m)[0] == "shutting_down"
    if busy is S.SWITCHING:
        m.end_switch()
    else:
        m.end_recovery()
    assert (m.state, m.paused) == (S.DRAINING, False)


def test_a_station_failure_during_a_drain_is_recovered_and_the_drain_goes_on():
    m = _into(_machine(), S.DRAINING)
    assert m.begin_recovery()
    assert m.fail_recovery("lost")
    assert _refused(m)[0] == "shutting_down"  # the drain's reason comes first
    m.end_recovery()
    assert (m.state, m.error, m.paused) == (S.DRAINING, None, False)
    m.begin_switch()  # the requests still running may also be moved
    m.end_switch()
    assert m.state is S.DRAINING


def test_every_transition_wakes_waiters_on_the_shared_condition():
    m = _machine()
    seen = []

    def waiter():
        with m.lock:
            seen.append(m.lock.wait_for(lambda: m.closed, timeout=30))

    t = threading.Thread(target=waiter)
    t.start()
    m.close()
    t.join(timeout=30)
    assert seen == [True]


# ---- a drain through a real engine ------------------------------------------------------------------
def _engine(model_dir) -> Engine:
    links = [LocalLink(Station(model_dir, StationSpec(layers=(0, 6))))]
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return Engine(links, ModelConfig.from_dir(model_dir), SchedulerConfig(max_seqs=4, max_wave_tokens=64), tok)


def test_a_drain_refuses_new_requests_while_an_admitted_one_completes(tiny_llama):
    engine = _engine(tiny_llama)
    try:
        admitted = engine.submit([1, 5, 6, 7], SamplingParams(max_tokens=300, ignore_eos=True))
        assert not engine.wait_idle(0)  # live until its 300th token
        engine.stop_admitting()
        assert engine.route.state is S.DRAINING
        with pytest.raises(AdmissionError) as refused:
            engine.submit([1, 8, 9], SamplingParams(max_tokens=4))
        assert (refused.value.reason, refused.value.status, refused.value.message) == ("shutting_down", 503,
                                                                                       SHUTTING_DOWN)
        assert engine.wait_idle(120)
        assert engine.idle() and admitted.done
        out = admitted.result(timeout=1)[0]
        assert (out.finish_reason, len(out.token_ids)) == ("length", 300)
    finally:
        engine.close()
    assert engine.route.state is S.CLOSED
    with pytest.raises(IllegalTransition, match="from closed to switching"):
        engine.switch_route([])


def test_switch_pause_is_the_longest_wait_of_a_stream_that_was_decoding():
    from orchestrator.switch_pause import SwitchPauses

    p = SwitchPauses()
    p.token(1, 10.0)
    p.token(2, 10.5)
    p.begin()  # both wait for their next token
    p.token(3, 11.0)  # a stream that had no token before the switch does not count
    p.token(2, 12.0)
    assert p.pauses == []
    p.forget(1)  # ended without another token: drops out, closing the switch
    assert p.pauses == [1.5] and p.switches == 1
    p.begin()
    p.token(2, 20.0)
    p.token(3, 11.0 + 9.5)
    assert p.pauses == [1.5, 9.5]
    p.begin()  # a switch with no stream that waits records no pause
    p.forget(2), p.forget(3)
    assert p.pauses == [1.5, 9.5] and p.switches == 3
