"""Entry point of the omni_qwen plugin: its node types, pipeline and QwenStages, the factory that owns the loaded
models. Imports no torch: models load when a stage is built (build.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from omni_kernel import NodeSpec, NodeType, PipelinePlan, hookimpl
from omni_kernel.core.stage import Stage

from .bridge_prompt import ANSWER_PREFIX, CONTRACT, bridge_messages, bridge_prompt
from .config import PROMPT_BRIDGE_POLICY, TEXT_GENERATION_POLICY, ARNodeSettings, QwenConfig, QwenParams, node_policy

log = logging.getLogger("omni")

AR_TEXT = PipelinePlan(
    "ar_text", [NodeSpec("generate", "ar.text_generation", final=True, plugin_hint="omni-qwen")],
    description="Qwen2.5 (any local causal LM) text generation, streamed token by token")


class QwenStages:
    """Builds the AR stages. Owns the loaded models, one per (path, dtype, device, trust_remote_code), and the
    paged forward over each, so a graph with several AR nodes (or several graphs of one host) loads each model
    once and keeps it loaded; and the engines, one per model and engine settings, which every AR stage built
    with them shares (one batch and one KV pool across the pipelines of a host)."""

    def __init__(self):
        from omni_hf import ModelPool

        self.models = ModelPool(_load_causal_lm)  # key: (path, dtype, device, trust_remote_code)
        self.paged_models = ModelPool(lambda key: _paged(self.model(key)))
        self.engines: dict[tuple, object] = {}  # (model key, config, max_num_seqs) -> build.AREngine

    def text_generation(self, node: NodeSpec, config: QwenConfig | None) -> Stage:
        policy = node_policy(node, TEXT_GENERATION_POLICY)
        settings = ARNodeSettings(chat=policy["chat"], max_tokens=policy["max_tokens"],
                                  max_num_seqs=policy["max_num_seqs"])
        return self._build(node, config or QwenConfig(), settings)

    def prompt_bridge(self, node: NodeSpec, config: QwenConfig | None) -> Stage:
        policy = node_policy(node, PROMPT_BRIDGE_POLICY)
        schema = node_schema(node, policy["json_schema"])
        settings = ARNodeSettings(chat=policy["chat"], render=bridge_prompt, messages=bridge_messages,
                                  answer_prefix=ANSWER_PREFIX, max_tokens=policy["max_tokens"],
                                  max_num_seqs=policy["max_num_seqs"], contract=CONTRACT, prompt_label="bridge_",
                                  json_schema=schema)
        return self._build(node, config or QwenConfig(), settings)

    @staticmethod
    def share_key(policy_table):
        """The node type's share key: the stages of one model and engine settings share an engine (`_build`)."""
        def key(node: NodeSpec, config: QwenConfig | None) -> tuple:
            config = config or QwenConfig()
            return (config, config.max_num_seqs_for(ARNodeSettings(
                max_num_seqs=node_policy(node, policy_table)["max_num_seqs"])))
        return key

    def _build(self, node: NodeSpec, config: QwenConfig, settings: ARNodeSettings) -> Stage:
        from .build import build_engine, build_stage

        key = self._key(config)
        lm = self.model(key)
        engine_key = (key, config, config.max_num_seqs_for(settings))
        shared = self.engines.get(engine_key)
        if shared is None or shared.engine.dead is not None:  # a dead engine takes nothing more: a new one
            shared = build_engine(lm, config, engine_key[2], lambda: self.paged_model(key))
            self.engines[engine_key] = shared
        return build_stage(node, lm, settings, config, shared)

    def _key(self, config: QwenConfig) -> tuple:
        from .model import resolve_device

        path = config.ar_model
        if path is None:
            from .default_model import default_ar_model

            path = default_ar_model()
        return (str(Path(path).expanduser().resolve()), config.ar_dtype, resolve_device(config.ar_device),
                config.ar_trust_remote_code)

    def model(self, key: tuple):
        """The loaded CausalLM for a (path, dtype, device, trust_remote_code) key."""
        return self.models.acquire(key).model

    def paged_model(self, key: tuple):
        """The PagedDecoder over a loaded model, built once (it merges the model's q/k/v and gate/up weights)."""
        return self.paged_models.acquire(key).model


def _load_causal_lm(key: tuple):
    from .model import CausalLM

    path, dtype, device, trust = key
    return CausalLM.load(path, dtype=dtype, device=device, trust_remote_code=trust)


def _paged(lm):
    from .paged.decoder import PagedDecoder

    return PagedDecoder(lm.model)


class QwenPlugin:
    def __init__(self):
        self.stages = QwenStages()

    @hookimpl
    def omni_register_node_types(self, register):
        register(NodeType("ar.text_generation", "ar", self.stages.text_generation, config=QwenConfig,
                          params=QwenParams, share_key=self.stages.share_key(TEXT_GENERATION_POLICY),
                          description="the prompt as one user message through the chat template; stops at EOS or "
                                      "the context window"))
        register(NodeType("ar.prompt_bridge", "ar", self.stages.prompt_bridge, config=QwenConfig,
                          params=QwenParams, output_contract=CONTRACT,
                          share_key=self.stages.share_key(PROMPT_BRIDGE_POLICY),
                          description="asks the model for JSON supplemental guidance for a Wan video prompt "
                                      "(contract supplemental_guidance, internal token budget)"))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(AR_TEXT)

    @hookimpl
    def omni_register_commands(self, register):
        from .commands import models_command

        register(models_command)


def node_schema(node: NodeSpec, value) -> str | None:
    """A node policy's json_schema, checked when the stage is built (one line naming the policy key)."""
    if value is None:
        return None
    from omni_kernel.core.errors import InvalidParameter

    from .grammar import grammar_of
    from .structured import Structure, json_schema

    try:
        schema = json_schema(value)
        grammar_of(Structure("json_schema", schema))
    except InvalidParameter as exc:
        raise InvalidParameter(f"policy json_schema of node {node.id}",
                               str(exc).split(": ", 1)[-1]) from None
    return schema
