"""The text.upper stage: its config, request parameters and node policy, its engine (scheduler and model runner),
its input and output processors, and the three functions its NodeType gives the kernel.

Every omni layer is here in miniature. The kernel builds one engine per share key (`upper_engine_settings`: here
the batch size, so every text.upper node of one plugin host with the same `upper_max_batch` shares one engine and
its batches, in any pipeline), and one Stage per node over it, Stage(node, kind, inputs, engine, outputs): the
input processor turns an input into what the runner needs (once per request), the kernel's StepScheduler decides
how many steps a request takes and when it is done (and owns its record), the runner computes one step for a
batch, and the output processor turns the results into events.
"""

from __future__ import annotations

import attrs

from omni_kernel import option
from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import InputError
from omni_kernel.core.graph import NodeSpec
from omni_kernel.core.params import boolean, integer
from omni_kernel.core.request import StageInput, StageOutput
from omni_kernel.core.scheduler import SchedulerOutput, StepScheduler
from omni_kernel.core.stage import Outputs, Stage
from omni_kernel.events import StageFinished, TokenDelta


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
class UpperPolicy:
    """Node policy, set by a pipeline plan (`NodeSpec(..., policy={"chunk": 4})`) and validated when the plan is
    built: a key it does not declare is refused."""

    chunk: int = option(4, help="characters per step", type=int, validator=integer(1))
    strip: bool = option(True, help="trim the input before upper-casing it", type=bool, validator=boolean)


@attrs.frozen
class UpperEngineSettings:
    """Everything the engine depends on, computed without building anything: equal settings share one engine."""

    max_batch: int


@attrs.frozen
class UpperText:
    """The processed input: the text to stream and the characters per step."""

    text: str
    chunk: int

    @property
    def num_steps(self) -> int:
        return -(-len(self.text) // self.chunk)


class UpperInputs:
    """The input processor, once per request, with the node's policy: `strip` trims the input, `chunk` is the
    characters per step. `concurrent`: `process` reads nothing a step changes."""

    concurrent = True

    def __init__(self, node_id: str, chunk: int, strip: bool):
        self.node_id, self.chunk, self.strip = node_id, chunk, strip

    def check(self, item: StageInput) -> None:
        pass  # an entry node: `process` runs at submit

    def process(self, item: StageInput) -> StageInput:
        text = item.prompt.strip() if self.strip else item.prompt
        if not text:
            raise InputError(f"node {self.node_id} got no text to upper-case")
        text = text.upper() + ("!" if item.params.shout else "")
        return attrs.evolve(item, processed=UpperText(text, self.chunk))


class UpperRunner:
    """The "model" of this stage: step k of a request returns its k-th chunk. It keeps nothing of its own: what a
    request needs is in its record (`record.item.processed`), which the scheduler owns."""

    def add_request(self, record) -> None:
        pass

    def run(self, batch: SchedulerOutput) -> dict[str, str]:
        results = {}
        for job, step in zip(batch.records, batch.steps):
            text = job.item.processed
            results[job.request_id] = text.text[step * text.chunk:(step + 1) * text.chunk]
        return results

    def free(self, record) -> None:
        pass


class UpperOutputs(Outputs):
    """The output processor: each step's chunk as a TokenDelta, then the whole text (kernel's Outputs: failures)."""

    def process(self, outputs) -> tuple[list, list[str]]:
        events, _ = super().process([o for o in outputs if o.error is not None])
        for out in (o for o in outputs if o.error is None):
            events.append(TokenDelta(out.request_id, self.node_id, out.result))
            if out.finished:
                text = out.item.processed
                trace = {"upper.chars": len(text.text), "upper.steps": text.num_steps}
                events.append(StageFinished(out.request_id, self.node_id, StageOutput(
                    out.request_id, self.node_id, text=text.text, stop_reason="done", trace=trace)))
        return events, []


def upper_engine_settings(node: NodeSpec, config: UpperConfig, policy: UpperPolicy) -> UpperEngineSettings:
    """NodeType.engine_settings: what this node's engine is built from (here, the only place to refuse settings
    that do not fit the model, before anything is built)."""
    return UpperEngineSettings(max_batch=config.upper_max_batch)


def build_upper_engine(settings: UpperEngineSettings) -> Engine:
    """NodeType.engine: the engine for those settings, Engine(scheduler, runner) (where a model would load)."""
    scheduler = StepScheduler(max_batch=settings.max_batch, num_steps=lambda item: item.processed.num_steps)
    return Engine(scheduler, UpperRunner())


def build_upper_stage(node: NodeSpec, config: UpperConfig, policy: UpperPolicy, settings: UpperEngineSettings,
                      engine: Engine) -> Stage:
    """NodeType.stage: the node's Stage over its (possibly shared) engine."""
    inputs = UpperInputs(node.id, policy.chunk, policy.strip)
    return Stage(node, "text", inputs, engine, UpperOutputs(node.id))
