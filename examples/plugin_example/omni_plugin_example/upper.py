"""The text.upper stage: its config and request parameters, its model runner and its Stage.

Every omni layer is here in miniature: `process` turns an input into what the runner needs (once per
request), the kernel's StepScheduler decides how many steps a request takes and when it is done, the runner
computes one step for a batch, and `postprocess` turns the results into events.
"""

from __future__ import annotations

import attrs

from omni_kernel import option
from omni_kernel.engine import Engine
from omni_kernel.errors import InputError, InvalidParameter
from omni_kernel.events import StageFinished, TokenDelta
from omni_kernel.graph import NodeSpec
from omni_kernel.params import boolean, integer
from omni_kernel.request import StageInput, StageOutput
from omni_kernel.scheduler import SchedulerOutput, StepScheduler
from omni_kernel.stage import Stage


@attrs.frozen
class UpperConfig:
    """Model-level settings: `omni run -c upper_max_batch=4`, or `Omni(..., upper_max_batch=4)`."""

    upper_max_batch: int = option(8, help="requests upper-cased per step", type=int, validator=integer(1))


@attrs.frozen
class UpperParams:
    """Request parameters: `omni run --shout`, or `omni.generate(prompt, shout=True)`."""

    shout: bool = option(False, help="end the upper-cased text with '!'", type=bool, flag="--shout",
                         validator=boolean)


@attrs.frozen
class UpperText:
    """The processed input: the text to stream and the characters per step."""

    text: str
    chunk: int

    @property
    def num_steps(self) -> int:
        return -(-len(self.text) // self.chunk)


class UpperRunner:
    """The "model" of this stage. Per-request state lives here, keyed by request id, until `free`."""

    def __init__(self):
        self.texts: dict[str, UpperText] = {}

    def add_request(self, item: StageInput) -> None:
        self.texts[item.request_id] = item.processed

    def run(self, batch: SchedulerOutput) -> dict[str, str]:
        results = {}
        for rid, step in zip(batch.request_ids, batch.steps):
            text = self.texts[rid]
            results[rid] = text.text[step * text.chunk:(step + 1) * text.chunk]
        return results

    def free(self, request_id: str) -> None:
        self.texts.pop(request_id, None)  # a no-op for a request this runner never received


class UpperStage(Stage):
    """Node policy: `chunk` (characters per step, default 4) and `strip` (default true: trim the input)."""

    def __init__(self, node: NodeSpec, engine: Engine, chunk: int, strip: bool):
        super().__init__(node, "text", engine)
        self.chunk, self.strip = chunk, strip
        self.items: dict[str, StageInput] = {}

    def process(self, item: StageInput) -> StageInput:
        text = item.prompt.strip() if self.strip else item.prompt
        if not text:
            raise InputError(f"node {self.node_id} got no text to upper-case")
        text = text.upper() + ("!" if item.params.shout else "")
        return attrs.evolve(item, processed=UpperText(text, self.chunk))

    def add_request(self, item: StageInput) -> None:
        self.items[item.request_id] = item
        super().add_request(item)

    def postprocess(self, outputs) -> list:
        events = super().postprocess([o for o in outputs if o.error is not None])
        for out in outputs:
            item = self.items.get(out.request_id)
            if out.error is None and item is not None:
                events.append(TokenDelta(out.request_id, self.node_id, out.result))
                if out.finished:
                    text = item.processed
                    trace = {"upper.chars": len(text.text), "upper.steps": text.num_steps}
                    events.append(StageFinished(out.request_id, self.node_id, StageOutput(
                        out.request_id, self.node_id, text=text.text, stop_reason="done", trace=trace)))
            if out.error is not None or out.finished:
                self.items.pop(out.request_id, None)
        return events

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.items.pop(request_id, None)


def build_upper_stage(node: NodeSpec, config: UpperConfig) -> Stage:
    """The NodeType factory: one Stage with its own scheduler and runner."""
    unknown = sorted(set(node.policy) - {"chunk", "strip"})
    if unknown:
        raise InvalidParameter(f"policy of node {node.id}", f"unknown key(s) {', '.join(unknown)}; known: chunk, strip")
    chunk = node.policy.get("chunk", 4)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise InvalidParameter(f"policy chunk of node {node.id}", f"{chunk!r} is not an integer >= 1")
    scheduler = StepScheduler(max_batch=config.upper_max_batch, num_steps=lambda item: item.processed.num_steps)
    return UpperStage(node, Engine(scheduler, UpperRunner()), chunk, bool(node.policy.get("strip", True)))
