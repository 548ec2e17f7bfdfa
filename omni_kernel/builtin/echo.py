"""An identity AR stage that streams its prompt back word by word, and the kernel's `echo` pipeline.

It runs the full layering (StageScheduler -> Stage -> Engine -> StepScheduler -> model runner) with no
model, so the kernel's own tests need no torch.
"""

from __future__ import annotations

import re

import attrs

from omni_kernel.core.engine import Engine
from omni_kernel.core.events import StageFinished, TokenDelta
from omni_kernel.core.graph import NodeSpec, PipelinePlan
from omni_kernel.core.hookspecs import hookimpl
from omni_kernel.core.params import ARParams, check_prompt
from omni_kernel.core.registry import NodeType
from omni_kernel.core.request import StageInput, StageOutput, Usage
from omni_kernel.core.scheduler import SchedulerOutput, StepScheduler
from omni_kernel.core.stage import Inputs, Outputs, Stage

_WORD = re.compile(r"\s*\S+|\s+")


@attrs.frozen
class Words:
    """The echo stage's processed input: the prompt split into words (its "tokens") and the budget."""

    words: tuple[str, ...] = attrs.field(converter=tuple)
    num_steps: int


class IdentityRunner:
    """The "model": step k of a request returns its k-th word."""

    def add_request(self, record) -> None:
        record.state = record.item.processed.words

    def run(self, batch: SchedulerOutput) -> dict[str, str]:
        return {job.request_id: job.state[step] for job, step in zip(batch.records, batch.steps)}

    def free(self, record) -> None:
        pass


class EchoInputs(Inputs):
    def check(self, item: StageInput) -> None:
        check_prompt(item.prompt)

    def process(self, item: StageInput) -> StageInput:
        self.check(item)
        words = _WORD.findall(item.prompt)
        budget = min(len(words), item.params.max_tokens or len(words))
        return attrs.evolve(item, processed=Words(words, budget))


class EchoOutputs(Outputs):
    """Each step's word as a TokenDelta; the whole text when the request is finished."""

    def process(self, outputs) -> tuple[list, list[str]]:
        failed = [o for o in outputs if o.error is not None]
        events, _ = super().process(failed)
        for out in outputs:
            if out.error is not None:
                continue
            events.append(TokenDelta(out.request_id, self.node_id, out.result))
            if out.finished:
                events.append(StageFinished(out.request_id, self.node_id, self._output(out.item)))
        return events, []

    def _output(self, item: StageInput) -> StageOutput:
        words, num = item.processed.words, item.processed.num_steps
        stop = "eos" if num == len(words) else "max_tokens"
        trace = {"ar.input_tokens": len(words), "ar.output_tokens": num, "ar.generated_tokens": num,
                 "ar.stop_reason": stop, "ar.streaming": item.params.stream, "ar.prompt_mode": "raw",
                 "ar.kv_cache": False, "ar.kv_cache_backend": "none"}
        return StageOutput(item.request_id, self.node_id, text="".join(words[:num]), stop_reason=stop, trace=trace,
                           usage=Usage(input_tokens=len(words), output_tokens=num))


@attrs.frozen
class EchoEngineSettings:
    """The echo engine's one setting: how many requests share a step."""

    max_batch: int = 16


def echo_engine_settings(node: NodeSpec, config, policy) -> EchoEngineSettings:
    return EchoEngineSettings()


def build_echo_engine(settings: EchoEngineSettings) -> Engine:
    scheduler = StepScheduler(max_batch=settings.max_batch, num_steps=lambda item: item.processed.num_steps)
    return Engine(scheduler, IdentityRunner())


def build_echo_stage(node: NodeSpec, config, policy, settings: EchoEngineSettings, engine: Engine) -> Stage:
    return Stage(node, "ar", EchoInputs(), engine, EchoOutputs(node.id))


def check_echo_request(node: NodeSpec, config, policy, settings: EchoEngineSettings, item: StageInput) -> None:
    EchoInputs().check(item)


ECHO_NODE = NodeType("kernel.echo", "ar", engine_settings=echo_engine_settings, engine=build_echo_engine,
                     stage=build_echo_stage, check=check_echo_request, params=ARParams,
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
