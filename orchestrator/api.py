"""OpenAI-compatible HTTP surface (FastAPI), a thin adapter over Engine.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE with `stream: true`; generation_routes.py),
GET /v1/models, GET /health (a real 1-token generation, shared and briefly cached: health.py), GET /metrics,
GET /v1/status, and GET /
(a live status page, one static HTML file that polls /v1/status; with an API key, open it as `/?key=<key>`).
Bad input is a 400 naming the field (never a 5xx); a full queue is a 503 with Retry-After;
with `config.api_key` every route but /health and /metrics needs `Authorization: Bearer <key>`.
A client that goes away (streaming or not) cancels its request, so its KV is freed within a wave; one
that goes away before its body has arrived is counted (wavemesh_client_disconnects_total), not logged.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mesh.core.config import ApiConfig
from orchestrator.generation_routes import GenerationRoutes
from orchestrator.health import HealthProbe
from orchestrator.http_body import MAX_BODY_BYTES
from orchestrator.metrics import CONTENT_TYPE, MetricsRegistry
from orchestrator.openai_format import ResponseFormatter, now_s
from orchestrator.openai_schema import ApiError, RequestParser

__all__ = ["MAX_BODY_BYTES", "OPEN_PATHS", "create_app"]
OPEN_PATHS = frozenset({"/health", "/metrics"})  # the only routes served without the API key
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


def create_app(engine, tokenizer, chat_template: str, model_name: str, config: ApiConfig,
               status_provider: Callable[[], Any] | None = None, metrics: MetricsRegistry | None = None,
               health_timeout_s: float = 10.0) -> FastAPI:
    """The FastAPI app serving `engine` as `model_name`; `metrics` defaults to one over `engine.stats`."""
    metrics = metrics or MetricsRegistry(engine.stats)
    app = FastAPI(title="wavemesh", summary="OpenAI-compatible API over a wavemesh engine")
    app.state.engine, app.state.metrics, app.state.open_paths = engine, metrics, OPEN_PATHS
    if config.api_key:
        app.add_middleware(_BearerAuth, api_key=config.api_key, open_paths=OPEN_PATHS)
    _install_error_handlers(app)
    parser = RequestParser(tokenizer, chat_template, model_name, engine.model, config.max_n, engine.max_context)
    GenerationRoutes(engine, parser, ResponseFormatter(tokenizer, model_name), metrics).register(app)
    _add_model_routes(app, engine, model_name)
    app.state.health = HealthProbe(engine, health_timeout_s, config.health_cache_s)
    _add_health_route(app, app.state.health)
    _add_status_routes(app, engine, model_name, metrics, status_provider)
    return app


def _add_model_routes(app: FastAPI, engine, model_name: str) -> None:
    """GET /v1/models and GET /v1/models/{id}: the one served model."""
    started = now_s()

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "wavemesh",
                "max_model_len": engine.max_context()}

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


def _add_health_route(app: FastAPI, probe: HealthProbe) -> None:
    """GET /health: a real 1-token generation through every station (shared, briefly cached)."""

    @app.get("/health")
    async def health() -> Response:
        """200 only if a 1-token generation through every station finished within the timeout lately."""
        reason = await probe.check()
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, 503)
        return JSONResponse({"status": "ok"})


def _add_status_routes(app: FastAPI, engine, model_name: str, metrics: MetricsRegistry,
                       status_provider: Callable[[], Any] | None) -> None:
    """GET /metrics (Prometheus), GET / (the live status page) and GET /v1/status (the JSON it polls)."""

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition of the orchestrator's metrics."""
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

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

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, err: ClientDisconnect) -> Response:
        request.app.state.metrics.observe_client_disconnect()  # a normal event: counted, no traceback
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        e = ApiError(500, f"internal error: {type(err).__name__}: {err}", None, "internal_error")
        return JSONResponse(e.body(), 500)
