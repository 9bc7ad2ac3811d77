"""Who owns a Prometheus file_sd targets file, so that a dead cluster's targets do not outlive it.

`mesh up` records itself in `<targets_file>.owner` (pid and host) once it has written the targets, empties
the list on a clean stop, and a later `mesh up` or `mesh down` empties a list whose owner died without
cleaning up (SIGKILL). An empty list (`[]`) is a valid file_sd file: Prometheus then scrapes nothing there.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path


def _owner_file(targets: Path) -> Path:
    return targets.with_name(targets.name + ".owner")


def claim_targets(targets_file: str | None) -> None:
    """Record this process as the writer of `targets_file` (a `.owner` file beside it: pid and host)."""
    if targets_file is not None:
        owner = {"pid": os.getpid(), "host": socket.gethostname()}
        _owner_file(Path(targets_file)).write_text(json.dumps(owner) + "\n")


def release_targets(targets_file: str | None) -> None:
    """On a clean stop: list no target any more (an empty file_sd list) and drop the owner record."""
    if targets_file is not None and Path(targets_file).is_file():
        Path(targets_file).write_text("[]\n")
        _owner_file(Path(targets_file)).unlink(missing_ok=True)


def clean_stale_targets(targets_file: str | None) -> bool:
    """Empty a targets file whose writer died without cleaning up (SIGKILL): its owner record names a process
    of this host that is gone. True when it was cleaned; a live owner's (or another host's) file is left alone."""
    if targets_file is None:
        return False
    owner_path = _owner_file(Path(targets_file))
    try:
        owner = json.loads(owner_path.read_text())
        pid, host = int(owner["pid"]), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return False  # no record (or not ours to judge)
    if host != socket.gethostname() or _alive(pid):
        return False
    release_targets(targets_file)
    owner_path.unlink(missing_ok=True)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
