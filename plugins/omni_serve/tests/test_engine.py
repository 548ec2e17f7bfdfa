"""AsyncOmni in-process, on the kernel's echo pipeline and the fault plugin (no model, no torch)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from omni_kernel import Omni
from omni_kernel.builtin.echo import KernelPlugin
from omni_kernel.core.errors import EngineDead, InvalidParameter
from omni_kernel.events import RequestFailed, RequestFinished, TokenDelta
from omni_kernel.plugins import PluginHost
from omni_kernel.testing import wait_until
from omni_serve.engine import AsyncOmni, Overloaded, ShuttingDown

from fault_plugin import FaultPlugin


@pytest.fixture
def host():
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    host.register(FaultPlugin(), "fault")
    return host


@pytest.fixture
def engine(host):
    with AsyncOmni({"echo": Omni("echo", host=host), "fault": Omni("fault", host=host)}) as engine:
        yield engine


async def _run(engine, pipeline, prompt, **params):
    return [e async for e in engine.generate(pipeline, prompt, **params)]


def test_generate_yields_one_requests_events_in_order(engine):
    async def main():
        return await asyncio.gather(*[_run(engine, "echo", f"a b c d e {i}") for i in range(20)])

    for i, events in enumerate(asyncio.run(main())):
        assert isinstance(events[-1], RequestFinished)
        assert {e.request_id for e in events} == {events[-1].request_id}
        assert "".join(e.text for e in events if isinstance(e, TokenDelta)) == f"a b c d e {i}"
        assert events[-1].result.text == f"a b c d e {i}"


def test_user_error_raises_at_submit_and_nothing_stays_in_flight(engine):
    async def main():
        with pytest.raises(InvalidParameter, match="max_tokns"):
            await _run(engine, "echo", "hi", max_tokns=3)
        with pytest.raises(InvalidParameter, match="not served"):
            await _run(engine, "nope", "hi")

    asyncio.run(main())
    assert engine.snapshot.in_flight == 0


def test_idle_engine_blocks_instead_of_spinning(engine):
    asyncio.run(_run(engine, "echo", "one two"))
    # the caller has its events before the engine thread publishes the snapshot of that last step
    wait_until(lambda: engine.snapshot.in_flight == 0, 5, "the snapshot of the request's last step")
    before = engine.snapshot.steps
    time.sleep(0.3)  # the window in which a spinning loop would step: the subject of this test
    assert engine.snapshot.steps == before
    assert engine.alive


def test_leaving_early_aborts_the_request(engine):
    async def main():
        agen = engine.generate("echo", " ".join(["w"] * 5000))
        first = await agen.__anext__()
        await agen.aclose()
        return first

    first = asyncio.run(main())
    wait_until(lambda: not engine.snapshot.in_flight and engine.snapshot.aborted, 5, "the abort to be taken")
    assert engine.snapshot.in_flight == 0 and engine.snapshot.aborted == 1
    assert engine.call(lambda: engine.omnis["echo"].has_unfinished()).result(5) is False
    assert first.request_id


def test_threads_submit_and_abort_concurrently(engine):
    results, errors = [], []

    def client(i):
        try:
            results.append(asyncio.run(_run(engine, "echo", f"x{i} y z")))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and len(results) == 8


def test_a_stage_whose_scheduler_raises_kills_its_pipeline_only(engine):
    async def main():
        events = await _run(engine, "fault", "please explode now")
        assert isinstance(events[-1], RequestFailed) and events[-1].kind == "engine_dead"
        assert "injected scheduler fault" in events[-1].error
        with pytest.raises(EngineDead):
            await _run(engine, "fault", "fine")
        return await _run(engine, "echo", "still here")

    assert asyncio.run(main())[-1].result.text == "still here"
    assert engine.snapshot.pipeline_dead("fault") and not engine.snapshot.pipeline_dead("echo")


def test_an_exception_escaping_a_step_marks_the_engine_dead(engine, monkeypatch):
    async def main():
        omni = engine.omnis["echo"]
        real, calls = omni.step, []

        def broken():
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("routing bug")
            return real()

        monkeypatch.setattr(omni, "step", broken)
        stream = await engine.open("echo", " ".join(["w"] * 1000))
        events = [e async for e in stream]
        assert isinstance(events[-1], RequestFailed) and events[-1].kind == "engine_dead"
        assert "routing bug" in events[-1].error
        with pytest.raises(EngineDead):
            await _run(engine, "echo", "hi")

    asyncio.run(main())
    assert engine.snapshot.dead and engine.alive  # the thread stays up to refuse requests


def test_shutdown_lets_in_flight_finish_then_refuses(host):
    engine = AsyncOmni({"echo": Omni("echo", host=host)}).start()

    async def main():
        stream = await engine.open("echo", " ".join(["w"] * 200))
        aborted = await asyncio.to_thread(engine.shutdown, 10)
        events = [e async for e in stream]
        return aborted, events

    aborted, events = asyncio.run(main())
    assert aborted == 0 and isinstance(events[-1], RequestFinished)
    assert not engine.alive
    with pytest.raises(ShuttingDown):
        engine.submit_nowait("echo", engine.omnis["echo"].request("hi"), lambda e: None).result(1)


def test_shutdown_timeout_aborts_the_rest(host, monkeypatch):
    omni = Omni("echo", host=host)
    monkeypatch.setattr(omni.graph.stages["echo"], "step", lambda: [])  # no progress: the request cannot finish
    engine = AsyncOmni({"echo": omni}).start()

    async def main():
        stream = await engine.open("echo", "never finishes")
        aborted = await asyncio.to_thread(engine.shutdown, 0.05)
        events = [e async for e in stream]
        return aborted, events

    aborted, events = asyncio.run(main())
    assert aborted == 1 and isinstance(events[-1], RequestFailed) and events[-1].kind == "aborted"
    assert not engine.alive


def test_a_request_over_the_in_flight_limit_is_refused_and_admitted_once_one_ends(host):
    with AsyncOmni({"echo": Omni("echo", host=host)}, max_in_flight=2) as engine:
        long = " ".join(["w"] * 100000)

        async def main():
            streams = [await engine.open("echo", long) for _ in range(2)]
            with pytest.raises(Overloaded, match="2 requests in flight"):
                await engine.open("echo", "one too many")
            await streams[0].aclose()  # aborts it: its place frees once the engine thread took the abort
            # a snapshot that counts the abort was published after the step that let the aborted request go
            await asyncio.to_thread(wait_until, lambda: engine.snapshot.aborted == 1, 10, "the abort to be taken")
            assert engine.snapshot.in_flight == 1
            third = [e async for e in engine.generate("echo", "now there is room")]
            await streams[1].aclose()
            return third

        third = asyncio.run(main())
        assert isinstance(third[-1], RequestFinished) and third[-1].result.text == "now there is room"
