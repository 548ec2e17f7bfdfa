"""An identity AR stage that streams its prompt back word by word, and the kernel's `echo` pipeline.

It runs the full layering (StageScheduler -> Stage -> Engine -> StepScheduler -> model runner) with no
model, so the kernel's own tests need no torch.
"""

from __future__ import annotations

import re
import time

import attrs

from .engine import Engine
from .errors import InvalidParameter
from .events import StageFinished, TokenDelta
from .graph import NodeSpec, PipelinePlan
from .hookspecs import hookimpl
from .params import ARParams
from .registry import NodeType
from .request import StageInput, StageOutput
from .scheduler import SchedulerOutput, StepScheduler
from .stage import Stage

_WORD = re.compile(r"\s*\S+|\s+")


@attrs.frozen
class Words:
    """The echo stage's processed input: the prompt split into words (its "tokens") and the budget."""

    words: tuple[str, ...] = attrs.field(converter=tuple)
    num_steps: int


class IdentityRunner:
    """The "model": step k of a request returns its k-th word."""

    def __init__(self):
        self.words: dict[str, tuple[str, ...]] = {}

    def add_request(self, item: StageInput) -> None:
        self.words[item.request_id] = item.processed.words

    def run(self, batch: SchedulerOutput) -> dict[str, str]:
        return {rid: self.words[rid][step] for rid, step in zip(batch.request_ids, batch.steps)}

    def free(self, request_id: str) -> None:
        self.words.pop(request_id, None)


class EchoStage(Stage):
    def __init__(self, node: NodeSpec, engine: Engine):
        super().__init__(node, "ar", engine)
        self.texts: dict[str, tuple[StageInput, list[str], list[float]]] = {}  # item, pieces, [start, first]

    def process(self, item: StageInput) -> StageInput:
        if not item.prompt:
            raise InvalidParameter("prompt", "must not be empty")
        words = _WORD.findall(item.prompt)
        params = item.params or ARParams()
        budget = min(len(words), params.max_tokens or len(words))
        return attrs.evolve(item, processed=Words(words, budget))

    def add_request(self, item: StageInput) -> None:
        self.texts[item.request_id] = (item, [], [time.perf_counter()])
        super().add_request(item)

    def postprocess(self, outputs) -> list:
        events = []
        for out in outputs:
            if out.error is None:
                item, pieces, times = self.texts[out.request_id]
                pieces.append(out.result)
                times.append(time.perf_counter())
                events.append(TokenDelta(out.request_id, self.node_id, out.result))
                if out.finished:
                    events.append(StageFinished(out.request_id, self.node_id, self._output(item, pieces, times)))
            if out.error is not None or out.finished:
                self.texts.pop(out.request_id, None)
        return events + super().postprocess([o for o in outputs if o.error is not None])

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.texts.pop(request_id, None)

    def _output(self, item: StageInput, pieces: list[str], times: list[float]) -> StageOutput:
        words = item.processed.words
        stop = "eos" if len(pieces) == len(words) else "max_tokens"
        params = item.params or ARParams()
        trace = {"ar.input_tokens": len(words), "ar.output_tokens": len(pieces), "ar.generated_tokens": len(pieces),
                 "ar.stop_reason": stop, "ar.streaming": params.stream, "ar.prompt_mode": "raw",
                 "ar.kv_cache": False, "ar.kv_cache_backend": "none",
                 "ar.ttft_ms": round((times[1] - times[0]) * 1000, 3)}
        return StageOutput(item.request_id, self.node_id, text="".join(pieces), stop_reason=stop, trace=trace)


def build_echo_stage(node: NodeSpec, config) -> Stage:
    scheduler = StepScheduler(max_batch=16, num_steps=lambda item: item.processed.num_steps)
    return EchoStage(node, Engine(scheduler, IdentityRunner()))


ECHO_NODE = NodeType("kernel.echo", "ar", build_echo_stage, params=ARParams,
                     description="streams the prompt back word by word (no model)")
ECHO_PIPELINE = PipelinePlan("echo", [NodeSpec("echo", "kernel.echo", final=True)],
                             description="the prompt, streamed back by the identity AR stage")


class KernelPlugin:
    """The kernel registers its own echo pipeline through the same hooks as any plugin."""

    @hookimpl
    def omni_register_node_types(self, register):
        register(ECHO_NODE)

    @hookimpl
    def omni_register_pipelines(self, register):
        register(ECHO_PIPELINE)
