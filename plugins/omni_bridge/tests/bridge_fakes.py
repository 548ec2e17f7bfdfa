"""Fake stages registered under the real node names (ar.prompt_bridge, diffusion.wan22_i2v): no torch, no model.

They keep the production pattern: a node type's engine (`Engine(scheduler, runner)`, one per model setting and
plugin host, as the kernel shares them) and its stages over that engine, `Stage(node, kind, inputs, engine,
outputs)`: the kernel's schedulers (the Wan one a PhaseScheduler sized from omni_wan's defaults,
`WanConfig().wan_max_batch`, with omni_wan's phases and phase order), runners that read `batch.records` and
return one result per request, and output processors that turn RequestOutputs into events, named after their
own node.
"""

import json

import attrs

from omni_bridge.plugin import BridgePlugin
from omni_kernel import ARParams, NodeType, StageOutput, StageProgress, TokenDelta, hookimpl, option
from omni_kernel.core.engine import Engine
from omni_kernel.core.params import integer
from omni_kernel.core.scheduler import PhaseScheduler, StepScheduler
from omni_kernel.core.stage import Outputs, Stage
from omni_kernel.events import StageFinished
from omni_kernel.plugins import PluginHost
from omni_wan.params import WanConfig  # torch-free: the production defaults the fake Wan stage is sized from

# What the fake AR stage "writes" for a prompt: (text, stop_reason).
REPLIES = {
    "a fox in snow": ('Here you go: {"guidance": "slow dolly-in, soft light"}', "eos"),
    "a cat on a roof": ('{"guidance": "wide shot, dusk, gentle camera', "max_tokens"),
    "a boat at sea": ("I cannot help with JSON today.", "eos"),
}


def narrated(guidance: str, narration: str) -> tuple[str, str]:
    """A narrated answer as the constrained AR stage writes it (the narrated contract's object, stopped)."""
    return json.dumps({"guidance": guidance, "narration": narration}), "stop"


# What the fake AR stage writes for the narrated pipelines' prompts (apart from REPLIES, which tests submit whole).
NARRATED_REPLIES = {
    "a red fox in fresh snow": narrated("slow dolly-in, soft morning light",
                                        "A red fox trots through the fresh snow. The forest is quiet and cold."),
    "a short clip": narrated("static shot", "Snow."),
    "a quiet lake": narrated("wide shot, mist", "The lake is calm and the birds are singing in the morning sun."),
    "a long story": narrated("slow pan", "The old man walks along the shore and tells a long stumble of a story."),
    "a BREAK scene": narrated("handheld", "The video stage breaks on this one, whatever the voice says."),
    "nothing to say": narrated("static shot", "..."),
    "a cut answer": ('{"guidance": "slow pan", "narration": "The sun ri', "max_tokens"),
}


@attrs.frozen
class FakeARConfig:
    ar_model: str | None = option(None, help="AR model directory", flag="--ar-model")


@attrs.frozen
class FakeWanConfig:
    model: str | None = option(None, help="diffusion model directory", flag="--model")


@attrs.frozen
class FakeBridgePolicy:
    """The PromptBridgePolicy keys omni_bridge's pipelines set (the fake AR stage writes its reply regardless)."""

    json_schema: object = option(None, help="the guidance schema the node's output is constrained to", type=object)
    max_tokens: int | None = option(None, help="the node's token budget", type=int, validator=integer(1))
    answer_prefix: str | None = option(None, help="the start of the node's answer", type=str)
    output_contract: str | None = option(None, help="what the node's output holds", type=str)


@attrs.frozen
class FakeWanPolicy:
    """The WanPolicy key omni_bridge's pipelines set (the fake Wan stage does not enforce it)."""

    image: str = option("required", help="whether a request brings an image", choices=("required", "none",
                                                                                        "optional"))


@attrs.frozen
class FakeWanParams:
    """The WanParams fields these tests use, declared the same way."""

    preset: str | None = option(None, help="diffusion preset", flag="--preset")
    num_inference_steps: int = option(2, help="denoise steps", type=int, flag="--steps", validator=integer(1))
    seed: int | None = option(None, help="random seed", type=int, flag="--seed", validator=integer(0))
    output: str | None = option(None, help="output file", flag="--output")


@attrs.frozen
class FakeAREngineSettings:
    ar_model: str | None = None


@attrs.frozen
class FakeWanEngineSettings:
    model: str | None = None


class FakeARRunner:
    """One step writes the whole reply: (text, stop reason)."""

    def add_request(self, record):
        pass

    def run(self, batch):
        return {job.request_id: REPLIES.get(job.item.prompt) or NARRATED_REPLIES[job.item.prompt]
                for job in batch.records}

    def free(self, record):
        pass


class FakeAROutputs(Outputs):
    """The reply as one TokenDelta, then its StageFinished (failures: the kernel's Outputs)."""

    def process(self, outputs):
        events, stops = super().process([o for o in outputs if o.error is not None])
        for out in (o for o in outputs if o.error is None):
            text, stop = out.result
            result = StageOutput(out.request_id, self.node_id, text=text, stop_reason=stop,
                                 contract="supplemental_guidance",
                                 trace={"ar.stop_reason": stop, "ar.output_tokens": len(text.split())})
            events += [TokenDelta(out.request_id, self.node_id, text), StageFinished(out.request_id, self.node_id,
                                                                                     result)]
        return events, stops


@attrs.define
class FakeWanRunner:
    """Phases as the real WanRunner sees them: prepare, one denoise step per engine step, decode, export (its result:
    the file's path)."""

    items: dict = attrs.Factory(dict)  # the requests it holds
    received: dict = attrs.Factory(dict)  # every input it was given, kept for the tests
    phases: list = attrs.Factory(list)  # (request id, phase, step) of every step run

    def add_request(self, record):
        item = record.item
        self.items[item.request_id] = self.received[item.request_id] = item

    def run(self, batch):
        results = {}
        for job, step in zip(batch.records, batch.steps):
            rid = job.request_id
            self.phases.append((rid, batch.phase, step))
            params = job.item.params
            if batch.phase in ("prepare", "denoise"):
                results[rid] = (step, params.num_inference_steps)  # (denoise steps done, total)
            elif batch.phase == "decode":
                results[rid] = None
            else:
                results[rid] = params.output or "video.mp4"
        return results

    def free(self, record):
        self.items.pop(record.request_id, None)


class FakeWanOutputs(Outputs):
    """Progress for the prepare and denoise steps, then the export's StageFinished (failures: the kernel's
    Outputs)."""

    def process(self, outputs):
        events, stops = super().process([o for o in outputs if o.error is not None])
        for out in (o for o in outputs if o.error is None):
            if isinstance(out.result, tuple):
                events.append(StageProgress(out.request_id, self.node_id, *out.result, "denoise"))
            elif out.finished is not None:
                steps = out.item.params.num_inference_steps
                result = StageOutput(out.request_id, self.node_id, path=out.result,
                                     trace={"diffusion.num_inference_steps": steps})
                events.append(StageFinished(out.request_id, self.node_id, result))
        return events, stops


def ar_engine_settings(node, config: FakeARConfig, policy) -> FakeAREngineSettings:
    return FakeAREngineSettings(config.ar_model)


def ar_engine(settings: FakeAREngineSettings) -> Engine:
    return Engine(StepScheduler(max_batch=16), FakeARRunner())


def ar_stage(node, config, policy, settings, engine: Engine) -> Stage:
    return Stage(node, "ar", None, engine, FakeAROutputs(node.id))


def wan_engine_settings(node, config: FakeWanConfig, policy) -> FakeWanEngineSettings:
    return FakeWanEngineSettings(config.model)


def wan_phases(item) -> tuple[str, ...]:
    """A request's steps as omni_wan names them (runner.phases)."""
    return ("prepare", *["denoise"] * item.params.num_inference_steps, "decode", "export")


def wan_stage(node, config, policy, settings, engine: Engine) -> Stage:
    return Stage(node, "diffusion", None, engine, FakeWanOutputs(node.id))


class FakeModels:
    """Registers fake stages under the names omni_qwen / omni_wan use; `only` limits which ones. `wan` is the fake
    Wan runner every fake Wan engine of it runs on, kept for the tests to look at."""

    def __init__(self, only=("ar.prompt_bridge", "diffusion.wan22_i2v")):
        self.only = only
        self.wan = FakeWanRunner()

    def _wan_engine(self, settings: FakeWanEngineSettings) -> Engine:
        scheduler = PhaseScheduler(max_batch=WanConfig().wan_max_batch, phases=wan_phases,
                                   phase_order=("export", "decode", "prepare", "denoise"))  # as omni_wan/runner.py
        return Engine(scheduler, self.wan)

    @hookimpl
    def omni_register_node_types(self, register):
        types = [NodeType("ar.prompt_bridge", "ar", engine_settings=ar_engine_settings, engine=ar_engine,
                          stage=ar_stage, config=FakeARConfig, params=ARParams, policy=FakeBridgePolicy),
                 NodeType("diffusion.wan22_i2v", "diffusion", engine_settings=wan_engine_settings,
                          engine=self._wan_engine, stage=wan_stage, config=FakeWanConfig, params=FakeWanParams,
                          policy=FakeWanPolicy, inputs={"image"})]
        for node_type in types:
            if node_type.name in self.only:
                register(node_type)


def make_host(models):
    host = PluginHost()
    host.register(BridgePlugin(), "omni_bridge")
    host.register(models, "fake_models")
    return host
