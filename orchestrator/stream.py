"""What a caller holds for a submitted request: a stream of events, blocking or async.

The engine thread pushes StreamEvents; the caller iterates them (sync or async)
or waits for the final CompletionOutputs. Text is detokenized incrementally,
holding back what could still become a stop string or an incomplete character.
"""
from __future__ import annotations

import asyncio
import queue
import time
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The logprob of a sampled token and the top alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """New output of one choice: tokens and text since the last event; finish_reason on the last one."""

    index: int
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # stop | length | cancelled | error
    error: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """Everything one choice produced."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class TextTracker:
    """Incremental detokenization of one choice, with stop-string matching.

    The stream is what decoding the whole output after every token would hand out (trailing
    incomplete characters held back), but a token decodes only a short window: the tokens since the
    text last grew, after the ones before them for context (a decoder may drop a leading space at a
    window's start, alike with and without the new tokens). Where a window cannot be trusted (invalid
    bytes, whose U+FFFD can reach back over earlier ones; a context that decodes to nothing, or not
    as the text ends) it decodes the whole output, as every token once did (a 4,000-token output then
    decoded ~8 million token ids in all; windows decode a few per token). tests/test_text_tracker.py
    holds the two to the same stream and counts the ids decoded.
    Stop strings are searched only where a new match can be.
    """

    CONTEXT = 4  # tokens of context after a whole decode

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:read], up to its last whole character
        self.tail = ""  # U+FFFD held back after a whole decode (incomplete bytes at the end)
        self.clean = True  # no U+FFFD in text: a window decodes as the whole would (else: decode the whole)
        self.prefix = self.read = 0  # ids[prefix:read]: the context decoded before the newer tokens
        self.seen = 0  # length of the text stop strings were searched in last time
        self.sent = 0  # characters of text already handed out
        self.hold = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _view(self, final: bool = False) -> str:
        """The text of every token so far, up to its last whole character (all of it when final)."""
        if self.tokenizer is None or (self.read == len(self.ids) and not self.tail):
            return self.text
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        whole = after.rstrip("\ufffd")
        if (not self.clean or self.tail or "\ufffd" in whole or not self.text.endswith(before)
                or not after.startswith(before) or (self.text and not before)):
            full = self._decode(self.ids)
            self.text = full.rstrip("\ufffd")
            self.tail = full[len(self.text):]
            self.clean = "\ufffd" not in self.text
            self.prefix, self.read = max(0, len(self.ids) - self.CONTEXT), len(self.ids)
            return self.text + self.tail if final else self.text
        if final or whole == after:  # the window ends on a whole character: take it in
            self.text += after[len(before):]
            self.clean = whole == after
            self.prefix, self.read = self.read, len(self.ids)
            return self.text
        return self.text + whole[len(before):]  # whole characters of a window still waiting for bytes

    def add(self, token_id: int) -> tuple[str, bool]:
        """Take one token; returns (text safe to send now, whether a stop string matched)."""
        self.ids.append(token_id)
        text = self._view()
        hits = [i for i in (text.find(s, max(0, self.seen - len(s) + 1)) for s in self.stop) if i >= 0]
        self.seen = len(text)
        if hits:
            end = min(hits)
            delta, self.sent = text[self.sent:end], max(self.sent, end)
            return delta, True
        safe = len(text) - self.hold
        if safe <= self.sent:
            return "", False
        delta, self.sent = text[self.sent:safe], safe
        return delta, False

    def flush(self) -> str:
        """The text held back, at the end of a choice that did not stop on a string."""
        text = self._view(final=True)
        delta, self.sent = text[self.sent:], len(text)
        return delta


class RequestStream:
    """Events of one request (all its choices), for a blocking or an asyncio consumer."""

    def __init__(self, request_id: str, n: int, loop: asyncio.AbstractEventLoop | None) -> None:
        self.request_id, self.n = request_id, n
        self.outputs = [CompletionOutput(i) for i in range(n)]
        self.arrival = time.monotonic()
        self.scheduled_at: float | None = None  # when its first prompt chunk entered a wave
        self.first_token_at: float | None = None
        self.cached_tokens = 0  # prompt tokens of its first choice found in the prefix cache at admission
        self.finished_at: float | None = None
        self.token_times: list[list[float]] = [[] for _ in range(n)]  # per choice: when each token event was pushed
        self._loop = loop
        self._quiet = False  # the consumer waits for the end only: no wake-up per token (result / result_async)
        self._sync: queue.Queue = queue.Queue()
        self._async: asyncio.Queue | None = asyncio.Queue() if loop else None
        self._open = n

    def push(self, ev: StreamEvent) -> None:
        """Engine side: record and deliver one event (thread-safe). A consumer waiting for the end only (`result`,
        `result_async`) is woken by the last event of each choice, not by every token."""
        out = self.outputs[ev.index]
        out.token_ids.extend(ev.token_ids)
        out.text += ev.text
        out.logprobs.extend(ev.logprobs)
        if ev.token_ids:
            now = time.monotonic()
            self.token_times[ev.index].append(now)
            if self.first_token_at is None:
                self.first_token_at = now
        if ev.finish_reason is not None:
            out.finish_reason, out.error = ev.finish_reason, ev.error
            self._open -= 1
            if self._open == 0:
                self.finished_at = time.monotonic()
        elif self._quiet:
            return
        if self._async is not None:
            self._loop.call_soon_threadsafe(self._async.put_nowait, ev)
        else:
            self._sync.put(ev)

    @property
    def done(self) -> bool:
        """True once every choice has finished."""
        return self._open == 0

    def __iter__(self):
        """Blocking iteration over events until every choice finishes."""
        left = self.n
        while left:
            ev = self._sync.get()
            left -= ev.finish_reason is not None
            yield ev

    async def __aiter__(self):
        """Async iteration over events until every choice finishes."""
        left = self.n
        while left:
            ev = await self._async.get()
            left -= ev.finish_reason is not None
            yield ev

    def result(self, timeout: float | None = None) -> list[CompletionOutput]:
        """Block until every choice finishes (for a blocking consumer); returns their outputs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._quiet = True  # set before `done` is read: an end pushed after that read is queued
        while not self.done:  # push() updates outputs before it queues, so `done` is final once seen
            self._sync.get(timeout=None if deadline is None else max(0.001, deadline - time.monotonic()))
        return self.outputs

    async def result_async(self) -> list[CompletionOutput]:
        """Await every choice's end (for an asyncio consumer); returns their outputs."""
        self._quiet = True
        while not self.done:
            await self._async.get()
        return self.outputs
