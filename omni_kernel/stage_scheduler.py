"""StageScheduler: every request in flight across the graph.

It steps each stage, routes finished stage outputs through connectors to downstream stages and emits events.
It knows nothing of tokens, KV caches or denoise steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from .errors import InvalidParameter, RequestAborted, RequestError, UserError
from .events import (RequestFailed, RequestFinished, StageFailed, StageFinished)
from .graph import StageGraph
from .request import Request, RequestResult, StageInput, StageOutput


@attrs.define
class InFlight:
    request: Request
    remaining: set[str]
    outputs: dict[str, StageOutput] = attrs.Factory(dict)
    trace: dict[str, Any] = attrs.Factory(dict)
    start: float = attrs.Factory(time.perf_counter)


class StageScheduler:
    def __init__(self, graph: StageGraph):
        self.graph = graph
        self.in_flight: dict[str, InFlight] = {}
        self.backlog: list = []  # events that a helper stepped past for another request; returned next step

    def submit(self, request: Request) -> str:
        if request.pipeline != self.graph.name:
            raise InvalidParameter("pipeline", f"this scheduler runs {self.graph.name!r}, not {request.pipeline!r}")
        if request.request_id in self.in_flight:
            raise InvalidParameter("request_id", f"{request.request_id!r} is already in flight")
        for stage in self.graph.stages.values():
            stage.check(request)
        self.in_flight[request.request_id] = InFlight(request, set(self.graph.order))
        for node_id in self.graph.entries():
            stage = self.graph.stages[node_id]
            stage.add_request(StageInput.from_request(request, stage.kind))
        return request.request_id

    def has_unfinished(self) -> bool:
        return bool(self.in_flight) or bool(self.backlog)

    def step(self) -> list:
        events, self.backlog = self.backlog, []
        # Only stages that had work when the step began: a request handed downstream now starts next step, so
        # its first work (a model load and its log line) never runs before the upstream events are yielded.
        busy = [node_id for node_id in self.graph.order if self.graph.stages[node_id].has_unfinished()]
        for node_id in busy:
            for event in self.graph.stages[node_id].step():
                events.extend(self._route(node_id, event))
        return events

    def abort(self, request_id: str) -> None:
        if self.in_flight.pop(request_id, None) is None:
            return
        for stage in self.graph.stages.values():
            stage.abort(request_id)
        self.backlog.append(RequestFailed(request_id, None, "aborted"))

    def _route(self, node_id: str, event) -> list:
        flight = self.in_flight.get(event.request_id)
        if flight is None:
            return []  # aborted or failed while the stage was working on it
        if isinstance(event, StageFailed):
            return self._fail(flight, event.node_id, event.error, event.user_error)
        if not isinstance(event, StageFinished):
            return [event]
        flight.outputs[node_id] = event.output
        flight.remaining.discard(node_id)
        routed = [event]
        for child in self.graph.children(node_id):
            connector = self.graph.connectors[(node_id, child)]
            try:
                item = connector.convert(event.output, flight.request)
            except Exception as exc:  # noqa: BLE001 - a connector failure fails this request only
                return routed + self._fail(flight, child, f"connector {connector.name}: {exc}",
                                           isinstance(exc, UserError))
            flight.trace.update(item.trace)
            self.graph.stages[child].add_request(item)
        if not flight.remaining:
            routed.append(RequestFinished(flight.request.request_id, self._result(flight)))
            del self.in_flight[flight.request.request_id]
        return routed

    def _fail(self, flight: InFlight, node_id: str | None, error: str, user_error: bool) -> list:
        rid = flight.request.request_id
        del self.in_flight[rid]
        for stage in self.graph.stages.values():
            stage.abort(rid)
        return [RequestFailed(rid, node_id, error, user_error)]

    def _result(self, flight: InFlight) -> RequestResult:
        trace: dict[str, Any] = {"request.id": flight.request.request_id, "request.pipeline": self.graph.name}
        for node_id in self.graph.order:
            trace.update(flight.outputs[node_id].trace)
        trace.update(flight.trace)
        trace["request.elapsed_ms"] = round((time.perf_counter() - flight.start) * 1000, 3)
        return RequestResult(request_id=flight.request.request_id, pipeline=self.graph.name,
                             output=flight.outputs[self.graph.final], outputs=dict(flight.outputs), trace=trace)

    # Thin helpers over submit + step.

    def run(self, requests: Iterable[Request]) -> Iterator:
        """Submit every request, then yield all events until nothing is in flight."""
        for request in requests:
            self.submit(request)
        while self.has_unfinished():
            yield from self.step()

    def generate_stream(self, request: Request) -> Iterator:
        """Yield the events of one request; closing the iterator early aborts the request."""
        rid = self.submit(request)
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
                self.abort(rid)
                self.backlog = [e for e in self.backlog if e.request_id != rid]

    def generate(self, request: Request) -> RequestResult:
        """Run one request to the end; raise its error if it fails."""
        for event in self.generate_stream(request):
            if isinstance(event, RequestFinished):
                return event.result
            if isinstance(event, RequestFailed):
                raise raise_for(event)
        raise RequestAborted("aborted")


def raise_for(event: RequestFailed) -> Exception:
    if event.error == "aborted" and event.node_id is None:
        return RequestAborted("request aborted")
    return UserError(event.error) if event.user_error else RequestError(event.error)
