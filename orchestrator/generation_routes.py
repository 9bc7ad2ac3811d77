"""The generation routes of the OpenAI surface: POST /v1/completions and /v1/chat/completions.

A request is parsed (400 naming the field), submitted to the engine (400 never fits, 503 with Retry-After
when the queue is full), then answered as one JSON body or as Server-Sent Events with `stream: true`.
A client that goes away (streaming or not) cancels its request, so its KV is freed within a wave; every
request that ends is recorded in the metrics once.
"""
from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from orchestrator.http_body import decode_json, read_body
from orchestrator.metrics import MetricsRegistry, RequestRecord
from orchestrator.openai_format import DONE, ResponseFormatter, now_s, sse
from orchestrator.openai_schema import ApiError, GenerationRequest, RequestParser
from orchestrator.scheduler import AdmissionError
from orchestrator.stream import RequestStream

__all__ = ["GenerationRoutes"]
_CODES = {"never_fits": "context_length_exceeded", "queue_full": "queue_full", "invalid": "invalid_value"}
_DISCONNECT_POLL_S = 0.25


class _RecordOnce:
    """Whether a request's record was taken (once: at its end, or when its client left)."""

    def __init__(self) -> None:
        self.taken = False


def _request_record(req: GenerationRequest, stream: RequestStream) -> RequestRecord:
    """The RequestRecord of a request that ended (its token times are the stream's)."""
    outs = stream.outputs
    end = stream.finished_at or time.monotonic()
    queued = getattr(stream, "scheduled_at", None)
    gaps = tuple(b - a for times in stream.token_times for a, b in itertools.pairwise(times))
    return RequestRecord(
        prompt_tokens=len(req.prompt_ids), completion_tokens=sum(len(o.token_ids) for o in outs),
        finish_reasons=tuple(o.finish_reason or "cancelled" for o in outs),
        ttft_s=stream.first_token_at - stream.arrival if stream.first_token_at is not None else None,
        e2e_s=end - stream.arrival, queue_s=queued - stream.arrival if queued is not None else None,
        inter_token_s=gaps)


class GenerationRoutes:
    """Completions and chat completions over one engine: parse, submit, then stream or collect, and record."""

    def __init__(self, engine, parser: RequestParser, formatter: ResponseFormatter,
                 metrics: MetricsRegistry) -> None:
        self.engine, self.parser, self.fmt, self.metrics = engine, parser, formatter, metrics

    def register(self, app: FastAPI) -> None:
        """Add POST /v1/completions and POST /v1/chat/completions to `app`."""

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            """OpenAI text completion (prompt: a string or token ids)."""
            return await self.generate(request, self.parser.completion)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            """OpenAI chat completion (messages rendered with the model's chat template)."""
            return await self.generate(request, self.parser.chat)

    async def generate(self, request: Request, parse: Callable[[Any], GenerationRequest]) -> Response:
        """Answer one generation request: JSON once every choice ends, or SSE chunks as tokens arrive."""
        try:  # decoding, the chat template and the tokenizer run off the event loop: a large body stalls no one
            raw = await read_body(request)
            req = await asyncio.to_thread(lambda: parse(decode_json(raw)))
        except ApiError:
            self.metrics.observe_rejection("invalid")
            raise
        request_id = uuid.uuid4().hex
        try:
            stream = self.engine.submit(list(req.prompt_ids), req.params, req.n, request_id)
        except AdmissionError as err:
            raise _admission_error(err) from err
        once = _RecordOnce()
        if req.stream:  # the background task closes a stream whose generator never started
            return StreamingResponse(self._sse(request, req, stream, once), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(self.close, req, stream, once))
        try:
            finished = await self._collect(request, stream)
        finally:
            self.close(req, stream, once)
        if not finished:
            return Response(status_code=499)  # the client is gone; nobody reads this
        failed = [o for o in stream.outputs if o.finish_reason == "error"]
        if failed:
            raise ApiError(500, f"generation failed: {failed[0].error}", None, "generation_failed")
        return JSONResponse(self.fmt.response(req, request_id, now_s(), stream.outputs, stream.cached_tokens))

    def close(self, req: GenerationRequest, stream: RequestStream, once: _RecordOnce) -> None:
        """Cancel the request if it still runs (the client left) and record it, once."""
        if not stream.done:
            self.engine.cancel(stream.request_id)
        if not once.taken:
            once.taken = True
            self.metrics.observe_request(_request_record(req, stream))

    async def _collect(self, request: Request, stream: RequestStream) -> bool:
        """Wait for a non-streaming request's end (woken once, not per token); False if the client left first."""
        task = asyncio.ensure_future(stream.result_async())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    return False
            task.result()
            return True
        finally:
            task.cancel()

    async def _sse(self, request: Request, req: GenerationRequest, stream: RequestStream, once: _RecordOnce):
        fmt = self.fmt
        request_id, created = stream.request_id, now_s()
        offsets = [0] * req.n
        first, tokens = True, 0
        try:
            if req.chat:
                yield sse(fmt.role_chunk(req, request_id, created))
                first = False
            async for ev in stream:
                if await request.is_disconnected():
                    return
                tokens += len(ev.token_ids)
                if ev.error:
                    yield sse(ApiError(500, f"generation failed: {ev.error}", None, "generation_failed").body())
                    continue
                yield sse(fmt.event_chunk(req, request_id, created, ev, offsets[ev.index], first))
                offsets[ev.index] += len(ev.text)
                first = False
            self.close(req, stream, once)  # recorded before [DONE], so a scrape after it sees this request
            if req.include_usage:
                yield sse(fmt.usage_chunk(req, request_id, created, tokens, stream.cached_tokens))
            yield DONE
        finally:  # also when the response is cancelled because the client went away
            self.close(req, stream, once)


def _admission_error(err: AdmissionError) -> ApiError:
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return ApiError(err.status, err.message, err.param, _CODES.get(err.reason, err.reason), headers)
