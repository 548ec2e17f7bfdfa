"""Entry point of the omni_wan plugin: its node type, pipelines and WanStages, which owns what every engine of a
plugin host shares: the model pool (loaded weights) and the prepare cache. Imports no torch: models load when
the kernel builds an engine (build.py)."""

from __future__ import annotations

import omni_hf

from omni_kernel import hookimpl
from omni_kernel.core.engine import Engine
from omni_kernel.core.graph import NodeSpec, PipelinePlan
from omni_kernel.core.registry import NodeType

from .build import WanEngineSettings, build_engine, build_stage, check_request, engine_settings
from .loader import load
from .params import WanConfig, WanParams, WanPolicy
from .prepare_cache import PrepareCache

NODE_TYPE = "diffusion.wan22_i2v"
# The node policy `image` says whether a request brings an image (params.IMAGE_POLICIES): the same node type, model
# and engine render image-to-video and text-to-video, so the two halves of TI2V-5B batch alike.
WAN_PIPELINE = PipelinePlan("wan_i2v", [NodeSpec("wan", NODE_TYPE, final=True, plugin_hint="omni-wan",
                                                 policy={"image": "required"})],
                            description="image + prompt -> MP4 with Wan2.2 TI2V-5B")
WAN_T2V_PIPELINE = PipelinePlan("wan_t2v", [NodeSpec("wan", NODE_TYPE, final=True, plugin_hint="omni-wan",
                                                     policy={"image": "none"})],
                                description="prompt -> MP4 with Wan2.2 TI2V-5B (text-to-video)")


class WanStages:
    """What every Wan engine of a plugin host shares: the loaded models (a model loads once per process and plugin
    host and stays loaded, whichever engines use it) and the prepare cache. The node type's other parts need
    neither (build.py)."""

    def __init__(self):
        self.pool = omni_hf.ModelPool(load)
        self.cache = PrepareCache()

    def engine(self, settings: WanEngineSettings) -> Engine:
        return build_engine(settings, self.pool, self.cache)


class WanPlugin:
    def __init__(self):
        self.stages = WanStages()

    @hookimpl
    def omni_register_node_types(self, register):
        register(NodeType(NODE_TYPE, "diffusion", engine_settings=engine_settings, engine=self.stages.engine,
                          stage=build_stage, check=check_request, config=WanConfig, params=WanParams,
                          policy=WanPolicy, inputs={"image"},
                          description="Wan2.2 TI2V-5B image- or text-to-video over diffusers, written to MP4"))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(WAN_PIPELINE)
        register(WAN_T2V_PIPELINE)

    @hookimpl
    def omni_register_commands(self, register):
        from .calibrate_cli import calibrate_command

        register(calibrate_command)
