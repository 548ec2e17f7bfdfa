"""Fake stages registered under the real node names (ar.prompt_bridge, diffusion.wan22_i2v): no torch, no model.

They keep the production pattern, Stage(node, kind, inputs, Engine(scheduler, runner), outputs): the kernel's
schedulers (the Wan one a DiffusionScheduler sized from omni_wan's defaults, `WanConfig().wan_max_batch`, with
omni_wan's phase order), runners that read `batch.records` and return one result per request, and output
processors that turn RequestOutputs into events.
"""

import attrs

from omni_bridge.plugin import BridgePlugin
from omni_kernel import ARParams, NodeType, StageOutput, StageProgress, TokenDelta, hookimpl, option
from omni_kernel.core.engine import Engine
from omni_kernel.core.params import integer
from omni_kernel.core.scheduler import DiffusionScheduler, StepScheduler
from omni_kernel.core.stage import Outputs, Stage
from omni_kernel.plugins import PluginHost
from omni_wan.params import WanConfig  # torch-free: the production defaults the fake Wan stage is sized from

# What the fake AR stage "writes" for a prompt: (text, stop_reason).
REPLIES = {
    "a fox in snow": ('Here you go: {"guidance": "slow dolly-in, soft light"}', "eos"),
    "a cat on a roof": ('{"guidance": "wide shot, dusk, gentle camera', "max_tokens"),
    "a boat at sea": ("I cannot help with JSON today.", "eos"),
}


@attrs.frozen
class FakeARConfig:
    ar_model: str | None = option(None, help="AR model directory", flag="--ar-model")


@attrs.frozen
class FakeWanConfig:
    model: str | None = option(None, help="diffusion model directory", flag="--model")


@attrs.frozen
class FakeWanParams:
    """The WanParams fields these tests use, declared the same way."""

    preset: str | None = option(None, help="diffusion preset", flag="--preset")
    num_inference_steps: int = option(2, help="denoise steps", type=int, flag="--steps", validator=integer(1))
    seed: int | None = option(None, help="random seed", type=int, flag="--seed", validator=integer(0))
    output: str | None = option(None, help="output file", flag="--output")


class FakeARRunner:
    """One step writes the whole reply."""

    def __init__(self, node_id):
        self.node_id = node_id

    def add_request(self, record):
        pass

    def run(self, batch):
        results = {}
        for job in batch.records:
            rid = job.request_id
            text, stop = REPLIES[job.item.prompt]
            results[rid] = StageOutput(rid, self.node_id, text=text, stop_reason=stop,
                                       contract="supplemental_guidance",
                                       trace={"ar.stop_reason": stop, "ar.output_tokens": len(text.split())})
        return results

    def free(self, record):
        pass


class FakeAROutputs(Outputs):
    """The reply as one TokenDelta, then the kernel's StageFinished (its StageOutput)."""

    def process(self, outputs):
        deltas = [TokenDelta(o.request_id, self.node_id, o.result.text) for o in outputs if o.error is None]
        events, stops = super().process(outputs)
        return deltas + events, stops


@attrs.define
class FakeWanRunner:
    """Phases as the real WanRunner sees them: prepare, one denoise step per engine step, decode, export."""

    node_id: str
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
                results[rid] = StageOutput(rid, self.node_id, path=params.output or "video.mp4",
                                           trace={"diffusion.num_inference_steps": params.num_inference_steps})
        return results

    def free(self, record):
        self.items.pop(record.request_id, None)


class FakeWanOutputs(Outputs):
    """Progress for the prepare and denoise steps, then the kernel's StageFinished (the export's StageOutput)."""

    def process(self, outputs):
        progress = [StageProgress(o.request_id, self.node_id, *o.result, "denoise") for o in outputs
                    if o.error is None and isinstance(o.result, tuple)]
        events, stops = super().process(outputs)
        return progress + events, stops


class FakeModels:
    """Registers fake stages under the names omni_qwen / omni_wan use; `only` limits which ones."""

    def __init__(self, only=("ar.prompt_bridge", "diffusion.wan22_i2v")):
        self.only = only
        self.wan = FakeWanRunner("video")

    def _ar(self, node, config):
        return Stage(node, "ar", None, Engine(StepScheduler(max_batch=16), FakeARRunner(node.id)),
                     FakeAROutputs(node.id))

    def _wan(self, node, config):
        self.wan.node_id = node.id
        scheduler = DiffusionScheduler(max_batch=WanConfig().wan_max_batch,
                                       num_steps=lambda item: item.params.num_inference_steps,
                                       phase_order=("export", "decode", "prepare", "denoise"))  # as omni_wan/build.py
        return Stage(node, "diffusion", None, Engine(scheduler, self.wan), FakeWanOutputs(node.id))

    @hookimpl
    def omni_register_node_types(self, register):
        types = [NodeType("ar.prompt_bridge", "ar", self._ar, config=FakeARConfig, params=ARParams,
                          output_contract="supplemental_guidance"),
                 NodeType("diffusion.wan22_i2v", "diffusion", self._wan, config=FakeWanConfig, params=FakeWanParams,
                          inputs={"image"})]
        for node_type in types:
            if node_type.name in self.only:
                register(node_type)


def make_host(models):
    host = PluginHost()
    host.register(BridgePlugin(), "omni_bridge")
    host.register(models, "fake_models")
    return host
