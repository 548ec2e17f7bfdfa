"""Fake stages registered under the real node names (ar.prompt_bridge, diffusion.wan22_i2v): no torch, no plugin."""

import attrs

from omni_bridge.plugin import BridgePlugin
from omni_kernel import NodeType, StageFinished, StageOutput, StageProgress, TokenDelta, hookimpl
from omni_kernel.engine import Engine
from omni_kernel.plugins import PluginHost
from omni_kernel.runner import ModelRunner
from omni_kernel.scheduler import RequestScheduler, StepScheduler
from omni_kernel.stage import Stage

# What the fake AR stage "writes" for a prompt: (text, stop_reason).
REPLIES = {
    "a fox in snow": ('Here you go: {"guidance": "slow dolly-in, soft light"}', "eos"),
    "a cat on a roof": ('{"guidance": "wide shot, dusk, gentle camera', "max_tokens"),
    "a boat at sea": ("I cannot help with JSON today.", "eos"),
}


class FakeARExecutor:
    def __init__(self, node_id):
        self.node_id = node_id
        self.items = {}

    def add_request(self, item):
        self.items[item.request_id] = item

    def execute(self, batch):
        events = []
        for rid in batch.request_ids:
            text, stop = REPLIES[self.items[rid].prompt]
            output = StageOutput(rid, self.node_id, text=text, stop_reason=stop, contract="supplemental_guidance",
                                 trace={"ar.stop_reason": stop, "ar.output_tokens": len(text.split())})
            events += [TokenDelta(rid, self.node_id, text), StageFinished(rid, self.node_id, output)]
        return events

    def free(self, request_id):
        self.items.pop(request_id, None)


@attrs.define
class FakeWanExecutor:
    node_id: str
    received: dict = attrs.Factory(dict)
    steps: dict = attrs.Factory(dict)

    def add_request(self, item):
        self.received[item.request_id] = item
        self.steps[item.request_id] = 0

    def execute(self, batch):
        events = []
        for item in batch.items:
            self.steps[item.request_id] += 1
            events.append(StageProgress(item.request_id, self.node_id, self.steps[item.request_id], 2))
            if self.steps[item.request_id] == 2:
                output = StageOutput(item.request_id, self.node_id, path=item.options.get("output", "video.mp4"),
                                     trace={"diffusion.num_inference_steps": 2})
                events.append(StageFinished(item.request_id, self.node_id, output))
        return events

    def free(self, request_id):
        self.steps.pop(request_id, None)


class FakeModels:
    """Registers fake stages under the names omni_qwen / omni_wan use; `only` limits which ones."""

    def __init__(self, only=("ar.prompt_bridge", "diffusion.wan22_i2v")):
        self.only = only
        self.wan = FakeWanExecutor("video")

    def _ar(self, node, config):
        return Stage(node, "ar", Engine(RequestScheduler(), ModelRunner(FakeARExecutor(node.id), node.id)))

    def _wan(self, node, config):
        self.wan.node_id = node.id
        return Stage(node, "diffusion", Engine(StepScheduler(max_batch=4), ModelRunner(self.wan, node.id)))

    @hookimpl
    def omni_register_node_types(self, register):
        types = [NodeType("ar.prompt_bridge", "ar", self._ar, options={"stream", "ar_model"}),
                 NodeType("diffusion.wan22_i2v", "diffusion", self._wan,
                          options={"model", "image", "preset", "steps", "output"})]
        for node_type in types:
            if node_type.name in self.only:
                register(node_type)


def make_host(models):
    host = PluginHost()
    host.register(BridgePlugin(), "omni_bridge")
    host.register(models, "fake_models")
    return host
