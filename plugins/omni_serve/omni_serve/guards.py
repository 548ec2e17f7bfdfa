"""The ASGI layer in front of the routes: the API key, the body-size limit, client disconnects and the access
log (one line per request), with OpenAI-style errors for what it refuses."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid

from fastapi import Request

from .metrics import Metrics
from .protocol import APIError
from .settings import ServeSettings

log = logging.getLogger("omni")


TEXT_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# multipart bodies read as they come (uploads.py), not buffered here
STREAMED_PATHS = frozenset({"/v1/videos", "/v1/audio/transcriptions"})


def _streamed(scope) -> bool:
    kind = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
    return scope["path"] in STREAMED_PATHS and kind == b"multipart/form-data"


class OmniASGI:
    """Outermost middleware: request id, body size limit (413), API key (401), access log line, and a last
    resort 500 that keeps the server up. Pure ASGI, so streaming and disconnects pass through untouched."""

    def __init__(self, app, settings: ServeSettings, metrics: Metrics):
        self.app = app
        self.settings = settings
        self.metrics = metrics
        self.max_body = int(settings.max_body_mb * 2**20)
        self.max_text_body = int(min(settings.max_text_body_mb, settings.max_body_mb) * 2**20)
        self.key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        rid = f"req-{uuid.uuid4().hex[:16]}"
        scope.setdefault("state", {})["request_id"] = rid
        status = {"code": 0, "started": False}

        async def send_logged(message):
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            error = self._refuse(scope)
            if error is None and scope["method"] in ("POST", "PUT", "PATCH"):
                if _streamed(scope):
                    receive = self._bounded(scope, receive)
                else:
                    receive, error = await self._buffer(scope, receive)
            if error is not None:
                await self._send_error(send_logged, error)
            else:
                await self.app(scope, receive, send_logged)
        except Exception as exc:  # noqa: BLE001 - one request failed; the server stays up
            log.error("%s %s %s failed: %s: %s", rid, scope["method"], scope["path"], type(exc).__name__, exc,
                      exc_info=exc)
            if not status["started"]:
                await self._send_error(send_logged, APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                             code="internal_error"))
        finally:
            route = getattr(scope.get("route"), "path", None) or ("other" if status["code"] == 404 else scope["path"])
            ms = (time.perf_counter() - start) * 1000
            log.info("%s %s %s %s %.1fms", rid, scope["method"], scope["path"], status["code"] or "-", ms)
            self.metrics.http.labels(route, str(status["code"] or 499)).inc()

    def _refuse(self, scope) -> APIError | None:
        if self.key is not None and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                return APIError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                                code="invalid_api_key")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self._limit(scope):
            return self._too_large(scope)
        return None

    def _limit(self, scope) -> int:
        return self.max_text_body if scope["path"] in TEXT_PATHS else self.max_body

    def _too_large(self, scope) -> APIError:
        if self._limit(scope) < self.max_body:
            return APIError(413, f"request body is larger than {self.settings.max_text_body_mb:g} MB, the limit "
                                 "for completions and chats (--max-text-body-mb)", code="body_too_large")
        return APIError(413, f"request body is larger than {self.settings.max_body_mb:g} MB (--max-body-mb)",
                        code="body_too_large")

    async def _buffer(self, scope, receive):
        """Read the whole body (up to the limit, within the body timeout) and replay it; then hand disconnects
        through."""
        chunks, size, limit = [], 0, self._limit(scope)
        timeout = self.settings.body_timeout
        deadline = None if not timeout else time.monotonic() + timeout
        while True:
            try:
                message = await (receive() if deadline is None
                                 else asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0)))
            except asyncio.TimeoutError:
                return receive, APIError(408, f"the request body did not arrive within {timeout:g}s "
                                              "(--body-timeout)", code="request_timeout")
            if message["type"] == "http.disconnect":
                return receive, APIError(400, "client disconnected")
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return receive, self._too_large(scope)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay, None

    def _bounded(self, scope, receive):
        """`receive` for a body the route reads as it comes (a video form: its file parts stream to disk): the
        same bounds as `_buffer`, raised as the APIError the route's handler answers."""
        size, limit = 0, self._limit(scope)
        timeout = self.settings.body_timeout
        deadline = None if not timeout else time.monotonic() + timeout
        done = False

        async def bounded():
            nonlocal size, done
            if done:
                return await receive()
            try:
                message = await (receive() if deadline is None
                                 else asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0)))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {timeout:g}s (--body-timeout)",
                               code="request_timeout") from None
            if message["type"] == "http.disconnect":
                raise APIError(400, "client disconnected")
            size += len(message.get("body", b""))
            if size > limit:
                raise self._too_large(scope)
            done = not message.get("more_body", False)
            return message

        return bounded

    @staticmethod
    async def _send_error(send, error: APIError) -> None:
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if error.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if error.status in (408, 413):  # the rest of the body is not read: the connection cannot be reused
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, coro):
    """Run `coro`; if the client goes away first, cancel it (its request is aborted in the engine)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return None
    return task.result()

