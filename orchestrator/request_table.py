"""The engine's live requests: each one's stream, its choices' text trackers and open sequences, and which request
and choice owns a sequence.

No lock and no scheduler here: the engine calls it under its own lock and does the scheduler's side (admission, the
KV releases) itself. A request lives from `open` until its last open sequence is forgotten, or until `cancel`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from orchestrator.scheduler_types import TokenEvent
from orchestrator.stream import RequestStream, StreamEvent, TextTracker, TokenLogprob


@dataclass(slots=True)
class _Live:
    stream: RequestStream
    trackers: list[TextTracker]  # one per choice
    seq_ids: list[int]  # one per choice, in choice order
    open: set[int]  # those not yet finished


class RequestTable:
    """Live requests by id, and each live sequence's owner: (request id, choice index)."""

    def __init__(self) -> None:
        """An empty table; sequence ids start at 0 and are never reused."""
        self._live: dict[str, _Live] = {}
        self._owner: dict[int, tuple[str, int]] = {}
        self._next_seq_id = itertools.count()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __bool__(self) -> bool:
        return bool(self._live)

    def request_ids(self) -> list[str]:
        """The live requests' ids."""
        return list(self._live)

    def seq_ids(self) -> list[int]:
        """The live (unfinished) sequences' ids."""
        return list(self._owner)

    def owns(self, seq_id: int) -> bool:
        """True while `seq_id` is a live sequence of a live request."""
        return seq_id in self._owner

    def open(self, request_id: str, stream: RequestStream, trackers: list[TextTracker]) -> None:
        """Start a request with its stream and one text tracker per choice; its sequences come by `new_sequence`."""
        self._live[request_id] = _Live(stream, trackers, [], set())

    def new_sequence(self, request_id: str, choice: int) -> int:
        """A fresh sequence id for choice `choice` of the request."""
        seq_id = next(self._next_seq_id)
        live = self._live[request_id]
        live.seq_ids.append(seq_id)
        live.open.add(seq_id)
        self._owner[seq_id] = (request_id, choice)
        return seq_id

    def drop(self, request_id: str) -> None:
        """Forget a request that was not admitted after all, with every sequence it was given."""
        for seq_id in self._live.pop(request_id).seq_ids:
            self._owner.pop(seq_id, None)

    def cancel(self, request_id: str) -> bool:
        """End each open choice of the request on its stream as cancelled and forget the request; False if it is
        not live."""
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        for seq_id in sorted(live.open):
            live.stream.push(StreamEvent(self._owner.pop(seq_id)[1], finish_reason="cancelled"))
        return True

    def scheduled(self, seq_id: int, cached_tokens: int, now: float) -> None:
        """The sequence's first entry went out at `now` with `cached_tokens` of its prompt from the prefix cache:
        the request's stream notes its first scheduling and, from its first choice, the cached tokens."""
        if (owner := self._owner.get(seq_id)) is None:
            return
        stream = self._live[owner[0]].stream
        stream.scheduled_at = stream.scheduled_at or now
        if owner[1] == 0:
            stream.cached_tokens = cached_tokens

    def push_token(self, ev: TokenEvent) -> str | None:
        """Stream a committed token to its choice (the text up to any stop string met, its logprobs); returns the
        choice's finish reason ("stop" where a stop string ended it), or None while it goes on or when the sequence
        is not live here."""
        if (owner := self._owner.get(ev.seq_id)) is None:
            return None
        live, index = self._live[owner[0]], owner[1]
        text, stopped = live.trackers[index].add(ev.token_id)
        reason = "stop" if stopped else ev.finish_reason
        if reason is not None and not stopped:
            text += live.trackers[index].flush()
        lp = (TokenLogprob(ev.token_id, ev.logprob, tuple(ev.top_logprobs)),) if ev.logprob is not None else ()
        live.stream.push(StreamEvent(index, (ev.token_id,), text, lp, reason))
        return reason

    def end(self, seq_id: int, reason: str, error: str | None = None) -> None:
        """Push the choice's end (its finish reason, an error where one ended it) to its stream."""
        request_id, index = self._owner[seq_id]
        self._live[request_id].stream.push(StreamEvent(index, finish_reason=reason, error=error))

    def forget(self, seq_id: int) -> bool:
        """Forget a finished sequence; True when it was its request's last open one (the request is gone too)."""
        request_id, _ = self._owner.pop(seq_id)
        live = self._live[request_id]
        live.open.discard(seq_id)
        if live.open:
            return False
        del self._live[request_id]
        return True

    def end_all(self, error: str) -> None:
        """End every open choice of every live request with `error` and forget them all."""
        for seq_id in self.seq_ids():
            self.end(seq_id, "error", error)
            self.forget(seq_id)
