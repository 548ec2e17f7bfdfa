"""Stage: one graph node, assembled from a plugin's parts: Stage(node, kind, inputs, Engine(scheduler, runner),
outputs). The input processor runs once per request (`submit`, `hand_off`: process, then add to the engine), the
engine steps, the output processor makes the events."""

from __future__ import annotations

import logging

import attrs

from omni_kernel.core.engine import Engine
from omni_kernel.core.events import StageFailed, StageFinished
from omni_kernel.core.graph import NodeSpec
from omni_kernel.core.protocols import InputProcessor, OutputProcessor
from omni_kernel.core.request import StageInput, StageOutput, StageStats, StreamChunk
from omni_kernel.core.scheduler import RequestOutput

log = logging.getLogger("omni")


class Inputs:
    """The input processor of a stage whose runner takes the input as it comes."""

    concurrent = True

    def check(self, item: StageInput) -> None:
        pass

    def process(self, item: StageInput) -> StageInput:
        return item

    def extend(self, item: StageInput, chunk: StreamChunk) -> StageInput:
        """A streamed input's next chunk: its text goes on the end of the prompt."""
        return attrs.evolve(item, prompt=item.prompt + chunk.text)


class Outputs:
    """The output processor of a stage whose finished request's result is its StageOutput (or its text)."""

    def __init__(self, node_id: str):
        self.node_id = node_id

    def add(self, record) -> None:
        pass

    def process(self, outputs: list[RequestOutput]) -> tuple[list, list[str]]:
        events: list = []
        for out in outputs:
            if out.error is not None:
                events.append(StageFailed.of(out.request_id, self.node_id, out.error))
            elif out.finished is not None:
                result = out.result if isinstance(out.result, StageOutput) else StageOutput(
                    out.request_id, self.node_id, text=None if out.result is None else str(out.result),
                    stop_reason=out.finished)
                events.append(StageFinished(out.request_id, self.node_id, result))
        return events, []


class Stage:
    """One graph node's stage in this process, over an Engine that other stages (of other pipelines) may share.

    The StageScheduler steps `engine` once per round, whichever stages share it, and hands each stage the outputs
    of its own requests (`events_for`). `summary` (the stage's engine and limits in one line) is logged when the
    stage first makes events.
    """

    def __init__(self, node: NodeSpec, kind: str, inputs: InputProcessor | None, engine: Engine,
                 outputs: OutputProcessor | None = None, summary: str = ""):
        self.node = node
        self.kind = kind
        self.inputs = inputs or Inputs()
        self.engine = engine
        self.outputs = outputs or Outputs(node.id)
        self.summary = summary

    @property
    def node_id(self) -> str:
        return self.node.id

    @property
    def concurrent_inputs(self) -> bool:
        return self.inputs.concurrent

    @property
    def dead(self) -> str | None:
        """Why the stage takes no more requests (its engine died), or None."""
        return None if self.engine.dead is None else str(self.engine.dead)

    def check(self, item: StageInput) -> None:
        self.inputs.check(item)

    def process(self, item: StageInput) -> StageInput:
        return self.inputs.process(item)

    def add_request(self, item: StageInput) -> None:
        """Add a processed input to the engine; a failure there comes back as the request's StageFailed event."""
        record = self.engine.add_request(item)
        if record is not None:
            self.outputs.add(record)

    def submit(self, item: StageInput) -> None:
        """Process the input and add it; a processing error (a UserError) raises here."""
        self.add_request(self.process(item))

    def hand_off(self, item: StageInput) -> None:
        """As `submit`: in this process, the StageScheduler makes a processing error the request's StageFailed."""
        self.add_request(self.process(item))

    def append(self, chunk: StreamChunk) -> None:
        """The next chunk of a request's streamed input (it was handed off with `stream` set): its input processor's
        `extend` adds it to the request's processed input, its engine's scheduler counts the steps it adds. A
        failure comes back as the request's StageFailed event."""
        self.engine.extend(chunk.request_id, lambda item: self.inputs.extend(item, chunk), chunk.last)

    def events_for(self, outputs: list[RequestOutput]) -> list:
        """The events of this stage's requests' outputs from one engine step; the requests the output processor
        stopped itself (a stop string) are aborted in the engine."""
        if self.summary:
            log.info("%s", self.summary)
            self.summary = ""
        events, stops = self.outputs.process(outputs)
        for request_id in stops:
            self.engine.abort(request_id)
        return events

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def wait_ready(self, timeout: float | None = None) -> None:
        pass  # built in this process: ready

    def stats(self) -> StageStats:
        return self.engine.stats()
