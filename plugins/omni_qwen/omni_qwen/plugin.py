"""Entry point of the omni_qwen plugin: its node types, pipeline and QwenStages, the factory that owns the loaded
models. Imports no torch: models load when a stage is built (build.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omni_kernel import NodeSpec, NodeType, PipelinePlan, hookimpl
from omni_kernel.stage import Stage

from .bridge_prompt import CONTRACT, bridge_prompt
from .config import PROMPT_BRIDGE_POLICY, TEXT_GENERATION_POLICY, ARNodeSettings, QwenConfig, QwenParams, node_policy

log = logging.getLogger("omni")

AR_TEXT = PipelinePlan(
    "ar_text", [NodeSpec("generate", "ar.text_generation", final=True, plugin_hint="omni-qwen")],
    description="Qwen2.5 (any local causal LM) text generation, streamed token by token")


class QwenStages:
    """Builds the AR stages. Owns the loaded models, one per (path, dtype, device, trust_remote_code), and the
    paged forward over each, so a graph with several AR nodes (or several graphs of one host) loads each model
    once and keeps it loaded."""

    def __init__(self):
        self.models: dict[tuple, Any] = {}
        self.paged_models: dict[tuple, Any] = {}

    def text_generation(self, node: NodeSpec, config: QwenConfig | None) -> Stage:
        policy = node_policy(node, TEXT_GENERATION_POLICY)
        settings = ARNodeSettings(chat=policy["chat"], max_tokens=policy["max_tokens"],
                                  max_num_seqs=policy["max_num_seqs"])
        return self._build(node, config or QwenConfig(), settings)

    def prompt_bridge(self, node: NodeSpec, config: QwenConfig | None) -> Stage:
        policy = node_policy(node, PROMPT_BRIDGE_POLICY)
        settings = ARNodeSettings(chat=policy["chat"], render=bridge_prompt, max_tokens=policy["max_tokens"],
                                  max_num_seqs=policy["max_num_seqs"], contract=CONTRACT, prompt_label="bridge_")
        return self._build(node, config or QwenConfig(), settings)

    def _build(self, node: NodeSpec, config: QwenConfig, settings: ARNodeSettings) -> Stage:
        from .build import build_stage

        key = self._key(config)
        return build_stage(node, self.model(key), settings, config, lambda: self.paged_model(key))

    def _key(self, config: QwenConfig) -> tuple:
        from .model import resolve_device

        path = config.ar_model
        if path is None:
            from .demo import ensure_demo_checkpoint

            path = ensure_demo_checkpoint()
            log.info("using a random-weight demo model at %s; pass --ar-model DIR for real weights", path)
        return (str(Path(path).expanduser().resolve()), config.ar_dtype, resolve_device(config.ar_device),
                config.ar_trust_remote_code)

    def model(self, key: tuple):
        """The loaded CausalLM for a (path, dtype, device, trust_remote_code) key."""
        if key not in self.models:
            from .model import CausalLM

            path, dtype, device, trust = key
            self.models[key] = CausalLM.load(path, dtype=dtype, device=device, trust_remote_code=trust)
        return self.models[key]

    def paged_model(self, key: tuple):
        """The PagedQwen2 over a loaded model, built once (it merges the model's q/k/v and gate/up weights)."""
        if key not in self.paged_models:
            from .paged.qwen2 import PagedQwen2

            self.paged_models[key] = PagedQwen2(self.model(key).model)
        return self.paged_models[key]


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
