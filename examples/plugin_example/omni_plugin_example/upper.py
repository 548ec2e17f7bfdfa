"""The text.upper stage: an executor that upper-cases its input a few characters per step, and its Stage."""

from __future__ import annotations

from omni_kernel.engine import Engine
from omni_kernel.errors import InputError
from omni_kernel.events import StageFinished, TokenDelta
from omni_kernel.graph import NodeSpec
from omni_kernel.request import StageInput, StageOutput
from omni_kernel.runner import ModelRunner
from omni_kernel.scheduler import SchedulerOutput, StepScheduler
from omni_kernel.stage import Stage


class UpperExecutor:
    """The "model" of this stage. Per-request state lives here, keyed by request id, until `free`."""

    def __init__(self, node_id: str, chunk: int):
        self.node_id = node_id
        self.chunk = chunk
        self.texts: dict[str, tuple[StageInput, str]] = {}
        self.done: dict[str, int] = {}

    def add_request(self, item: StageInput) -> None:
        self.texts[item.request_id] = (item, item.prompt.upper())
        self.done[item.request_id] = 0

    def execute(self, batch: SchedulerOutput) -> list:
        events = []
        for rid in batch.request_ids:
            item, text = self.texts[rid]
            start = self.done[rid]
            self.done[rid] = end = start + self.chunk
            events.append(TokenDelta(rid, self.node_id, text[start:end]))
            if end >= len(text):
                trace = {"upper.chars": len(text), "upper.steps": -(-len(text) // self.chunk)}
                events.append(StageFinished(rid, self.node_id, StageOutput(rid, self.node_id, text=text,
                                                                           stop_reason="done", trace=trace)))
        return events

    def free(self, request_id: str) -> None:
        self.texts.pop(request_id, None)
        self.done.pop(request_id, None)


class UpperStage(Stage):
    """Node policy: `strip` (default true) trims the incoming text before it is upper-cased."""

    def prepare(self, item: StageInput) -> StageInput:
        text = item.prompt.strip() if self.node.policy.get("strip", True) else item.prompt
        if not text:
            raise InputError(f"node {self.node_id} got no text to upper-case")
        return StageInput(item.request_id, text, params=item.params, options=item.options, trace=item.trace)


def build_upper_stage(node: NodeSpec, config) -> Stage:
    """The NodeType factory: one Stage with its own scheduler, runner and executor."""
    chunk = int(node.policy.get("chunk", 4))
    scheduler = StepScheduler(max_batch=8)  # every queued request advances each step
    return UpperStage(node, "text", Engine(scheduler, ModelRunner(UpperExecutor(node.id, chunk), node.id)))
