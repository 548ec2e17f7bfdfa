"""Entry point of the omni_bridge plugin. Imports no torch: it registers connectors, pipelines and the mux node type
(which loads no model)."""

from omni_kernel import hookimpl

from .mux import MUX
from .narrated import GUIDANCE_TO_SPEECH, NARRATED_I2V, NARRATED_T2V, SPEECH_TO_MUX, VIDEO_TO_MUX
from .pipeline import AR_TO_DIFFUSION, QWEN_TO_WAN_I2V, QWEN_TO_WAN_T2V


class BridgePlugin:
    @hookimpl
    def omni_register_node_types(self, register):
        register(MUX)

    @hookimpl
    def omni_register_connectors(self, register):
        register(AR_TO_DIFFUSION)
        register(GUIDANCE_TO_SPEECH)
        register(VIDEO_TO_MUX)
        register(SPEECH_TO_MUX)

    @hookimpl
    def omni_register_pipelines(self, register):
        register(QWEN_TO_WAN_I2V)
        register(QWEN_TO_WAN_T2V)
        register(NARRATED_T2V)
        register(NARRATED_I2V)
