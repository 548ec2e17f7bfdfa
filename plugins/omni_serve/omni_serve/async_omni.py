"""AsyncOmni: one thread, the serving loop, owns the plugin host's StageScheduler, on which every served pipeline
runs. (Not the kernel's Engine: each stage's engine is stepped by the scheduler, on this thread.)

Everything that touches the scheduler (submit, step, abort) runs on the loop thread; other threads and the
asyncio loop hand it commands (closures) through a queue guarded by a Condition, so the thread blocks (no
spinning) while nothing is in flight. Each loop iteration runs the queued commands, then steps the scheduler once
(every engine that holds a request steps once, whichever served pipelines share it), hands each event to the
callback of its request, and publishes a snapshot of the stages (requests running/waiting, KV blocks) for
/metrics and /health.

An exception that escapes a scheduler step leaves its state untrustworthy: the whole loop is marked dead,
every request in flight fails with `EngineDead`, and new requests are refused; the thread stays up to answer
them. A stage whose own engine died (its scheduler raised) makes its pipeline dead in the same way.
No torch here: models load when the pipelines' graphs are built.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import attrs

from omni_kernel.api import Omni
from omni_kernel.core.errors import EngineDead, InvalidParameter, RequestError
from omni_kernel.core.placement import RunSettings
from omni_kernel.core.planner import Planner
from omni_kernel.core.request import Request
from omni_kernel.events import RequestFailed, RequestFinished
from omni_kernel.plugins import PluginHost

from .snapshot import Snapshot, StageSnapshot
from .stream import EventStream

log = logging.getLogger("omni")
WATCH_S = 1.0  # idle, the placed stages are looked at this often: one that died restarts before the next request
OnEvent = Callable[[Any], None]
Command = Callable[[], Any]  # queued for the loop thread, with the future (if any) that gets its result


class ShuttingDown(RequestError):
    """The server is shutting down and admits no new request."""


class Overloaded(RequestError):
    """As many requests as the server admits are in flight: retry later."""


@attrs.frozen
class _Caller:
    """Who hears of a request in flight: its served pipeline and the callback its events go to (the kernel's
    `InFlight` is the scheduler's own record of the request)."""

    pipeline: str
    on_event: OnEvent


class AsyncOmni:
    """Several pipelines (Omni objects of one plugin host, so loaded models and engines are shared) behind one
    serving loop over the host's one StageScheduler.

    `omnis` maps the served name to its Omni; two names may serve one pipeline with different configs (each its
    own Omni and graph). Use `start()` (or `with AsyncOmni(...)`), then `submit`/`abort` from any thread, or
    `async for event in async_omni.generate(name, prompt, **params)` from asyncio.
    """

    def __init__(self, omnis: Mapping[str, Omni], max_in_flight: int | None = None):
        if not omnis:
            raise InvalidParameter("pipeline", "no pipeline to serve")
        self.omnis = dict(omnis)
        schedulers = {id(omni.scheduler): omni.scheduler for omni in self.omnis.values()}
        if len(schedulers) != 1:
            raise InvalidParameter("pipeline", "the served pipelines must be Omni of one plugin host (one scheduler)")
        self.scheduler = next(iter(schedulers.values()))
        self.max_in_flight = max_in_flight  # requests submitted and not finished (None: no limit)
        self._cond = threading.Condition()
        self._commands: list[tuple[Command, concurrent.futures.Future | None]] = []  # run in order
        self._callers: dict[str, _Caller] = {}  # loop thread only
        self._submitting = 0  # admitted submits whose request is not in _callers yet (with the condition held)
        self._stop = False
        self._admitting = True
        self._thread: threading.Thread | None = None
        self._errors: Counter = Counter()
        self._aborted = 0
        self._steps = 0
        self.dead: EngineDead | None = None
        self.snapshot = self._snapshot()

    @classmethod
    def build(cls, pipelines: Mapping[str, tuple[str, Mapping[str, Any]]], host: PluginHost,
              max_in_flight: int | None = None) -> AsyncOmni:
        """`pipelines`: served name -> (pipeline name, config and run settings). One host: a model loads once for
        all of them. Every pipeline's plan, config and run settings are checked before any is built, so a bad
        setting of the last costs no model load of the first. One thread serves every pipeline, so each is built to
        fail fast (`RunSettings.fail_fast`): a call to a stage whose worker is restarting fails at once (503) instead
        of stalling them all for its model load."""
        for pipeline, config in pipelines.values():
            check_before_building(host, pipeline, config)
        omnis = {name: Omni(pipeline, host=host, fail_fast=True, **config) for name, (pipeline, config) in
                 pipelines.items()}
        return cls(omnis, max_in_flight)

    # Lifecycle.

    def start(self) -> AsyncOmni:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="omni-serve-loop", daemon=True)
            self._thread.start()
        return self

    def __enter__(self) -> AsyncOmni:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown(0)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop_admitting(self) -> None:
        """Refuse new requests from now on (ShuttingDown). A plain assignment, no lock: safe in a signal handler."""
        self._admitting = False

    def shutdown(self, timeout: float = 0.0) -> int:
        """Stop admitting, let requests in flight finish for up to `timeout` seconds, abort the rest, stop the
        thread. Returns how many requests were aborted."""
        with self._cond:
            self._admitting = False
            self._wait_idle(time.monotonic() + max(timeout, 0.0))
            left_over = len(self._callers) if self.alive else 0
            self._queue(self._abort_all)
            self._stop = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        return left_over

    def drain(self, timeout: float, reason: str) -> int:
        """Stop admitting, let requests in flight finish for up to `timeout` seconds, then fail the rest with
        `reason` (each caller gets a RequestFailed of kind "aborted" saying it, so a stream ends with an error
        event instead of being cut); the thread goes on. Returns how many requests were failed."""
        with self._cond:
            self._admitting = False
            if not self._wait_idle(time.monotonic() + max(timeout, 0.0)):
                return 0
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._queue(lambda: self._abort_all(reason), future)
        try:
            return len(future.result(timeout=30))
        except (concurrent.futures.TimeoutError, RuntimeError):
            return 0

    def _wait_idle(self, deadline: float) -> bool:
        """Wait until no request is in flight or admitted, the loop thread has stopped, or the monotonic clock
        reaches `deadline` (call with the condition held). Returns whether requests are still in flight on a live
        loop thread."""
        while self._busy() and self.alive:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)
        return self._busy() and self.alive

    def _busy(self) -> bool:
        """Requests in flight or admitted (call with the condition held)."""
        return self._in_flight() > 0

    def _in_flight(self) -> int:
        """Requests admitted and not finished: from the moment a submit is admitted (queued, or being processed
        on the loop thread) to its last event (call with the condition held)."""
        return len(self._callers) + self._submitting

    # Thread-safe entry points.

    def submit_nowait(self, pipeline: str, request: Request, on_event: OnEvent) -> concurrent.futures.Future:
        """Queue a request; the future resolves to its id once its inputs were processed (or raises the
        UserError that processing raised, or EngineDead). Its events go to `on_event` on the loop thread."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stop or not self._admitting:
                future.set_exception(ShuttingDown("the server is shutting down"))
                return future
            if self.max_in_flight is not None and self._in_flight() >= self.max_in_flight:
                future.set_exception(Overloaded(f"the server has {self.max_in_flight} requests in flight, as many as "
                                                "it admits (--max-concurrent-requests); retry later"))
                return future
            self._submitting += 1  # counted from here: queued and being processed alike
            self._queue(lambda: self._admitted_submit(pipeline, request, on_event), future)
        return future

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step (a no-op for an unknown or finished id)."""
        with self._cond:
            self._queue(lambda: self._abort(request_id))

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the loop thread (between steps) and return its future: how tests and tools look at a
        scheduler without racing the loop."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._queue(fn, future)
        return future

    def _queue(self, command: Command, future: concurrent.futures.Future | None = None) -> None:
        """Hand `command` to the loop thread, which runs it before its next step and tells `future` what it
        returned or raised (call with the condition held)."""
        self._commands.append((command, future))
        self._cond.notify_all()

    async def submit(self, pipeline: str, request: Request, on_event: OnEvent) -> str:
        return await asyncio.wrap_future(self.submit_nowait(pipeline, request, on_event))

    async def open(self, pipeline: str, prompt: str = "", image: str | None = None, request_id: str | None = None,
                   audio: str | bytes | None = None, **params: Any) -> EventStream:
        """Submit a request (a UserError raises here, before anything is sent to a client) and return the
        stream of its events. `audio`: an audio input's path or its file's bytes (an upload)."""
        omni = self.omnis.get(pipeline)
        if omni is None:
            raise InvalidParameter("model", f"{pipeline!r} is not served; served: {', '.join(self.omnis)}")
        return await self.open_request(pipeline, omni.request(prompt, image=image, request_id=request_id, audio=audio,
                                                              **params))

    async def open_request(self, pipeline: str, request: Request) -> EventStream:
        """`open` for a Request the caller made (e.g. one whose parameters hold a `prompt` of their own)."""
        stream = EventStream(self.abort, asyncio.get_running_loop())
        stream.request_id = await self.submit(pipeline, request, stream.put)
        return stream

    async def generate(self, pipeline: str, prompt: str = "", image: str | None = None,
                       request_id: str | None = None, audio: str | bytes | None = None,
                       **params: Any) -> AsyncIterator:
        """One request's events in order, ending with RequestFinished or RequestFailed. Leaving the loop early
        (or the task being cancelled, e.g. a client that disconnected) aborts the request."""
        stream = await self.open(pipeline, prompt, image, request_id, audio, **params)
        async with stream:
            async for event in stream:
                yield event

    # The loop thread.

    def _loop(self) -> None:
        watched = any(omni.graph.placed for omni in self.omnis.values())
        while True:
            with self._cond:
                while not self._commands and not self._has_work() and not self._stop:
                    if not self._cond.wait(WATCH_S if watched else None):
                        break  # idle that long: look at the stage workers
                commands, self._commands = self._commands, []
                stop = self._stop
            for command, future in commands:
                _run(command, future)
            if stop and not self._has_work():
                self._publish()
                break
            deliveries = self._step() if self._has_work() else []
            if self.dead is None:
                self._watch_idle()
            self._publish()  # before the events go out: a client told "finished" then reads this step's /health
            for caller, event in deliveries:
                self._deliver(caller, event)

    def _has_work(self) -> bool:
        return self.dead is None and self.scheduler.has_unfinished()

    def _watch_idle(self) -> None:
        """Let the placements of the pipelines with nothing in flight look at their stages, so a worker that died
        while idle is replaced before the next request instead of at it."""
        for omni in self.omnis.values():
            if not self.scheduler.has_unfinished(omni.graph):
                omni.graph.watch()

    def _admitted_submit(self, pipeline: str, request: Request, on_event: OnEvent) -> str:
        try:
            return self._submit(pipeline, request, on_event)
        finally:
            with self._cond:  # in _callers now (or refused): counted there from here
                self._submitting -= 1

    def _submit(self, pipeline: str, request: Request, on_event: OnEvent) -> str:
        if self.dead is not None:
            raise self.dead
        dead = self._pipeline_dead(pipeline)
        if dead:
            raise EngineDead(dead)
        omni = self.omnis.get(pipeline)
        if omni is None:
            raise InvalidParameter("model", f"{pipeline!r} is not served; served: {', '.join(self.omnis)}")
        if request.request_id in self._callers:
            raise InvalidParameter("request_id", f"{request.request_id!r} is already in flight")
        rid = omni.submit(request)
        self._callers[rid] = _Caller(pipeline, on_event)
        return rid

    def _abort(self, request_id: str, reason: str | None = None) -> None:
        caller = self._callers.get(request_id)
        if caller is None:
            return
        self.scheduler.abort(request_id)
        self._aborted += 1
        if reason is not None:  # its caller learns why now; the scheduler's own event finds no caller here
            del self._callers[request_id]
            self._deliver(caller, RequestFailed(request_id, None, reason, "aborted"))
        # else the abort's RequestFailed event comes out of the next step

    def _abort_all(self, reason: str | None = None) -> list[str]:
        """Abort every request in flight (see `_abort` for `reason`); returns their ids."""
        request_ids = list(self._callers)
        for request_id in request_ids:
            self._abort(request_id, reason)
        return request_ids

    def _step(self) -> list[tuple[_Caller, Any]]:
        """One round of the scheduler (every busy engine steps once): each event with the caller it goes to."""
        try:
            events = self.scheduler.step()
        except Exception as exc:  # noqa: BLE001 - the scheduler's state can no longer be trusted
            self._die(exc)
            return []
        self._steps += 1
        deliveries = []
        for event in events:
            caller = self._callers.get(event.request_id)
            if caller is None:
                continue  # aborted with a reason (its caller was told), or of an Omni this loop does not serve
            if isinstance(event, RequestFailed):
                self._count_failure(caller, event)
            if isinstance(event, (RequestFinished, RequestFailed)):
                del self._callers[event.request_id]
            deliveries.append((caller, event))
        return deliveries

    def _count_failure(self, caller: _Caller, event: RequestFailed) -> None:
        if not (event.node_id is None and event.kind == "aborted"):  # an abort is counted by `_abort`
            self._errors[(caller.pipeline, event.node_id or "-", event.kind)] += 1

    def _die(self, exc: Exception) -> None:
        log.error("engine loop failed and was stopped: %s: %s", type(exc).__name__, exc, exc_info=exc)
        self.dead = EngineDead(f"the engine failed and takes no more requests ({type(exc).__name__}: "
                               f"{' '.join(str(exc).split())})")
        for rid, caller in list(self._callers.items()):
            self._deliver(caller, RequestFailed(rid, None, str(self.dead), "engine_dead"))
        self._callers.clear()

    def _deliver(self, caller: _Caller, event) -> None:
        try:
            caller.on_event(event)
        except Exception:  # noqa: BLE001 - e.g. the caller's event loop is closed: its request goes
            log.debug("dropping an event of %s: its receiver is gone", event.request_id, exc_info=True)
            if not isinstance(event, (RequestFinished, RequestFailed)) and event.request_id in self._callers:
                self._abort(event.request_id)

    def _pipeline_dead(self, pipeline: str) -> str | None:
        omni = self.omnis.get(pipeline)
        if omni is None:
            return None
        return next((stage.dead for stage in omni.graph.stages.values() if stage.dead), None)

    def _publish(self) -> None:
        snapshot = self._snapshot()
        with self._cond:
            self.snapshot = snapshot
            self._cond.notify_all()

    def _snapshot(self) -> Snapshot:
        stages = []
        for name, omni in self.omnis.items():
            for node_id in omni.graph.order:
                stages.append(StageSnapshot.of(name, node_id, omni.graph.stages[node_id]))
        return Snapshot(tuple(stages), len(self._callers), None if self.dead is None else str(self.dead),
                        self._steps, dict(self._errors), self._aborted)


def _run(command: Command, future: concurrent.futures.Future | None) -> None:
    try:
        result = command()
    except BaseException as exc:  # noqa: BLE001 - the caller gets the error; the loop goes on
        if future is None:
            log.exception("a command of the serving loop failed")
            return
        future.set_exception(exc)
        # The error's traceback holds this frame: as long as the frame holds the future (which holds the error),
        # the request (its 18 MB prompt, say) stays in memory until a full garbage collection. So no command's
        # closure holds its future either: the future comes beside it.
        del future
        return
    if future is not None:
        future.set_result(result)


def check_before_building(host: PluginHost, pipeline: str, config: Mapping[str, Any]) -> None:
    """A served pipeline's plan, config and run settings, checked with nothing loaded (Omni checks them again as it
    builds)."""
    plan = Planner(host.registry).plan(pipeline)
    config = dict(config)
    settings = RunSettings.pop(config, host.builder.placements())
    host.builder.prepare(plan, config, settings)

