"""Entry point of the omni_qwen plugin: its node types, pipeline and QwenStages, which builds each AR engine and stage
and owns the loaded models. Imports no torch: models load when an engine is built (build.py)."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import attrs

from omni_kernel import NodeSpec, NodeType, PipelinePlan, hookimpl
from omni_kernel.core.engine import Engine
from omni_kernel.core.request import StageInput
from omni_kernel.core.stage import Stage

from .bridge_prompt import bridge_messages, bridge_prompt
from .config import ARNodeSettings, PromptBridgePolicy, QwenConfig, QwenParams, TextGenerationPolicy
from .inputs import check_request

log = logging.getLogger("omni")

AR_TEXT = PipelinePlan(
    "ar_text", [NodeSpec("generate", "ar.text_generation", final=True, plugin_hint="omni-qwen")],
    description="Qwen2.5 (any local causal LM) text generation, streamed token by token")


@attrs.frozen
class QwenEngineSettings:
    """Everything an AR engine depends on (its share key, with QwenStages.engine): the loaded model's key, the run's
    config and the engine's sequences per step."""

    model: tuple  # (path, dtype, device, trust_remote_code)
    config: QwenConfig
    max_num_seqs: int


class QwenStages:
    """Builds each AR engine and stage (the kernel keeps one engine per QwenEngineSettings and shares it among the
    stages built on it: one batch and one KV pool across the pipelines of a host). Owns the loaded models, one per
    (path, dtype, device, trust_remote_code), the paged forward over each and a copy of each one's tokenizer, so a
    graph with several AR nodes (or several graphs of one host) loads each model once and keeps it loaded."""

    def __init__(self):
        from omni_hf import ModelPool

        self.models = ModelPool(_load_causal_lm)  # key: (path, dtype, device, trust_remote_code)
        self.paged_models = ModelPool(lambda key: _paged(self.model(key)))
        self.tokenizers = ModelPool(lambda key: _own_tokenizer(self.model(key)))
        self.default_model: Path | None = None  # resolved (and said) once: a plan asks for it at every check

    def engine_settings(self, node: NodeSpec, config: QwenConfig,
                        policy: TextGenerationPolicy | PromptBridgePolicy) -> QwenEngineSettings:
        return QwenEngineSettings(self._key(config), config, config.max_num_seqs_for(policy.max_num_seqs))

    def engine(self, settings: QwenEngineSettings) -> Engine:
        from .build import build_engine

        key = settings.model
        return build_engine(self.model(key), settings.config, settings.max_num_seqs, lambda: self.paged_model(key),
                            self.tokenizer(key))

    def text_generation(self, node: NodeSpec, config: QwenConfig, policy: TextGenerationPolicy,
                        settings: QwenEngineSettings, engine: Engine) -> Stage:
        return self._stage(node, settings, text_generation_node(policy), engine)

    def prompt_bridge(self, node: NodeSpec, config: QwenConfig, policy: PromptBridgePolicy,
                      settings: QwenEngineSettings, engine: Engine) -> Stage:
        return self._stage(node, settings, prompt_bridge_node(policy), engine)

    def _stage(self, node: NodeSpec, settings: QwenEngineSettings, node_settings: ARNodeSettings,
               engine: Engine) -> Stage:
        from .build import build_stage

        key = settings.model
        return build_stage(node, self.model(key), node_settings, settings.max_num_seqs,
                           settings.config.ar_max_num_batched_tokens, engine, self.tokenizer(key))

    def _key(self, config: QwenConfig) -> tuple:
        from omni_hf import resolve_device  # torch-free: a front that places the stage in a worker loads nothing

        path = config.ar_model
        if path is None:
            path = self._default_model()
        return (str(Path(path).expanduser().resolve()), config.ar_dtype, resolve_device(config.ar_device, "ar_device"),
                config.ar_trust_remote_code)

    def _default_model(self) -> Path:
        if self.default_model is None:
            from .default_model import default_ar_model

            self.default_model = default_ar_model()
        return self.default_model

    def model(self, key: tuple):
        """The loaded CausalLM for a (path, dtype, device, trust_remote_code) key."""
        return self.models.acquire(key).model

    def paged_model(self, key: tuple):
        """The PagedDecoder over a loaded model, built once (it merges the model's q/k/v and gate/up weights)."""
        return self.paged_models.acquire(key).model

    def tokenizer(self, key: tuple):
        """The copy of a loaded model's tokenizer for the work beside the steps (build.own_tokenizer), made once."""
        return self.tokenizers.acquire(key).model


def text_generation_node(policy: TextGenerationPolicy) -> ARNodeSettings:
    return ARNodeSettings(chat=policy.chat, max_tokens=policy.max_tokens)


def prompt_bridge_node(policy: PromptBridgePolicy) -> ARNodeSettings:
    """The answer's format comes with the policy (omni_bridge's pipelines give the guidance contract's)."""
    prefix = policy.answer_prefix
    return ARNodeSettings(chat=policy.chat, render=partial(bridge_prompt, answer_prefix=prefix),
                          messages=partial(bridge_messages, answer_prefix=prefix), answer_prefix=prefix or "",
                          max_tokens=policy.max_tokens, contract=policy.output_contract, prompt_label="bridge_",
                          json_schema=policy.json_schema)


def check_text_generation(node: NodeSpec, config: QwenConfig, policy: TextGenerationPolicy,
                          settings: QwenEngineSettings, item: StageInput) -> None:
    check_request(item, text_generation_node(policy))


def check_prompt_bridge(node: NodeSpec, config: QwenConfig, policy: PromptBridgePolicy, settings: QwenEngineSettings,
                        item: StageInput) -> None:
    check_request(item, prompt_bridge_node(policy))


def _load_causal_lm(key: tuple):
    from .model import CausalLM

    path, dtype, device, trust = key
    return CausalLM.load(path, dtype=dtype, device=device, trust_remote_code=trust)


def _own_tokenizer(lm):
    from .build import own_tokenizer

    return own_tokenizer(lm)


def _paged(lm):
    from .paged.decoder import PagedDecoder

    return PagedDecoder(lm.model)


class QwenPlugin:
    def __init__(self):
        self.stages = QwenStages()

    @hookimpl
    def omni_register_node_types(self, register):
        stages = self.stages  # both node types build on its one `engine`: equal settings share one engine
        register(NodeType("ar.text_generation", "ar", engine_settings=stages.engine_settings, engine=stages.engine,
                          stage=stages.text_generation, check=check_text_generation, config=QwenConfig,
                          params=QwenParams,
                          policy=TextGenerationPolicy,
                          description="the prompt as one user message through the chat template; stops at EOS or "
                                      "the context window"))
        register(NodeType("ar.prompt_bridge", "ar", engine_settings=stages.engine_settings, engine=stages.engine,
                          stage=stages.prompt_bridge, check=check_prompt_bridge, config=QwenConfig,
                          params=QwenParams,
                          policy=PromptBridgePolicy,
                          description="asks the model for supplemental guidance for a Wan video prompt, in the "
                                      "format its policy gives (omni_bridge's pipelines: their guidance JSON; "
                                      "internal token budget)"))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(AR_TEXT)

    @hookimpl
    def omni_register_models(self, register):
        from .default_model import default_line
        from .registry_model import SMOLLM2, fetchable

        register(fetchable(SMOLLM2, note=default_line))

