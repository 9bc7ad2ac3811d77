"""OpenAI-compatible HTTP surface (FastAPI), a thin adapter over Engine.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE with `stream: true`),
GET /v1/models, GET /health (a real 1-token generation), GET /metrics, GET /v1/status, and GET /
(a live status page, one static HTML file that polls /v1/status; with an API key, open it as `/?key=<key>`).
Bad input is a 400 naming the field (never a 5xx); a full queue is a 503 with Retry-After;
with `config.api_key` every route but /health and /metrics needs `Authorization: Bearer <key>`.
A client that goes away (streaming or not) cancels its request, so its KV is freed within a wave.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from mesh.core.config import ApiConfig
from mesh.core.params import SamplingParams
from orchestrator.metrics import CONTENT_TYPE_LATEST, MetricsRegistry, RequestRecord
from orchestrator.openai_format import DONE, ResponseFormatter, now_s, sse
from orchestrator.openai_schema import ApiError, GenerationRequest, RequestParser
from orchestrator.scheduler import AdmissionError
from orchestrator.stream import RequestStream

__all__ = ["OPEN_PATHS", "create_app"]
OPEN_PATHS = frozenset({"/health", "/metrics"})  # the only routes served without the API key
_CODES = {"never_fits": "context_length_exceeded", "queue_full": "queue_full", "invalid": "invalid_value"}
_DISCONNECT_POLL_S = 0.25
STATUS_PAGE = Path(__file__).with_name("status_page.html")
QUERY_KEY_PATHS = frozenset({"/"})  # a browser opens these as `?key=<key>`; every other route needs the header


class _BearerAuth:
    """ASGI middleware: 401 on every path outside OPEN_PATHS without `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:
        self.app, self._key, self._open = app, api_key.encode(), open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = scope["path"][len(scope.get("root_path", "")):] if scope.get("root_path") else scope["path"]
            if path not in self._open:
                header = dict(scope.get("headers") or ()).get(b"authorization", b"")
                scheme, _, token = header.partition(b" ")
                if path in QUERY_KEY_PATHS and scheme.lower() != b"bearer":
                    scheme, token = b"bearer", _query_key(scope.get("query_string", b""))
                if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                    err = ApiError(401, "Missing or invalid API key: send `Authorization: Bearer <key>`",
                                   None, "invalid_api_key")
                    resp = JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})
                    return await resp(scope, receive, send)
        await self.app(scope, receive, send)


def _query_key(query_string: bytes) -> bytes:
    """The `key` parameter of a URL query string (b"" when absent)."""
    return (parse_qs(query_string.decode("latin-1")).get("key") or [""])[0].encode()


class _Trace:
    """Per-request timing the API layer sees: token arrival times per choice."""

    def __init__(self, n: int) -> None:
        self.token_times: list[list[float]] = [[] for _ in range(n)]
        self.closed = False

    async def events(self, stream: RequestStream) -> AsyncIterator:
        """The stream's events, recording when each choice's tokens arrived."""
        async for ev in stream:
            if ev.token_ids:
                self.token_times[ev.index].append(time.monotonic())
            yield ev

    def record(self, req: GenerationRequest, stream: RequestStream) -> RequestRecord:
        """The RequestRecord of a request that ended."""
        outs = stream.outputs
        end = stream.finished_at or time.monotonic()
        queued = getattr(stream, "scheduled_at", None)
        gaps = tuple(b - a for times in self.token_times for a, b in itertools.pairwise(times))
        return RequestRecord(
            prompt_tokens=len(req.prompt_ids), completion_tokens=sum(len(o.token_ids) for o in outs),
            finish_reasons=tuple(o.finish_reason or "cancelled" for o in outs),
            ttft_s=stream.first_token_at - stream.arrival if stream.first_token_at is not None else None,
            e2e_s=end - stream.arrival, queue_s=queued - stream.arrival if queued is not None else None,
            inter_token_s=gaps)


def create_app(engine, tokenizer, chat_template: str, model_name: str, config: ApiConfig,
               status_provider: Callable[[], Any] | None = None, metrics: MetricsRegistry | None = None,
               health_timeout_s: float = 10.0) -> FastAPI:
    """The FastAPI app serving `engine` as `model_name`; `metrics` defaults to one over `engine.stats`."""
    metrics = metrics or MetricsRegistry(engine.stats)
    parser = RequestParser(tokenizer, chat_template, model_name, engine.model, config.max_n)
    fmt = ResponseFormatter(tokenizer, model_name)
    started = now_s()
    app = FastAPI(title="wavemesh", summary="OpenAI-compatible API over a wavemesh engine")
    app.state.engine, app.state.metrics, app.state.open_paths = engine, metrics, OPEN_PATHS
    if config.api_key:
        app.add_middleware(_BearerAuth, api_key=config.api_key, open_paths=OPEN_PATHS)
    _install_error_handlers(app)

    async def generate(request: Request, parse: Callable[[Any], GenerationRequest]) -> Response:
        try:
            req = parse(await _json_body(request))
        except ApiError:
            metrics.observe_rejection("invalid")
            raise
        request_id = uuid.uuid4().hex
        try:
            stream = engine.submit(list(req.prompt_ids), req.params, req.n, request_id)
        except AdmissionError as err:
            raise _admission_error(err) from err
        trace = _Trace(req.n)
        if req.stream:  # the background task closes a stream whose generator never started
            return StreamingResponse(_sse(request, req, stream, trace), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(close, req, stream, trace))
        try:
            finished = await _collect(request, stream, trace)
        finally:
            close(req, stream, trace)
        if not finished:
            return Response(status_code=499)  # the client is gone; nobody reads this
        failed = [o for o in stream.outputs if o.finish_reason == "error"]
        if failed:
            raise ApiError(500, f"generation failed: {failed[0].error}", None, "generation_failed")
        return JSONResponse(fmt.response(req, request_id, now_s(), stream.outputs))

    def close(req: GenerationRequest, stream: RequestStream, trace: _Trace) -> None:
        """Cancel the request if it still runs (the client left) and record it, once."""
        if not stream.done:
            engine.cancel(stream.request_id)
        if not trace.closed:
            trace.closed = True
            metrics.observe_request(trace.record(req, stream))

    async def _collect(request: Request, stream: RequestStream, trace: _Trace) -> bool:
        """Drain a non-streaming request's events; False if the client disconnected first."""
        async def drain() -> None:
            async for _ in trace.events(stream):
                pass

        task = asyncio.ensure_future(drain())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    return False
            task.result()
            return True
        finally:
            task.cancel()

    async def _sse(request: Request, req: GenerationRequest, stream: RequestStream, trace: _Trace):
        request_id, created = stream.request_id, now_s()
        offsets = [0] * req.n
        first, tokens = True, 0
        try:
            if req.chat:
                yield sse(fmt.role_chunk(req, request_id, created))
                first = False
            async for ev in trace.events(stream):
                if await request.is_disconnected():
                    return
                tokens += len(ev.token_ids)
                if ev.error:
                    yield sse(ApiError(500, f"generation failed: {ev.error}", None, "generation_failed").body())
                    continue
                yield sse(fmt.event_chunk(req, request_id, created, ev, offsets[ev.index], first))
                offsets[ev.index] += len(ev.text)
                first = False
            close(req, stream, trace)  # recorded before [DONE], so a scrape after it sees this request
            if req.include_usage:
                yield sse(fmt.usage_chunk(req, request_id, created, tokens))
            yield DONE
        finally:  # also when the response is cancelled because the client went away
            close(req, stream, trace)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI text completion (prompt: a string or token ids)."""
        return await generate(request, parser.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completion (messages rendered with the model's chat template)."""
        return await generate(request, parser.chat)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "wavemesh",
                "max_model_len": engine.model.max_position_embeddings}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """The served model, in OpenAI's list shape."""
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        """One model by name (404 model_not_found for any other)."""
        if model_id != model_name:
            raise ApiError(404, f"The model `{model_id}` does not exist", "model", "model_not_found")
        return model_card()

    @app.get("/health")
    async def health() -> Response:
        """200 only if a 1-token generation through every station finishes within the timeout."""
        probe = engine.model.bos_token_id if engine.model.bos_token_id is not None else 0
        try:
            stream = engine.submit([probe], SamplingParams(max_tokens=1, ignore_eos=True), 1,
                                   f"health-{uuid.uuid4().hex}")
        except AdmissionError as err:
            return JSONResponse({"status": "unavailable", "reason": err.message}, 503)
        try:
            outs = await asyncio.wait_for(stream.result_async(), health_timeout_s)
        except TimeoutError:
            return JSONResponse({"status": "unavailable", "reason": f"no token within {health_timeout_s} s"}, 503)
        finally:
            if not stream.done:
                engine.cancel(stream.request_id)
        if outs[0].finish_reason == "error" or not outs[0].token_ids:
            return JSONResponse({"status": "unavailable", "reason": outs[0].error or outs[0].finish_reason}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition of the orchestrator's metrics."""
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE_LATEST)

    status_page = STATUS_PAGE.read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def status_page_route() -> HTMLResponse:
        """The live status page: stations, lanes, queue, waves in flight, tokens/s (it polls /v1/status)."""
        return HTMLResponse(status_page, headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        """Engine stats, plus what `status_provider()` reports (stations and the like)."""
        body: dict[str, Any] = {"model": model_name,
                                "engine": dataclasses.asdict(await asyncio.to_thread(engine.stats))}
        if status_provider is not None:
            try:
                extra = await asyncio.to_thread(status_provider)  # it may block on the stations
                extra = await extra if inspect.isawaitable(extra) else extra
                body.update(extra if isinstance(extra, dict) else {"status": extra})
            except Exception as err:  # noqa: BLE001 - partial status beats none
                body["status_error"] = f"{type(err).__name__}: {err}"
        return body

    return app


MAX_BODY_BYTES = 8 * 2**20  # a larger request body is refused (413) before it is parsed


async def _json_body(request: Request, limit: int = MAX_BODY_BYTES) -> Any:
    """The parsed JSON body, or a 400 naming what is wrong with it (413 past `limit` bytes, read no further)."""
    too_large = ApiError(413, f"the request body exceeds {limit} bytes", None, "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
        json.dumps(body, ensure_ascii=False).encode()  # a lone surrogate ("\ud800") has no UTF-8 form: refuse it here
    except (ValueError, RecursionError) as err:  # bad JSON or UTF-8, too deeply nested, an int of > 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {err}", None, "invalid_json") from err
    return body


def _admission_error(err: AdmissionError) -> ApiError:
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return ApiError(err.status, err.message, err.param, _CODES.get(err.reason, err.reason), headers)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's {"error": {...}} shape."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        first = (err.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        e = ApiError(400, f"{param}: {first.get('msg', 'invalid')}", param, "invalid_value")
        return JSONResponse(e.body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        e = ApiError(err.status_code, str(err.detail), None, "not_found" if err.status_code == 404 else None)
        return JSONResponse(e.body(), err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        e = ApiError(500, f"internal error: {type(err).__name__}: {err}", None, "internal_error")
        return JSONResponse(e.body(), 500)
