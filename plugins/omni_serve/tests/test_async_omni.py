"""AsyncOmni in-process, on the kernel's echo pipeline and the fault plugin (no model, no torch)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import pytest

from omni_kernel import Omni
from omni_kernel.builtin.echo import KernelPlugin
from omni_kernel.core.errors import EngineDead, InvalidParameter
from omni_kernel.events import RequestFailed, RequestFinished, TokenDelta
from omni_kernel.plugins import PluginHost
from omni_kernel.testing import wait_until
from omni_serve.async_omni import AsyncOmni, Overloaded, ShuttingDown

from fault_plugin import FaultPlugin


@pytest.fixture
def host():
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    host.register(FaultPlugin(), "fault")
    return host


@pytest.fixture
def async_omni(host):
    with AsyncOmni({"echo": Omni("echo", host=host), "fault": Omni("fault", host=host)}) as async_omni:
        yield async_omni


async def _run(async_omni, pipeline, prompt, **params):
    return [e async for e in async_omni.generate(pipeline, prompt, **params)]


def test_generate_yields_one_requests_events_in_order(async_omni):
    async def main():
        return await asyncio.gather(*[_run(async_omni, "echo", f"a b c d e {i}") for i in range(20)])

    for i, events in enumerate(asyncio.run(main())):
        assert isinstance(events[-1], RequestFinished)
        assert {e.request_id for e in events} == {events[-1].request_id}
        assert "".join(e.text for e in events if isinstance(e, TokenDelta)) == f"a b c d e {i}"
        assert events[-1].result.text == f"a b c d e {i}"


def test_user_error_raises_at_submit_and_nothing_stays_in_flight(async_omni):
    async def main():
        with pytest.raises(InvalidParameter, match="max_tokns"):
            await _run(async_omni, "echo", "hi", max_tokns=3)
        with pytest.raises(InvalidParameter, match="not served"):
            await _run(async_omni, "nope", "hi")

    asyncio.run(main())
    assert async_omni.snapshot.in_flight == 0


def test_a_refused_submit_leaves_no_reference_cycle(async_omni):
    """The error a refused submit raises holds the loop thread's frames; nothing there holds its future back, so
    the future, the error and the request (an 18 MB prompt, say) go as soon as the caller drops them, without
    waiting for a full garbage collection."""
    request = async_omni.omnis["echo"].request("hi")
    gc.disable()
    try:
        future = async_omni.submit_nowait("nope", request, lambda event: None)
        with pytest.raises(InvalidParameter, match="not served"):
            future.result(10)
        gone = weakref.ref(future)
        del future
        async_omni.call(lambda: None).result(10)  # a loop round later: its commands are dropped too
        assert gone() is None
    finally:
        gc.enable()


def test_idle_engine_blocks_instead_of_spinning(async_omni):
    asyncio.run(_run(async_omni, "echo", "one two"))
    # the caller has its events before the engine thread publishes the snapshot of that last step
    wait_until(lambda: async_omni.snapshot.in_flight == 0, 5, "the snapshot of the request's last step")
    before = async_omni.snapshot.steps
    time.sleep(0.3)  # the window in which a spinning loop would step: the subject of this test
    assert async_omni.snapshot.steps == before
    assert async_omni.alive


def test_leaving_early_aborts_the_request(async_omni):
    before = async_omni.snapshot.aborted  # the module's engine: other tests may have aborted requests on it

    async def main():  # a stalled request: a long echo could end before the abort reached a loaded machine's engine
        agen = async_omni.generate("fault", "stall " + " ".join(["w"] * 10))
        first = await agen.__anext__()
        await agen.aclose()
        return first

    first = asyncio.run(main())
    wait_until(lambda: not async_omni.snapshot.in_flight and async_omni.snapshot.aborted > before, 5,
               "the abort to be taken")
    assert async_omni.snapshot.in_flight == 0 and async_omni.snapshot.aborted == before + 1
    assert async_omni.call(lambda: async_omni.omnis["fault"].has_unfinished()).result(5) is False
    assert first.request_id


def test_threads_submit_and_abort_concurrently(async_omni):
    results, errors = [], []

    def client(i):
        try:
            results.append(asyncio.run(_run(async_omni, "echo", f"x{i} y z")))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and len(results) == 8


def test_a_stage_whose_scheduler_raises_kills_its_pipeline_only(async_omni):
    async def main():
        events = await _run(async_omni, "fault", "please explode now")
        assert isinstance(events[-1], RequestFailed) and events[-1].kind == "engine_dead"
        assert "injected scheduler fault" in events[-1].error
        with pytest.raises(EngineDead):
            await _run(async_omni, "fault", "fine")
        return await _run(async_omni, "echo", "still here")

    assert asyncio.run(main())[-1].result.text == "still here"
    assert async_omni.snapshot.pipeline_dead("fault") and not async_omni.snapshot.pipeline_dead("echo")


def test_an_exception_escaping_a_step_marks_the_engine_dead(async_omni, monkeypatch):
    async def main():
        scheduler = async_omni.scheduler  # the plugin host's one StageScheduler, stepped by the engine thread
        real, calls = scheduler.step, []

        def broken(graph=None):
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("routing bug")
            return real(graph)

        monkeypatch.setattr(scheduler, "step", broken)
        stream = await async_omni.open("echo", " ".join(["w"] * 1000))
        events = [e async for e in stream]
        assert isinstance(events[-1], RequestFailed) and events[-1].kind == "engine_dead"
        assert "routing bug" in events[-1].error
        with pytest.raises(EngineDead):
            await _run(async_omni, "echo", "hi")

    asyncio.run(main())
    assert async_omni.snapshot.dead and async_omni.alive  # the thread stays up to refuse requests


def test_shutdown_lets_in_flight_finish_then_refuses(host):
    async_omni = AsyncOmni({"echo": Omni("echo", host=host)}).start()

    async def main():
        stream = await async_omni.open("echo", " ".join(["w"] * 200))
        aborted = await asyncio.to_thread(async_omni.shutdown, 10)
        events = [e async for e in stream]
        return aborted, events

    aborted, events = asyncio.run(main())
    assert aborted == 0 and isinstance(events[-1], RequestFinished)
    assert not async_omni.alive
    with pytest.raises(ShuttingDown):
        async_omni.submit_nowait("echo", async_omni.omnis["echo"].request("hi"), lambda e: None).result(1)


def test_shutdown_timeout_aborts_the_rest(host, monkeypatch):
    omni = Omni("echo", host=host)
    monkeypatch.setattr(omni.graph.stages["echo"].engine, "step", lambda: [])  # no progress: it cannot finish
    async_omni = AsyncOmni({"echo": omni}).start()

    async def main():
        stream = await async_omni.open("echo", "never finishes")
        aborted = await asyncio.to_thread(async_omni.shutdown, 0.05)
        events = [e async for e in stream]
        return aborted, events

    aborted, events = asyncio.run(main())
    assert aborted == 1 and isinstance(events[-1], RequestFailed) and events[-1].kind == "aborted"
    assert not async_omni.alive


def test_a_request_over_the_in_flight_limit_is_refused_and_admitted_once_one_ends(host):
    with AsyncOmni({"echo": Omni("echo", host=host)}, max_in_flight=2) as async_omni:
        long = " ".join(["w"] * 100000)

        async def main():
            streams = [await async_omni.open("echo", long) for _ in range(2)]
            with pytest.raises(Overloaded, match="2 requests in flight"):
                await async_omni.open("echo", "one too many")
            await streams[0].aclose()  # aborts it: its place frees once the engine thread took the abort
            # a snapshot that counts the abort was published after the step that let the aborted request go
            await asyncio.to_thread(wait_until, lambda: async_omni.snapshot.aborted == 1, 10, "the abort to be taken")
            assert async_omni.snapshot.in_flight == 1
            third = [e async for e in async_omni.generate("echo", "now there is room")]
            await streams[1].aclose()
            return third

        third = asyncio.run(main())
        assert isinstance(third[-1], RequestFinished) and third[-1].result.text == "now there is room"


def test_served_pipelines_step_on_the_hosts_one_scheduler(host):
    """Two served names of one pipeline (each its own Omni and graph) and another pipeline: one scheduler round
    steps the shared echo engine once for all of them, and each event reaches its own request's caller."""
    omnis = {"echo": Omni("echo", host=host), "echo2": Omni("echo", host=host), "fault": Omni("fault", host=host)}
    with AsyncOmni(omnis) as async_omni:
        assert async_omni.scheduler is host.scheduler
        rounds = []
        step = async_omni.scheduler.step
        async_omni.scheduler.step = lambda graph=None: rounds.append(graph) or step(graph)

        async def main():
            # The engine thread waits on the gate until the three submits are queued, so they start in one round
            # (on a loaded machine a submit could otherwise come a round late and add steps of its own).
            gate = threading.Event()
            held = async_omni.call(lambda: gate.wait(10))
            prompts = [("echo", "one two three"), ("echo2", "four five"), ("fault", "six seven eight nine")]
            tasks = [asyncio.create_task(_run(async_omni, name, prompt)) for name, prompt in prompts]
            await asyncio.sleep(0)  # each task runs up to its first await: its submit is queued by then
            gate.set()
            assert held.result(10) is True
            return await asyncio.gather(*tasks)

        results = asyncio.run(main())
        assert [events[-1].result.text for events in results] == ["one two three", "four five",
                                                                  "six seven eight nine"]
        assert [events[-1].result.pipeline for events in results] == ["echo", "echo", "fault"]
        assert set(rounds) == {None}  # every round is the host-wide one, never one Omni's
        assert async_omni.snapshot.steps <= 6  # four words and the rest in parallel, not one pipeline after another
    with pytest.raises(InvalidParameter, match="one plugin host"):
        AsyncOmni({"echo": omnis["echo"], "other": Omni("echo", host=_host())})


def _host():
    other = PluginHost()
    other.register(KernelPlugin(), "omni_kernel")
    return other


def test_build_checks_every_pipeline_before_it_builds_any(host):
    """A bad setting of the last served pipeline is refused before the first one's engine is built (a model load)."""
    with pytest.raises(InvalidParameter, match="placement"):
        AsyncOmni.build({"echo": ("echo", {}), "fault": ("fault", {"placement": "f=inproc,nowhere=inproc"})}, host)
    assert host.builder.engines == {}
    with pytest.raises(Exception, match="no_such_key"):
        AsyncOmni.build({"echo": ("echo", {}), "fault": ("fault", {"no_such_key": 1})}, host)
    assert host.builder.engines == {}
