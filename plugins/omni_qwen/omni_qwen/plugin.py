"""Entry point of the omni_qwen plugin. Imports no torch: models load when a stage is built."""

from omni_kernel import NodeSpec, NodeType, PipelinePlan, hookimpl

from .config import QwenConfig, QwenParams
from .stage import QwenStages

AR_TEXT = PipelinePlan(
    "ar_text", [NodeSpec("generate", "ar.text_generation", final=True, plugin_hint="omni-qwen")],
    description="Qwen2.5 (any local causal LM) text generation, streamed token by token")


class QwenPlugin:
    def __init__(self):
        self.stages = QwenStages()

    @hookimpl
    def omni_register_node_types(self, register):
        register(NodeType("ar.text_generation", "ar", self.stages.text_generation, config=QwenConfig,
                          params=QwenParams, description="the prompt as one user message through the chat "
                                                         "template; stops at EOS or the context window"))
        register(NodeType("ar.prompt_bridge", "ar", self.stages.prompt_bridge, config=QwenConfig,
                          params=QwenParams, description="asks the model for JSON supplemental guidance for a "
                                                         "Wan video prompt (contract supplemental_guidance, "
                                                         "internal token budget)"))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(AR_TEXT)

    @hookimpl
    def omni_register_commands(self, register):
        from .commands import models_command

        register(models_command)
