"""StageScheduler: every request in flight across every pipeline of one plugin host.

Each round steps every engine that holds a request once (stages of several pipelines may share one engine), hands
each output to the stage of its request's node (stepping.py: the rule a stage worker follows too), routes finished
stage outputs through connectors to downstream stages and emits events. The request's record (`InFlight`) says
which node of which graph it is at on which engine. It knows nothing of tokens, KV caches or denoise steps, nor
where a stage runs: a placed stage keeps the same Stage contract (protocols.py).

Along a streaming edge it hands each event the source streams to the edge's splitter (the connector's: it alone
reads them) and sends each piece it cuts to the target as the next StreamChunk, opening the target's request at
the first; the source's finish sends the last. A join's inputs wait in the record until all are there, then its
node type's merge step makes its one input. A request is finished when every node is, so when each of its
outputs is; each output's StageFinished reaches the caller as its node makes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import attrs

from omni_kernel.core.errors import InvalidParameter, RequestError
from omni_kernel.core.events import RequestFailed, RequestFinished, StageFailed, StageFinished
from omni_kernel.core.graph import EdgeSpec, StageGraph
from omni_kernel.core.params import resolve
from omni_kernel.core.planner import request_input
from omni_kernel.core.request import Piece, Request, RequestResult, StageInput, StageOutput, StreamChunk
from omni_kernel.core.stepping import step_engine

log = logging.getLogger("omni")


@attrs.define(eq=False)
class EdgeStream:
    """One request's stream along one streaming edge: the connector's splitter, the chunks sent, and when the first
    went (ms from the request's submit)."""

    splitter: Any
    sent: int = 0
    first_chunk_ms: float | None = None


@attrs.define(eq=False)
class InFlight:
    """One request's record: its graph and params, the nodes still to finish, and where it runs now."""

    request: Request
    graph: StageGraph
    params: Mapping[str, Any]  # node id -> that node's params instance
    remaining: set[str]
    at: dict[int, str] = attrs.Factory(dict)  # id of an engine -> the node whose stage runs the request on it
    outputs: dict[str, StageOutput] = attrs.Factory(dict)
    trace: dict[str, Any] = attrs.Factory(dict)
    start: float = attrs.Factory(time.perf_counter)
    streams: dict[tuple[str, str], EdgeStream] = attrs.Factory(dict)  # (source, target) of a streaming edge
    joined: dict[str, dict[str, StageInput]] = attrs.Factory(dict)  # a join -> its inputs there so far, by name

    @property
    def request_id(self) -> str:
        return self.request.request_id


class StageScheduler:
    step_wait_s = 0.02  # the longest a step blocks on placed stages with nothing to report (no spinning)

    def __init__(self):
        self.in_flight: dict[str, InFlight] = {}
        self.undelivered: dict[int, list] = {}  # id of a graph -> its events that a step for another graph made

    # Requests in.

    def submit(self, request: Request, graph: StageGraph) -> str:
        """Submit the request to the graph's entry nodes and check it at the others now, in graph order, so a user
        mistake raises here; the entries it reached before one raised drop it again."""
        if request.pipeline != graph.name:
            raise InvalidParameter("pipeline", f"this graph runs {graph.name!r}, not {request.pipeline!r}")
        if request.request_id in self.in_flight:
            raise InvalidParameter("request_id", f"{request.request_id!r} is already in flight")
        params = resolve(graph.name, graph.node_types, request, graph.plan.nodes)
        entries = graph.entries()
        flight = InFlight(request, graph, params, set(graph.order))
        try:
            for edge in graph.plan.edges:
                if edge.stream:
                    splitter = graph.connectors[(edge.source, edge.target)].splitter(request)
                    flight.streams[(edge.source, edge.target)] = EdgeStream(splitter)
            for node_id in graph.order:
                item = request_input(graph.plan, node_id, request, params[node_id], graph.connectors)
                stage = graph.stages[node_id]
                if node_id in entries:
                    self._place(flight, node_id, stage)
                    stage.submit(item)
                else:
                    stage.check(item)
        except BaseException:
            self._abort_stages(flight)
            raise
        self.in_flight[request.request_id] = flight
        return request.request_id

    def _place(self, flight: InFlight, node_id: str, stage) -> None:
        """Record that the request runs at `node_id` on its stage's engine."""
        key = id(stage.engine)
        if key in flight.at:
            raise RequestError(f"nodes {flight.at[key]!r} and {node_id!r} of pipeline {flight.graph.name!r} share "
                               "one engine and would run this request on it at once")
        flight.at[key] = node_id
        flight.trace[f"node.{node_id}.start_ms"] = self._since(flight)

    # Stepping.

    def has_unfinished(self, graph: StageGraph | None = None) -> bool:
        if graph is None:
            return bool(self.in_flight) or any(self.undelivered.values())
        if self.undelivered.get(id(graph)):
            return True
        return any(f.graph is graph for f in self.in_flight.values())

    def busy_engines(self) -> list:
        """The engines that hold a request in flight, those of nodes nearer their graph's entry first."""
        found: dict[int, tuple[int, Any]] = {}
        for flight in self.in_flight.values():
            order = flight.graph.order
            for node_id in flight.at.values():
                engine = flight.graph.stages[node_id].engine
                depth = order.index(node_id)
                if id(engine) not in found or depth < found[id(engine)][0]:
                    found[id(engine)] = (depth, engine)
        return [engine for _, engine in sorted(found.values(), key=lambda pair: pair[0])]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a step would make progress; never spins on engines that are waiting on others (an
        in-process engine with work is ready at once; a placed stage blocks on its workers)."""
        busy = self.busy_engines()
        if any(engine.wait(0) for engine in busy):
            return True
        for engine in busy if timeout != 0 else ():
            if engine.wait(timeout):
                return True
            timeout = 0  # one wait blocks on all the workers of a placement's group
        return False

    def step(self, graph: StageGraph | None = None) -> list:
        """One round: every busy engine steps once. Returns the events of `graph`'s requests (the others are kept
        for their own graph's step), or, with no graph, every event. With placed stages it first blocks (up to
        `step_wait_s`) until one of them has something to report, so `while has_unfinished(): step()` never spins."""
        kept = self.undelivered.pop(id(graph), []) if graph is not None else self._take_undelivered()
        if not kept and self.in_flight:
            self.wait(self.step_wait_s)
        events = kept
        # Only the engines that had work when the round began: a request handed downstream starts next round, so
        # the upstream events (its last text) reach the caller before the downstream stage's first work.
        for engine in self.busy_engines():
            for owner, event in self._step_engine(engine):
                if graph is None or owner is graph:
                    events.append(event)
                else:
                    self.hold(owner, event)
        return events

    def hold(self, graph: StageGraph, event) -> None:
        """Keep an event for `graph`'s next step."""
        self.undelivered.setdefault(id(graph), []).append(event)

    def _take_undelivered(self) -> list:
        events = [e for kept in self.undelivered.values() for e in kept]
        self.undelivered.clear()
        return events

    def _step_engine(self, engine) -> list[tuple[StageGraph, Any]]:
        """Step one engine (stepping.py); route the events its requests' stages made."""
        routed = []
        for stage, event in step_engine(engine, lambda rid: self._owner(engine, rid), lambda: self._running(engine)):
            routed.extend(self._route(stage.node_id, event))
        return routed

    def _owner(self, engine, request_id: str):
        """The stage that runs the request on `engine`, or None (aborted or failed since)."""
        flight = self.in_flight.get(request_id)
        node_id = None if flight is None else flight.at.get(id(engine))
        return None if node_id is None else flight.graph.stages[node_id]

    def _running(self, engine) -> list[tuple[str, Any]]:
        return [(f.request_id, f.graph.stages[f.at[id(engine)]]) for f in self.in_flight.values() if id(engine) in f.at]

    # Routing.

    def _route(self, node_id: str, event) -> list[tuple[StageGraph, Any]]:
        flight = self.in_flight.get(event.request_id)
        if flight is None:
            return []  # aborted or failed while the stage was working on it
        if isinstance(event, StageFailed):
            return self._fail(flight, event)
        if not isinstance(event, StageFinished):
            return [(flight.graph, event), *self._pass_on(flight, node_id, event)]
        return self._finish_node(flight, node_id, event)

    def _pass_on(self, flight: InFlight, node_id: str, event) -> list[tuple[StageGraph, Any]]:
        """A streamed event of `node_id` to the splitter of each streaming edge from it, and what they cut on."""
        for edge in flight.graph.edges_from(node_id):
            if not edge.stream:
                continue
            try:
                self._send(flight, edge, flight.streams[(edge.source, edge.target)].splitter.feed(event), last=False)
            except Exception as exc:  # noqa: BLE001 - a failed chunk fails this request only
                return self._fail(flight, StageFailed.of(flight.request_id, edge.target, exc))
        return []

    def _finish_node(self, flight: InFlight, node_id: str, event: StageFinished) -> list[tuple[StageGraph, Any]]:
        graph = flight.graph
        flight.outputs[node_id] = event.output
        flight.trace[f"node.{node_id}.end_ms"] = self._since(flight)
        flight.remaining.discard(node_id)
        flight.at = {k: n for k, n in flight.at.items() if n != node_id}
        routed: list = [(graph, event)]
        for edge in graph.edges_from(node_id):
            try:
                if edge.stream:
                    pieces = flight.streams[(edge.source, edge.target)].splitter.end(event.output)
                    self._send(flight, edge, pieces, last=True)
                else:
                    self._hand_off(flight, edge, event.output)
            except Exception as exc:  # noqa: BLE001 - a failed hand-off fails this request only
                return routed + self._fail(flight, StageFailed.of(flight.request_id, edge.target, exc))
        if not flight.remaining:
            routed.append((graph, RequestFinished(flight.request_id, self._result(flight))))
            del self.in_flight[flight.request_id]
        return routed

    def _hand_off(self, flight: InFlight, edge: EdgeSpec, output: StageOutput) -> None:
        """The edge's connector's input to its target; into a join, once every input it waits for is there."""
        connector = flight.graph.connectors[(edge.source, edge.target)]
        item = self._filled(flight, edge.target, connector.convert(output, flight.request))
        flight.trace.update(item.trace)
        join = getattr(flight.graph.node_types.get(edge.target), "join", None)
        if join is not None:
            waiting = flight.joined.setdefault(edge.target, {})
            waiting[edge.input] = item
            if len(waiting) < len(join.inputs):
                return
            del flight.joined[edge.target]
            item = self._filled(flight, edge.target, join.merge(waiting, flight.request))
        self._start(flight, edge.target, item)

    def _filled(self, flight: InFlight, node_id: str, item: StageInput) -> StageInput:
        """A connector's (or a merge's) input with what the StageScheduler knows: the node's params, the arrival."""
        if item.params is None:
            item = attrs.evolve(item, params=flight.params[node_id])
        if item.arrival_time is None:
            item = attrs.evolve(item, arrival_time=flight.request.arrival_time)
        return item

    def _start(self, flight: InFlight, node_id: str, item: StageInput) -> None:
        # One call: a stage worker's proxy processes and adds in one message, so the front does not wait for the
        # worker's current step; its processing error comes back as that request's StageFailed.
        stage = flight.graph.stages[node_id]
        self._place(flight, node_id, stage)
        stage.hand_off(item)

    def _send(self, flight: InFlight, edge: EdgeSpec, pieces: list[Piece], last: bool) -> None:
        """Each piece as the edge's next StreamChunk, the target's request opened at the first; with `last`, the
        source finished: the last piece (or, with none left, an empty chunk) says so."""
        stream = flight.streams[(edge.source, edge.target)]
        if last and not pieces:
            pieces = [Piece()]
        stage = flight.graph.stages[edge.target]
        for i, piece in enumerate(pieces):
            if stream.sent == 0:
                self._start(flight, edge.target, request_input(flight.graph.plan, edge.target, flight.request,
                                                               flight.params[edge.target]))
                stream.first_chunk_ms = round((time.perf_counter() - flight.start) * 1000, 3)
            stage.append(StreamChunk(flight.request_id, edge.target, stream.sent, piece.text, piece.data,
                                     last=last and i == len(pieces) - 1))
            stream.sent += 1

    def _fail(self, flight: InFlight, failed: StageFailed) -> list[tuple[StageGraph, Any]]:
        del self.in_flight[flight.request_id]
        self._abort_stages(flight)
        return [(flight.graph, RequestFailed(flight.request_id, failed.node_id, failed.error, failed.kind,
                                             failed.field))]

    def _abort_stages(self, flight: InFlight) -> None:
        for node_id in flight.at.values():
            flight.graph.stages[node_id].abort(flight.request_id)
        flight.at.clear()
        for node_id, waiting in flight.joined.items():  # a join's inputs that will never be merged
            release = flight.graph.node_types[node_id].join.release
            try:
                if release is not None:
                    release(waiting, flight.request)
            except Exception:  # noqa: BLE001 - the request has already failed; the next join's inputs still go
                log.exception("join %s could not release request %s's inputs", node_id, flight.request_id)
        flight.joined.clear()

    @staticmethod
    def _since(flight: InFlight) -> float:
        """Milliseconds from the request's submit."""
        return round((time.perf_counter() - flight.start) * 1000, 3)

    def _result(self, flight: InFlight) -> RequestResult:
        graph = flight.graph
        trace: dict[str, Any] = {"request.id": flight.request_id, "request.pipeline": graph.name}
        for node_id in graph.order:
            trace.update(flight.outputs[node_id].trace)
        trace.update(flight.trace)
        for (source, target), stream in flight.streams.items():
            trace[f"stream.{source}.{target}.first_chunk_ms"] = stream.first_chunk_ms
            trace[f"stream.{source}.{target}.chunks"] = stream.sent
        trace["request.elapsed_ms"] = round((time.perf_counter() - flight.start) * 1000, 3)
        return RequestResult(request_id=flight.request_id, pipeline=graph.name, output=flight.outputs[graph.final],
                             outputs=dict(flight.outputs), trace=trace, finals=graph.finals)

    # Requests out.

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it runs; its graph's next step reports it as aborted."""
        flight = self.in_flight.pop(request_id, None)
        if flight is None:
            return
        self._abort_stages(flight)
        self.hold(flight.graph, RequestFailed(request_id, None, "aborted", "aborted"))

    def forget(self, graph: StageGraph, request_id: str) -> None:
        """Abort a request its caller stopped waiting for, and drop its events."""
        self.abort(request_id)
        kept = self.undelivered.get(id(graph), [])
        self.undelivered[id(graph)] = [e for e in kept if e.request_id != request_id]
