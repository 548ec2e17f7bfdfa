"""ARStage (the ar.text_generation and ar.prompt_bridge nodes) and QwenStages, the factories that build them
and own the loaded models. No torch at import: models load when a stage is built."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omni_kernel.engine import Engine
from omni_kernel.events import StageFailed, StageFinished
from omni_kernel.graph import NodeSpec
from omni_kernel.request import StageInput
from omni_kernel.scheduler import RequestOutput
from omni_kernel.stage import Stage

from .bridge_prompt import ANSWER_PREFIX, CONTRACT, bridge_messages, bridge_prompt
from .config import PROMPT_BRIDGE_POLICY, TEXT_GENERATION_POLICY, ARNodeSettings, QwenConfig, node_policy
from .inputs import ARInputProcessor
from .outputs import AROutputProcessor

log = logging.getLogger("omni")


class ARStage(Stage):
    """An AR node. `process` tokenizes and checks a request once; the engine's scheduler stops it at EOS, its
    budget or the context window; `postprocess` streams its text and stops it on a stop string. `process` may
    run beside a step (`concurrent_process`, set by build.py) when it has a tokenizer of its own."""

    def __init__(self, node: NodeSpec, engine: Engine, inputs: ARInputProcessor, outputs: AROutputProcessor,
                 summary: str):
        super().__init__(node, "ar", engine)
        self.inputs = inputs
        self.outputs = outputs
        self.summary = summary  # the KV pool and limits in one line, logged when the first request arrives

    def process(self, item: StageInput) -> StageInput:
        return self.inputs.process(item)

    def add_request(self, item: StageInput) -> None:
        if self.summary:
            log.info("%s", self.summary)
            self.summary = ""
        self.outputs.add(item)
        super().add_request(item)

    def postprocess(self, outputs: list[RequestOutput]) -> list:
        events: list = []
        for out in outputs:
            rid = out.request_id
            if out.error is not None:
                self.outputs.drop(rid)
                events.append(StageFailed.of(rid, self.node_id, out.error))
                continue
            delta, reason = self.outputs.add_token(rid, out.result, out.finished)
            if delta is not None:
                events.append(delta)
            if reason is None:
                continue
            stats = out.stats
            if out.finished is None:  # a stop string: the scheduler still holds the request
                stats = self.engine.scheduler.stats(rid)
                self.engine.abort(rid)
            events.append(StageFinished(rid, self.node_id, self.outputs.finish(rid, reason, stats)))
        return events

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.outputs.drop(request_id)


class QwenStages:
    """Builds the AR stages. Owns the loaded models, one per (path, dtype, device, trust_remote_code), and the
    paged forward over each, so a graph with several AR nodes (or several graphs of one host) loads each model
    once and keeps it loaded."""

    def __init__(self):
        self.models: dict[tuple, Any] = {}
        self.paged_models: dict[tuple, Any] = {}

    def text_generation(self, node: NodeSpec, config: QwenConfig | None) -> ARStage:
        policy = node_policy(node, TEXT_GENERATION_POLICY)
        settings = ARNodeSettings(chat=policy["chat"], max_tokens=policy["max_tokens"],
                                  max_num_seqs=policy["max_num_seqs"])
        return self._build(node, config or QwenConfig(), settings)

    def prompt_bridge(self, node: NodeSpec, config: QwenConfig | None) -> ARStage:
        policy = node_policy(node, PROMPT_BRIDGE_POLICY)
        settings = ARNodeSettings(chat=policy["chat"], render=bridge_prompt, messages=bridge_messages,
                                  answer_prefix=ANSWER_PREFIX, max_tokens=policy["max_tokens"],
                                  max_num_seqs=policy["max_num_seqs"], contract=CONTRACT, prompt_label="bridge_")
        return self._build(node, config or QwenConfig(), settings)

    def _build(self, node: NodeSpec, config: QwenConfig, settings: ARNodeSettings) -> ARStage:
        from .build import build_stage

        key = self._key(config)
        return build_stage(node, self.model(key), settings, config, lambda: self.paged_model(key))

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
        if key not in self.models:
            from .model import CausalLM

            path, dtype, device, trust = key
            self.models[key] = CausalLM.load(path, dtype=dtype, device=device, trust_remote_code=trust)
        return self.models[key]

    def paged_model(self, key: tuple):
        """The PagedDecoder over a loaded model, built once (it merges the model's q/k/v and gate/up weights)."""
        if key not in self.paged_models:
            from .paged.decoder import PagedDecoder

            self.paged_models[key] = PagedDecoder(self.model(key).model)
        return self.paged_models[key]
