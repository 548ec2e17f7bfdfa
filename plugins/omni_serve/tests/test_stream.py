"""stream.Postbox: the serving loop's events reach an asyncio loop's queues in order, one wake-up per batch."""

from __future__ import annotations

import asyncio
import threading

import pytest

from omni_serve.stream import Postbox


def test_a_batch_of_events_wakes_the_loop_once_and_keeps_each_queues_order():
    loop = asyncio.new_event_loop()
    try:
        calls = []
        real = loop.call_soon_threadsafe

        def counted(callback, *args):
            calls.append(callback)
            return real(callback, *args)

        loop.call_soon_threadsafe = counted
        box = Postbox(loop)
        first, second = asyncio.Queue(), asyncio.Queue()
        # One step's events, posted from another thread as the serving loop does, before the loop runs.
        poster = threading.Thread(target=lambda: [box.post(q, e) for q, e in
                                                  ((first, "a1"), (second, "b1"), (first, "a2"), (second, "b2"))])
        poster.start()
        poster.join()
        assert len(calls) == 1

        async def take(queue, n):
            return [await queue.get() for _ in range(n)]

        assert loop.run_until_complete(take(first, 2)) == ["a1", "a2"]
        assert loop.run_until_complete(take(second, 2)) == ["b1", "b2"]
        box.post(first, "a3")  # the next batch asks again
        assert len(calls) == 2
        assert loop.run_until_complete(take(first, 1)) == ["a3"]
    finally:
        loop.close()


def test_posting_to_a_closed_loop_raises():
    loop = asyncio.new_event_loop()
    box = Postbox(loop)
    queue = asyncio.Queue()
    loop.close()
    with pytest.raises(RuntimeError):
        box.post(queue, "late")
    assert box.pending == []


def test_one_postbox_per_loop():
    loop = asyncio.new_event_loop()
    try:
        assert Postbox.of(loop) is Postbox.of(loop)
    finally:
        loop.close()
