"""Entry point of the omni_wan plugin: its node type, pipeline and WanStages, the factory that owns the loaded
models. Imports no torch: models load when a stage is built (build.py)."""

from __future__ import annotations

from omni_kernel import hookimpl
from omni_kernel.core.graph import NodeSpec, PipelinePlan
from omni_kernel.core.registry import NodeType
from omni_kernel.core.stage import Stage

from .params import WanConfig, WanParams

NODE_TYPE = "diffusion.wan22_i2v"
# The node policy `image` says whether a request brings an image (inputs.IMAGE_POLICIES): the same node type, model
# and stage factory render image-to-video and text-to-video, so the two halves of TI2V-5B batch alike.
WAN_PIPELINE = PipelinePlan("wan_i2v", [NodeSpec("wan", NODE_TYPE, final=True, plugin_hint="omni-wan",
                                                 policy={"image": "required"})],
                            description="image + prompt -> MP4 with Wan2.2 TI2V-5B")
WAN_T2V_PIPELINE = PipelinePlan("wan_t2v", [NodeSpec("wan", NODE_TYPE, final=True, plugin_hint="omni-wan",
                                                     policy={"image": "none"})],
                                description="prompt -> MP4 with Wan2.2 TI2V-5B (text-to-video)")


class WanStages:
    """Builds `diffusion.wan22_i2v` stages (image- or text-to-video, by the node's policy). Owns the loaded models,
    the prepare cache and the engines, so every graph a plugin host builds shares them: a model loads once per
    process and host and stays loaded, and the stages of one model and config share one engine and its batches."""

    def __init__(self):
        from .loader import ModelPool
        from .prepare_cache import PrepareCache

        self.pool = ModelPool()
        self.cache = PrepareCache()
        self.engines: dict = {}  # (model path, device, config) -> the Engine its stages share (build.py)

    def build(self, node: NodeSpec, config: WanConfig | None) -> Stage:
        from .build import build_stage

        return build_stage(node, config or WanConfig(), self.pool, self.cache, self.engines)


def share_key(node: NodeSpec, config: WanConfig | None) -> WanConfig:
    """Every Wan node of one config shares its engine, whichever pipeline and image policy (build.py)."""
    return config or WanConfig()


class WanPlugin:
    def __init__(self):
        self.stages = WanStages()

    @hookimpl
    def omni_register_node_types(self, register):
        register(NodeType(NODE_TYPE, "diffusion", self.stages.build, config=WanConfig, params=WanParams,
                          inputs={"image"}, share_key=share_key,
                          description="Wan2.2 TI2V-5B image- or text-to-video over diffusers, written to MP4"))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(WAN_PIPELINE)
        register(WAN_T2V_PIPELINE)
