"""How long a route switch held the live streams: per switch, the longest wait of any stream for its next token.

A stream's wait is the time from its last token on the old route to its first token on the new one (the engine
marks the switch once the route is swapped, when the waves in flight have delivered their tokens); the switch's
pause is the longest such wait over the streams that were decoding (a stream that ends
without another token drops out). Pure Python: the engine feeds it tokens and switch boundaries.
"""
from __future__ import annotations


class SwitchPauses:
    """The last token time of every live sequence, and the pause of each finished route switch."""

    def __init__(self) -> None:
        """No switch yet."""
        self._last: dict[int, float] = {}  # seq id -> when its latest token was committed
        self._waiting: dict[int, float] = {}  # seq ids decoding when the open switch began -> their last token time
        self._longest = 0.0
        self.switches = 0  # switches begun
        self.pauses: list[float] = []  # one per switch whose streams all moved on (seconds)

    def begin(self) -> None:
        """A switch begins: every sequence with a token so far waits for its next one."""
        self.switches += 1
        self._close()
        self._waiting = dict(self._last)
        self._longest = 0.0

    def token(self, seq_id: int, now: float) -> None:
        """`seq_id` got a token at `now` (monotonic seconds)."""
        self._last[seq_id] = now
        since = self._waiting.pop(seq_id, None)
        if since is not None:
            self._longest = max(self._longest, now - since)
            if not self._waiting:
                self._close()

    def forget(self, seq_id: int) -> None:
        """`seq_id` ended: it waits for nothing more."""
        self._last.pop(seq_id, None)
        if self._waiting.pop(seq_id, None) is not None and not self._waiting:
            self._close()

    def _close(self) -> None:
        if self._waiting or self._longest:
            self.pauses.append(self._longest)
        self._waiting, self._longest = {}, 0.0
