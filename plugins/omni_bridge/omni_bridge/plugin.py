"""Entry point of the omni_bridge plugin. Imports no torch: it registers a connector and a pipeline only."""

from omni_kernel import hookimpl

from .pipeline import AR_TO_DIFFUSION, QWEN_TO_WAN_I2V, QWEN_TO_WAN_T2V


class BridgePlugin:
    @hookimpl
    def omni_register_connectors(self, register):
        register(AR_TO_DIFFUSION)

    @hookimpl
    def omni_register_pipelines(self, register):
        register(QWEN_TO_WAN_I2V)
        register(QWEN_TO_WAN_T2V)
