"""Entry point of the omni_wan plugin. Imports no torch: models load when a stage is built."""

from omni_kernel import hookimpl
from omni_kernel.graph import NodeSpec, PipelinePlan
from omni_kernel.registry import NodeType

NODE_TYPE = "diffusion.wan22_i2v"
OPTIONS = {"model", "image", "preset", "height", "width", "num_frames", "steps", "guidance_scale", "output",
           "profile", "disable_cpu_offload", "vae_dtype"}


def _build(node, config):
    from .stage import build_wan_stage

    return build_wan_stage(node, config)


WAN_NODE = NodeType(NODE_TYPE, "diffusion", _build, options=OPTIONS,
                    description="Wan2.2 TI2V-5B image-to-video over diffusers, written to MP4")
WAN_PIPELINE = PipelinePlan("wan_i2v", [NodeSpec("wan", NODE_TYPE, final=True, plugin_hint="omni-wan")],
                            description="image + prompt -> MP4 with Wan2.2 TI2V-5B")


class WanPlugin:
    @hookimpl
    def omni_register_node_types(self, register):
        register(WAN_NODE)

    @hookimpl
    def omni_register_pipelines(self, register):
        register(WAN_PIPELINE)
