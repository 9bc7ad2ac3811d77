"""RequestStream: a consumer waiting for the end is woken once per choice, a streaming one per event."""
from __future__ import annotations

import asyncio
import threading

from orchestrator.stream import RequestStream, StreamEvent

TOKENS = 10  # token events pushed, alternating between the two choices


class CountingLoop:
    """An event loop's call_soon_threadsafe, counted: each call is one wake-up of the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.calls = loop, 0

    def call_soon_threadsafe(self, *args):
        self.calls += 1
        return self.loop.call_soon_threadsafe(*args)


def _engine(stream: RequestStream) -> None:
    """What the engine thread pushes: TOKENS token events over two choices, then each choice's end."""
    for i in range(TOKENS):
        stream.push(StreamEvent(i % 2, (i,), f"t{i}"))
    stream.push(StreamEvent(0, finish_reason="length"))
    stream.push(StreamEvent(1, finish_reason="stop"))


async def _run(consume) -> tuple[object, CountingLoop, RequestStream]:
    loop = CountingLoop(asyncio.get_running_loop())
    stream = RequestStream("r", 2, loop)
    task = asyncio.ensure_future(consume(stream))
    await asyncio.sleep(0)  # the consumer is waiting before the first event
    await asyncio.to_thread(_engine, stream)
    return await asyncio.wait_for(task, 30), loop, stream


def test_waiting_for_the_end_wakes_once_per_choice():
    outs, loop, stream = asyncio.run(_run(lambda s: s.result_async()))
    assert [o.token_ids for o in outs] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert [o.text for o in outs] == ["t0t2t4t6t8", "t1t3t5t7t9"]
    assert [o.finish_reason for o in outs] == ["length", "stop"]
    assert loop.calls == 2  # the two ends, not the ten tokens
    assert [len(t) for t in stream.token_times] == [5, 5]  # token times kept for the inter-token metric
    assert all(a <= b for t in stream.token_times for a, b in zip(t, t[1:]))
    assert stream.first_token_at == stream.token_times[0][0] and stream.done


def test_streaming_consumer_gets_every_event():
    async def consume(stream):
        return [ev async for ev in stream]

    events, loop, _ = asyncio.run(_run(consume))
    assert [ev.token_ids for ev in events if ev.token_ids] == [(i,) for i in range(TOKENS)]
    assert [ev.finish_reason for ev in events if ev.finish_reason] == ["length", "stop"]
    assert loop.calls == TOKENS + 2


def test_blocking_result_sees_events_pushed_before_and_after_it_waits():
    stream = RequestStream("r", 2, None)
    stream.push(StreamEvent(0, (7,), "a"))  # before the consumer waits: queued, then drained
    pusher = threading.Timer(0.05, _engine, args=(stream,))
    pusher.start()
    outs = stream.result(timeout=30)
    pusher.join()
    assert outs[0].token_ids == [7, 0, 2, 4, 6, 8] and outs[1].token_ids == [1, 3, 5, 7, 9]
    assert [o.finish_reason for o in outs] == ["length", "stop"] and stream.done
