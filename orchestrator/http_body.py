"""Request bodies at the HTTP front door: read within a byte limit (413), decode as JSON (400).

Every route that takes a body (the OpenAI routes and the control plane's /admin routes) reads it here,
so they share one size limit and one wording of their errors. A client that goes away before its body
has arrived raises starlette's ClientDisconnect, which api.py counts and answers without a traceback.
"""
from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from orchestrator.openai_schema import ApiError

__all__ = ["MAX_BODY_BYTES", "decode_json", "read_body", "read_json_object"]
MAX_BODY_BYTES = 8 * 2**20  # a larger request body is refused (413) before it is parsed


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The raw body, or a 413 once it passes `limit` bytes (by its Content-Length or as read; read no further)."""
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
    return b"".join(chunks)


def decode_json(raw: bytes) -> Any:
    """The JSON value of `raw`, or a 400 saying what is wrong with it (CPU-bound: call it off the event loop
    for large bodies)."""
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode()  # a lone surrogate ("\ud800") has no UTF-8 form: refuse it here
    except (ValueError, RecursionError) as err:  # bad JSON or UTF-8, too deeply nested, an int of > 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {err}", None, "invalid_json") from err
    return body


async def read_json_object(request: Request, fields: tuple[str, ...]) -> dict[str, Any]:
    """A small JSON object body whose keys are all in `fields` (400 naming the first that is not), 413 past
    the size limit: what the control plane's routes take."""
    body = decode_json(await read_body(request))
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object with {', '.join(fields)}, "
                            f"got {type(body).__name__}", None, "invalid_value")
    for key in body:
        if key not in fields:
            raise ApiError(400, f"{key}: unknown field; allowed: {', '.join(fields)}", key, "invalid_value")
    return body
