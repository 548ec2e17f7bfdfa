"""EventStream: one request's events, handed over from the serving loop to the asyncio loop of its caller."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from omni_kernel.events import RequestFailed, RequestFinished


class EventStream:
    """One submitted request's events, in order, as an async iterator that ends after RequestFinished or
    RequestFailed. Closing it (`aclose`, leaving `async with`, or cancellation) before the end aborts the
    request: `abort(request_id)` (AsyncOmni.abort)."""

    def __init__(self, abort: Callable[[str], None], loop: asyncio.AbstractEventLoop):
        self.abort = abort
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request_id = ""
        self.done = False

    def put(self, event) -> None:  # the serving loop's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self):
        if self.done:
            raise StopAsyncIteration
        try:
            event = await self.queue.get()
        except BaseException:
            await self.aclose()
            raise
        self.done = isinstance(event, (RequestFinished, RequestFailed))
        return event

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.abort(self.request_id)

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
