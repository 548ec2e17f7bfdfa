"""EventStream: one request's events, handed over from the serving loop to the asyncio loop of its caller.

The hand-over is batched: the events that one serving-loop step makes for the streams of one asyncio loop go over
in one `call_soon_threadsafe` (a `Postbox` per asyncio loop), not one per token, so a step of 32 decodes wakes the
asyncio loop once."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable

from omni_kernel.events import RequestFailed, RequestFinished

_POSTBOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # asyncio loop -> its Postbox
_POSTBOXES_LOCK = threading.Lock()


class Postbox:
    """Events for the queues of one asyncio loop. `post` (any thread) keeps them in order and asks the loop to take
    them only when no earlier request to take them is still pending."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[asyncio.Queue, object]] = []
        self.scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Postbox:
        with _POSTBOXES_LOCK:
            box = _POSTBOXES.get(loop)
            if box is None:
                box = _POSTBOXES[loop] = cls(loop)
            return box

    def post(self, queue: asyncio.Queue, event) -> None:
        """Raises (RuntimeError) when the loop is closed, as `call_soon_threadsafe` does."""
        with self.lock:
            if self.loop.is_closed():
                self.pending.clear()
                raise RuntimeError("the event loop of this stream is closed")
            self.pending.append((queue, event))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # on the asyncio loop
        with self.lock:
            pending, self.pending, self.scheduled = self.pending, [], False
        for queue, event in pending:
            queue.put_nowait(event)


class EventStream:
    """One submitted request's events, in order, as an async iterator that ends after RequestFinished or
    RequestFailed. Closing it (`aclose`, leaving `async with`, or cancellation) before the end aborts the
    request: `abort(request_id)` (AsyncOmni.abort)."""

    def __init__(self, abort: Callable[[str], None], loop: asyncio.AbstractEventLoop):
        self.abort = abort
        self.loop = loop
        self.postbox = Postbox.of(loop)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request_id = ""
        self.done = False

    def put(self, event) -> None:  # the serving loop's thread
        self.postbox.post(self.queue, event)

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
