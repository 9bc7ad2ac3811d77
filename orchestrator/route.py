"""The route's state machine: serving, switching, recovering, draining, closed.

The engine reports every route event here (a switch or a recovery begins or ends, a drain begins,
the engine closes) and asks every route question here (may a request be admitted? may a wave be
planned?). Each state change is one entry of `TRANSITIONS`, taken under the engine's condition, so
the engine's waits can use the same condition and every change wakes them.

A switch and a recovery can overlap (a station dies mid-switch; a station is lost and an operator
moves the route meanwhile), and a drain can begin during either: admitted requests still need a
route. So the machine keeps, beside its state, the states to return to when the switch or recovery
under way ends (at most two: the base, serving or draining, and an unfinished switch above it).
"""
from __future__ import annotations

import threading
from enum import Enum
from types import MappingProxyType

from orchestrator.pipeline import StationLink
from orchestrator.scheduler_types import AdmissionError, KVLimits

__all__ = ["TRANSITIONS", "IllegalTransition", "RouteMachine", "RouteState", "check_transition", "route_limits"]


class RouteState(Enum):
    """Where the engine's route stands."""

    SERVING = "serving"  # waves planned, requests admitted
    SWITCHING = "switching"  # moving onto a new chain of stations: no new wave planned
    RECOVERING = "recovering"  # rebuilding the route after a station failure: no new wave planned
    DRAINING = "draining"  # new requests refused; admitted ones run to their end
    CLOSED = "closed"  # the engine stopped


_S = RouteState
TRANSITIONS = MappingProxyType({
    _S.SERVING: frozenset({_S.SWITCHING, _S.RECOVERING, _S.DRAINING, _S.CLOSED}),
    # switched (back to serving or into the drain begun meanwhile); a station died mid-switch
    _S.SWITCHING: frozenset({_S.SERVING, _S.DRAINING, _S.RECOVERING, _S.CLOSED}),
    # rebuilt (back to serving, into a drain, or back to the switch it interrupted)
    _S.RECOVERING: frozenset({_S.SERVING, _S.DRAINING, _S.SWITCHING, _S.CLOSED}),
    # the requests still running need a route: it may be moved or rebuilt, never reopened
    _S.DRAINING: frozenset({_S.SWITCHING, _S.RECOVERING, _S.CLOSED}),
    _S.CLOSED: frozenset({_S.CLOSED}),
})


class IllegalTransition(RuntimeError):
    """A route event that its current state does not allow."""

    def __init__(self, source: RouteState, target: RouteState) -> None:
        super().__init__(f"route: no transition from {source.value} to {target.value}")
        self.source, self.target = source, target


def check_transition(source: RouteState, target: RouteState) -> None:
    """Raise IllegalTransition unless `TRANSITIONS` allows `source` -> `target`."""
    if target not in TRANSITIONS[source]:
        raise IllegalTransition(source, target)


class RouteMachine:
    """The route's one state and its error; every change under `lock`, every change notifies it."""

    def __init__(self, lock: threading.Condition) -> None:
        self.lock = lock  # reentrant: the engine calls in while holding it
        self._state = RouteState.SERVING
        self._resume: list[RouteState] = []  # where the switch/recovery under way returns, innermost last
        self._error: str | None = None  # why the route is down while it cannot be rebuilt

    @property
    def state(self) -> RouteState:
        """The current state."""
        with self.lock:
            return self._state

    @property
    def error(self) -> str | None:
        """Why the route is down while a recovery cannot rebuild it, else None."""
        with self.lock:
            return self._error

    @property
    def paused(self) -> bool:
        """True while no new wave may be planned (switching or recovering)."""
        with self.lock:
            return self._state in (RouteState.SWITCHING, RouteState.RECOVERING)

    @property
    def closed(self) -> bool:
        """True once the engine has closed."""
        with self.lock:
            return self._state is RouteState.CLOSED

    @property
    def draining(self) -> bool:
        """True once a drain has begun (also while a switch or recovery begun before it still runs)."""
        with self.lock:
            return self._state is RouteState.DRAINING or self._resume[:1] == [RouteState.DRAINING]

    def refusal(self) -> AdmissionError | None:
        """Why a new request is refused now (503 shutting_down / route_down), or None if admitted."""
        with self.lock:
            if self._state is RouteState.CLOSED or self.draining:
                return AdmissionError("shutting_down", 503, "the server is shutting down; retry elsewhere or later")
            if self._error is not None:
                return AdmissionError("route_down", 503, f"a station is down and not back yet ({self._error})")
            return None

    def check_admission(self) -> None:
        """Raise the AdmissionError of `refusal()`, if any."""
        if (refused := self.refusal()) is not None:
            raise refused

    def begin_switch(self) -> None:
        """A route switch starts: stop planning. During a recovery the switch runs under its pause and the
        recovery, when done, returns to the switch. Raises IllegalTransition when closed or already switching."""
        with self.lock:
            if self._state is RouteState.RECOVERING:
                if RouteState.SWITCHING in self._resume:
                    raise IllegalTransition(RouteState.SWITCHING, RouteState.SWITCHING)
                self._resume.append(RouteState.SWITCHING)
                return
            source = self._state
            self._move(RouteState.SWITCHING)
            self._resume.append(source)

    def end_switch(self) -> None:
        """The switch started by `begin_switch` is over (done or failed): back to where it began, unless a
        recovery is under way (the recovery then returns past it) or the engine closed meanwhile."""
        with self.lock:
            if self._state is RouteState.SWITCHING:
                self._move(self._resume.pop())
            elif RouteState.SWITCHING in self._resume:
                self._resume.remove(RouteState.SWITCHING)

    def begin_recovery(self) -> bool:
        """A station failed: stop planning. False (nothing changes) when a recovery already runs or the
        engine is closed; True when the caller must now rebuild the route."""
        with self.lock:
            if self._state in (RouteState.RECOVERING, RouteState.CLOSED):
                return False
            source = self._state
            self._move(RouteState.RECOVERING)
            self._resume.append(source)
            return True

    def fail_recovery(self, error: str) -> bool:
        """The route could not be rebuilt: record why (new requests get 503 route_down). True on the first
        failure of this recovery, when the requests that needed the route must be ended."""
        with self.lock:
            if self._state is not RouteState.RECOVERING or self._error is not None:
                return False
            self._error = error
            self.lock.notify_all()
            return True

    def end_recovery(self) -> None:
        """The route is rebuilt (or the engine closed): clear the error, return to where the recovery began."""
        with self.lock:
            self._error = None
            if self._state is RouteState.RECOVERING:
                self._move(self._resume.pop())

    def drain(self) -> None:
        """Refuse new requests from now on; a switch or recovery under way still ends, into the drain."""
        with self.lock:
            if self._state is RouteState.SERVING:
                self._move(RouteState.DRAINING)
            elif self._resume:
                self._resume[0] = RouteState.DRAINING

    def close(self) -> None:
        """The engine stops: legal from every state."""
        with self.lock:
            self._move(RouteState.CLOSED)
            self._resume.clear()

    def _move(self, target: RouteState) -> None:
        check_transition(self._state, target)
        self._state = target
        self.lock.notify_all()


def route_limits(links: list[StationLink], max_positions: int) -> KVLimits:
    """The KV limits a chain of stations gives the scheduler: one block size, the smallest pool."""
    geometry = [link.kv() for link in links]
    if len({g.block_tokens for g in geometry}) != 1:
        raise ValueError(f"stations disagree on KV block size: {[g.block_tokens for g in geometry]}")
    return KVLimits(max_positions, min(g.blocks_total for g in geometry), geometry[0].block_tokens,
                    all(g.prefill_chunk_invariant for g in geometry))
