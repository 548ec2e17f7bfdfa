"""StageScheduler: every request in flight across the graph.

It steps each stage, routes finished stage outputs through connectors to downstream stages and emits events.
It knows nothing of tokens, KV caches or denoise steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.events import RequestFailed, RequestFinished, StageFailed, StageFinished
from omni_kernel.core.graph import StageGraph
from omni_kernel.core.params import split
from omni_kernel.core.request import Request, RequestResult, StageInput, StageOutput

log = logging.getLogger("omni")


@attrs.define
class InFlight:
    request: Request
    params: Mapping[str, Any]  # node id -> that node's params instance
    remaining: set[str]
    outputs: dict[str, StageOutput] = attrs.Factory(dict)
    trace: dict[str, Any] = attrs.Factory(dict)
    start: float = attrs.Factory(time.perf_counter)


def fail_stage(stage, exc: Exception) -> list:
    """A stage whose step raised fails (and drops) the requests it holds, not the loop that steps it (the
    StageScheduler here, a stage worker's loop in omni_workers): their StageFailed events."""
    log.error("stage %s failed: %s: %s", stage.node_id, type(exc).__name__, exc, exc_info=exc)
    held = sorted(stage.request_ids())
    for rid in held:
        stage.abort(rid)
    return [StageFailed.of(rid, stage.node_id, exc) for rid in held]


class StageScheduler:
    step_wait_s = 0.02  # the longest a step blocks on stage workers with nothing to report (no spinning)

    def __init__(self, graph: StageGraph):
        self.graph = graph
        self.in_flight: dict[str, InFlight] = {}
        self.backlog: list = []  # events that a helper stepped past for another request; returned next step

    def resolve(self, request: Request) -> dict[str, Any]:
        """Each node's params for the request; refuses keys and inputs no node of the pipeline declares."""
        types = self.graph.node_types
        if request.image is not None and not any("image" in t.inputs for t in types.values()):
            raise InvalidParameter("image", f"pipeline {self.graph.name!r} takes no input image")
        return split(self.graph.name, "request parameter", {n: t.params for n, t in types.items()}, request.params)

    def submit(self, request: Request) -> str:
        """Process the request's inputs for the entry nodes now, so a user mistake raises here."""
        if request.pipeline != self.graph.name:
            raise InvalidParameter("pipeline", f"this scheduler runs {self.graph.name!r}, not {request.pipeline!r}")
        if request.request_id in self.in_flight:
            raise InvalidParameter("request_id", f"{request.request_id!r} is already in flight")
        params = self.resolve(request)
        entries = self.graph.entries()
        items = {}
        for node_id in self.graph.order:
            item = StageInput(request.request_id, request.prompt, image=request.image, params=params[node_id])
            if node_id in entries:
                items[node_id] = self.graph.stages[node_id].process(item)
            else:
                self.graph.stages[node_id].check(item)
        self.in_flight[request.request_id] = InFlight(request, params, set(self.graph.order))
        for node_id, item in items.items():
            self.graph.stages[node_id].add_request(item)
        return request.request_id

    def has_unfinished(self) -> bool:
        return bool(self.in_flight) or bool(self.backlog)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a step would make progress; never spins on stages that are waiting on others (an
        in-process stage with work is ready at once; a worker's proxy blocks on its workers' pipes)."""
        if self.backlog:
            return True
        busy = [s for s in self.graph.stages.values() if s.has_unfinished()]
        if any(s.wait(0) for s in busy):
            return True
        for stage in busy if timeout != 0 else ():
            if stage.wait(timeout):
                return True
            timeout = 0  # one stage's wait blocks on all the workers of its group
        return False

    def step(self) -> list:
        """One step of every stage with work. With stage workers it first blocks (up to `step_wait_s`) until one
        of them has something to report, so a caller's `while has_unfinished(): step()` does not spin."""
        if not self.backlog and self.in_flight:
            self.wait(self.step_wait_s)
        events, self.backlog = self.backlog, []
        # Only stages that had work when the step began: a request handed downstream starts next step, so the
        # upstream events (its last text) reach the caller before the downstream stage's first work.
        busy = [node_id for node_id in self.graph.order if self.graph.stages[node_id].has_unfinished()]
        for node_id in busy:
            stage = self.graph.stages[node_id]
            try:
                stage_events = stage.step()
            except Exception as exc:  # noqa: BLE001 - a broken stage fails its own requests, not the loop
                stage_events = fail_stage(stage, exc)
            for event in stage_events:
                events.extend(self._route(node_id, event))
        return events

    def abort(self, request_id: str) -> None:
        if self.in_flight.pop(request_id, None) is None:
            return
        for stage in self.graph.stages.values():
            stage.abort(request_id)
        self.backlog.append(RequestFailed(request_id, None, "aborted", "aborted"))

    def _route(self, node_id: str, event) -> list:
        flight = self.in_flight.get(event.request_id)
        if flight is None:
            return []  # aborted or failed while the stage was working on it
        if isinstance(event, StageFailed):
            return self._fail(flight, event)
        if not isinstance(event, StageFinished):
            return [event]
        flight.outputs[node_id] = event.output
        flight.remaining.discard(node_id)
        routed: list = [event]
        for child in self.graph.children(node_id):
            connector = self.graph.connectors[(node_id, child)]
            # One call: a stage worker's proxy processes and adds in one message, so the front does not wait for the
            # worker's current step; its processing error comes back as that request's StageFailed.
            try:
                item = connector.convert(event.output, flight.request)
                item = attrs.evolve(item, params=flight.params[child]) if item.params is None else item
                flight.trace.update(item.trace)
                self.graph.stages[child].hand_off(item)
            except Exception as exc:  # noqa: BLE001 - a failed hand-off fails this request only
                return routed + self._fail(flight, StageFailed.of(flight.request.request_id, child, exc))
        if not flight.remaining:
            routed.append(RequestFinished(flight.request.request_id, self._result(flight)))
            del self.in_flight[flight.request.request_id]
        return routed

    def _fail(self, flight: InFlight, failed: StageFailed) -> list:
        rid = flight.request.request_id
        del self.in_flight[rid]
        for stage in self.graph.stages.values():
            stage.abort(rid)
        return [RequestFailed(rid, failed.node_id, failed.error, failed.kind, failed.field)]

    def _result(self, flight: InFlight) -> RequestResult:
        trace: dict[str, Any] = {"request.id": flight.request.request_id, "request.pipeline": self.graph.name}
        for node_id in self.graph.order:
            trace.update(flight.outputs[node_id].trace)
        trace.update(flight.trace)
        trace["request.elapsed_ms"] = round((time.perf_counter() - flight.start) * 1000, 3)
        return RequestResult(request_id=flight.request.request_id, pipeline=self.graph.name,
                             output=flight.outputs[self.graph.final], outputs=dict(flight.outputs), trace=trace)

    # Thin helpers over submit + step.

    def request(self, prompt: str, image: str | None = None, request_id: str | None = None,
                **params: Any) -> Request:
        extra = {"request_id": request_id} if request_id else {}
        return Request(self.graph.name, prompt, image=image, params=params, **extra)

    def run(self, requests: Iterable[Request]) -> Iterator:
        """Submit every request, then yield all events until nothing is in flight."""
        for request in requests:
            self.submit(request)
        while self.has_unfinished():
            yield from self.step()

    def generate_stream(self, prompt: str | Request, **kwargs: Any) -> Iterator:
        """Yield the events of one request (a Request, or a prompt and `request`'s keywords); closing the iterator
        early aborts the request."""
        rid = self.submit(prompt if isinstance(prompt, Request) else self.request(prompt, **kwargs))
        done = False
        try:
            while not done:
                mine = []
                for event in self.step():
                    (mine if event.request_id == rid else self.backlog).append(event)
                for event in mine:
                    done = done or isinstance(event, (RequestFinished, RequestFailed))
                    yield event
        finally:
            if not done:
                self._drop(rid)

    def generate(self, prompt: str | Request, **kwargs: Any) -> RequestResult:
        """Run one request to the end (a Request, or a prompt and `request`'s keywords); raise its error (typed,
        as the stage raised it) if it fails. Steps in this frame, not through generate_stream: a short call chain."""
        rid = self.submit(prompt if isinstance(prompt, Request) else self.request(prompt, **kwargs))
        try:
            while True:
                for event in self.step():
                    if event.request_id != rid:
                        self.backlog.append(event)
                    elif isinstance(event, RequestFinished):
                        rid = None
                        return event.result
                    elif isinstance(event, RequestFailed):
                        rid = None
                        raise event.exception()
        finally:
            if rid is not None:
                self._drop(rid)

    def _drop(self, request_id: str) -> None:
        """Abort a request its caller stopped waiting for, and forget its events."""
        self.abort(request_id)
        self.backlog = [e for e in self.backlog if e.request_id != request_id]
