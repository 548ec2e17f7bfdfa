"""AsyncOmni's admission count and drain, in-process on the kernel's echo pipeline (no model, no torch)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from omni_kernel import Omni
from omni_kernel.builtin.echo import KernelPlugin
from omni_kernel.events import RequestFailed
from omni_kernel.plugins import PluginHost
from omni_kernel.testing import wait_until
from omni_serve.async_omni import AsyncOmni, Overloaded


@pytest.fixture
def host():
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    return host


def test_a_submit_being_processed_counts_against_the_limit(host, monkeypatch):
    omni = Omni("echo", host=host)
    entered, release = threading.Event(), threading.Event()
    submit = omni.submit

    def slow_submit(request):  # input processing that takes a while, on the engine thread
        entered.set()
        release.wait(10)
        return submit(request)

    monkeypatch.setattr(omni, "submit", slow_submit)
    with AsyncOmni({"echo": omni}, max_in_flight=1) as async_omni:
        first = async_omni.submit_nowait("echo", omni.request("first"), lambda e: None)
        assert entered.wait(10)  # taken off the queue, being processed: in no queue and in no flight
        second = async_omni.submit_nowait("echo", omni.request("second"), lambda e: None)
        try:
            with pytest.raises(Overloaded, match="1 requests in flight"):
                second.result(5)
        finally:
            release.set()
        assert first.result(10)
        wait_until(lambda: async_omni.snapshot.in_flight == 0 and async_omni._in_flight() == 0, 10, "the first to end")
        done = threading.Event()
        async_omni.submit_nowait("echo", omni.request("third"), lambda e: done.set()).result(10)  # room again
        assert done.wait(10)


def test_a_refused_submit_frees_its_place(host):
    with AsyncOmni({"echo": Omni("echo", host=host)}, max_in_flight=1) as async_omni:
        for _ in range(3):
            with pytest.raises(Exception, match="empty|prompt"):
                async_omni.submit_nowait("echo", async_omni.omnis["echo"].request(""), lambda e: None).result(10)
        assert async_omni._in_flight() == 0


def test_drain_fails_what_is_left_with_its_reason_and_the_engine_goes_on(host, monkeypatch):
    omni = Omni("echo", host=host)
    monkeypatch.setattr(omni.graph.stages["echo"].engine, "step", lambda: [])  # no progress: it cannot finish
    async_omni = AsyncOmni({"echo": omni}).start()

    async def main():
        stream = await async_omni.open("echo", "never finishes")
        failed = await asyncio.to_thread(async_omni.drain, 0.05, "the server shut down")
        return failed, [e async for e in stream]

    try:
        failed, events = asyncio.run(main())
        assert failed == 1 and isinstance(events[-1], RequestFailed)
        assert events[-1].kind == "aborted" and events[-1].error == "the server shut down"
        assert async_omni.alive and async_omni._in_flight() == 0
    finally:
        assert async_omni.shutdown(0) == 0
