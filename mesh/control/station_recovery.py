"""Bringing one lost station of the route back: wait for Ray's restart, restart a hung one, replace a dead one.

Ray restarts a station actor whose process died, up to its `max_restarts`; each such fault spends one
restart. Recovery must never spend another on a station Ray is already restarting: a call to a restarting
actor waits in Ray's queue and times out exactly as a call to a hung process does, so the two are told
apart by Ray's record of the actor (RESTARTING vs ALIVE), never by the time-out alone. Only a station that
Ray holds ALIVE and that still does not answer is killed (with a restart): that hang is its one fault.
A station with no restarts left is replaced by a fresh actor for the same layers (a new `max_restarts`
budget). Connecting to the station that came back is retried while the deadline allows: it may die again
just as recovery reaches it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

from mesh.core.config import StationSpec
from station.actor import STARTING_STATES, actor_record, actor_state


class StationLost(RuntimeError):
    """A station did not come back before the recovery deadline, or cannot be started at all."""


@dataclass(frozen=True, slots=True)
class StationBack:
    """A station recovery brought back: its actor (the same one, or a replacement) and a link to it."""

    handle: Any
    link: Any
    replaced: bool


def bring_back(spec: StationSpec, handle: Any, link: Any, *, deadline: float, call_timeout_s: float,
               create: Callable[[StationSpec], Any], connect: Callable[[str], Any],
               progress: Callable[[str], None], poll_s: float = 0.2) -> StationBack:
    """Bring the station of `spec` (actor `handle`, whose `link` failed) back before `deadline` (monotonic):
    wait while Ray (re)starts it, kill it (one restart) only when Ray holds it alive and it does not answer,
    replace it (`create(spec)`) when it has no restarts left, and `connect(address)` to wherever it serves,
    retrying when it dies again meanwhile. Raises StationLost when it is not back in time or cannot start."""
    name = f"station [{spec.start}, {spec.end})"
    replaced = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StationLost(f"{name} was not back within the restart timeout")
        if actor_state(handle) in STARTING_STATES:  # Ray is restarting it: wait, never kill
            time.sleep(min(poll_s, left))
            continue
        try:
            address = ray.get(handle.address.remote(), timeout=min(call_timeout_s, left))
        except ActorUnavailableError:  # it just died: Ray has not begun its restart yet
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
            continue
        except ActorDiedError as e:  # no restarts left, or its constructor failed
            if e.actor_init_failed or replaced:
                raise StationLost(f"{name} cannot be started: {_first_line(e)}") from e
            progress(f"{name} has no restarts left: replacing it with a fresh actor")
            handle, replaced = create(spec), True
            continue
        except GetTimeoutError:
            if actor_state(handle) in (None, "ALIVE"):  # alive in Ray's eyes and silent: hung
                _kill_hung(handle, name, link.address, deadline, progress, poll_s)
            continue
        if address == link.address:  # the same process answers Ray, but not its gRPC health: hung
            if link.health():
                return StationBack(handle, link, replaced)
            _kill_hung(handle, name, link.address, deadline, progress, poll_s)
            continue
        try:
            new_link = connect(address)
        except Exception as e:  # noqa: BLE001 - it died again as we reached it: Ray restarts it, we wait
            progress(f"{name} at {address} failed while recovery connected ({type(e).__name__}); waiting for it")
            continue
        link.close()
        return StationBack(handle, new_link, replaced)


def _kill_hung(handle: Any, name: str, address: str, deadline: float, progress: Callable[[str], None],
               poll_s: float) -> None:
    """Kill a hung station's process once (Ray restarts it: one restart for this fault) and wait until Ray
    has seen it go, so that the next look does not take the same hang for a second one."""
    record = actor_record(handle)
    pid = None if record is None else record.get("Pid")
    progress(f"{name} at {address} does not answer: restarting it")
    ray.kill(handle, no_restart=False)
    while time.monotonic() < deadline:
        record = actor_record(handle)
        if record is None or record["State"] != "ALIVE" or record.get("Pid") != pid:
            return
        time.sleep(poll_s)


def _first_line(error: BaseException) -> str:
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    tail = next((ln for ln in reversed(lines) if "Error" in ln), None)  # the cause, at the traceback's end
    return tail or (lines[0] if lines else type(error).__name__)
