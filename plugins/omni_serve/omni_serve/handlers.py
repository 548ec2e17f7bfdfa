"""Every error as an OpenAI-style answer: `api_error` maps an exception (from submit or a route) to its status,
and `HANDLERS` are the app's exception handlers (the request shape, HTTP errors, omni errors)."""

from __future__ import annotations

import math

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omni_kernel.core.errors import EngineDead, OmniError, RequestError, StageUnavailable, UserError, classify

from .async_omni import Overloaded, ShuttingDown
from .protocol import APIError


def api_error(exc: BaseException) -> APIError:
    """An exception from submit or a handler as the answer it deserves."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), None, "shutting_down")
    if isinstance(exc, Overloaded):
        return APIError(429, str(exc), None, "too_many_requests", retry_after=1)
    kind, message, field = classify(exc)
    if isinstance(exc, StageUnavailable):  # its worker is restarting: the same request will do, a little later
        answer = APIError.of_failure(kind, message, field)
        answer.retry_after = math.ceil(getattr(exc, "retry_after", None) or 1)
        return answer
    if isinstance(exc, (UserError, EngineDead, RequestError)):
        return APIError.of_failure(kind, message, field)
    return APIError(500, f"internal error: {message}", None, "internal_error")


def error_response(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    if exc.status in (408, 413):  # a streamed body refused part-way: the rest is not read, the connection closes
        headers["Connection"] = "close"
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)


async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":  # its loc is a character position, not a field
        return error_response(APIError(400, f"invalid request: the body is not valid JSON ({first.get('msg')})",
                                       None, "invalid_json"))
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "form")]
    param = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc).lstrip(".") or None
    message = f"invalid {param or 'request'}: {first.get('msg', 'bad value')}"
    return error_response(APIError(400, message, param, "invalid_value"))


async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(exc.status_code, str(exc.detail), None, None,
                                   "invalid_request_error" if exc.status_code < 500 else "server_error"))


async def on_omni(request: Request, exc: OmniError) -> JSONResponse:
    return error_response(api_error(exc))


HANDLERS = {APIError: on_api_error, RequestValidationError: on_validation, StarletteHTTPException: on_http,
            OmniError: on_omni}
