"""A station's own CPU cores: claimed on its node, pinned, released when its process ends.

Ray accounts `num_cpus` but never says WHICH cores an actor may use, so two 1-core stations on a 2-core node
would migrate across each other. Each station claims whole cores of its node by holding an exclusive
`flock` on one file per core, in a folder shared by every station of the same Ray session on that machine;
the kernel drops the locks when the process ends (a SIGKILL included), so a restarted station claims again.
A station that finds fewer free cores than it asks for (or asks for less than one) pins nothing and says why.
"""
from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CorePlacement:
    """What a station got: the cores it is pinned to (empty: not pinned) and, when not pinned, why."""

    cores: tuple[int, ...] = ()
    reason: str = ""  # why nothing was pinned ("" when pinned)
    _held: tuple[int, ...] = field(default=(), repr=False)  # open lock-file descriptors, kept for the process's life
    _before: tuple[int, ...] = field(default=(), repr=False)  # the process's affinity before it was pinned

    @property
    def pinned(self) -> bool:
        """True when the process runs on `cores` only."""
        return bool(self.cores)

    def release(self) -> None:
        """Give the cores back: close the lock files and let the process run where it could before it was pinned
        (a station built inside another process, as tests do, leaves that process as it found it)."""
        for fd in self._held:
            os.close(fd)
        if self._before:
            pin_process(set(self._before))


def claim_cores(count: float, claim_dir: str | Path, available: set[int] | None = None) -> CorePlacement:
    """Claim `int(count)` cores of `available` (default: this process's current affinity) that no other live
    claimant of `claim_dir` holds, lowest first; on success pin every thread of this process to them."""
    want = int(count)
    if want < 1:
        return CorePlacement(reason=f"num_cpus={count:g} is less than one whole core: not pinned")
    before = tuple(sorted(os.sched_getaffinity(0)))
    cores = sorted(before if available is None else available)
    if len(cores) < want:
        return CorePlacement(reason=f"num_cpus={count:g} but this process may run on {len(cores)} core(s): not pinned")
    folder = Path(claim_dir)
    folder.mkdir(parents=True, exist_ok=True)
    got: list[int] = []
    held: list[int] = []
    for core in cores:
        if len(got) == want:
            break
        fd = os.open(folder / f"core-{core}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        got.append(core)
        held.append(fd)
    if len(got) < want:
        for fd in held:
            os.close(fd)
        return CorePlacement(reason=f"num_cpus={count:g} but only {len(got)} of this node's {len(cores)} core(s) "
                                    f"are free of other stations: not pinned")
    pin_process(set(got))
    return CorePlacement(cores=tuple(got), _held=tuple(held), _before=before)


def pin_process(cores: set[int]) -> None:
    """Set the CPU affinity of every thread of this process (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    os.sched_setaffinity(0, cores)
