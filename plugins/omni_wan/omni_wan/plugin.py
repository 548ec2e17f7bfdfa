"""Entry point of the omni_wan plugin. Imports no torch: models load when a stage first runs."""

from omni_kernel import hookimpl
from omni_kernel.graph import NodeSpec, PipelinePlan
from omni_kernel.registry import NodeType

from .params import WanConfig, WanParams
from .stage import WanStages

NODE_TYPE = "diffusion.wan22_i2v"
WAN_PIPELINE = PipelinePlan("wan_i2v", [NodeSpec("wan", NODE_TYPE, final=True, plugin_hint="omni-wan")],
                            description="image + prompt -> MP4 with Wan2.2 TI2V-5B")


class WanPlugin:
    def __init__(self):
        self.stages = WanStages()

    @hookimpl
    def omni_register_node_types(self, register):
        register(NodeType(NODE_TYPE, "diffusion", self.stages.build, config=WanConfig, params=WanParams,
                          inputs={"image"}, description="Wan2.2 TI2V-5B image-to-video over diffusers, written to MP4"))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(WAN_PIPELINE)
