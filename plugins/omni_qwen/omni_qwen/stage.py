"""The ar.text_generation and ar.prompt_bridge nodes: their policies, their Stage and their factories."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omni_kernel.engine import Engine
from omni_kernel.errors import InvalidParameter
from omni_kernel.graph import NodeSpec
from omni_kernel.request import Request
from omni_kernel.stage import Stage

from .bridge_prompt import CONTRACT, bridge_prompt
from .serving import ServingConfig

log = logging.getLogger("omni")

# Node policy keys and their defaults. max_tokens is the node's token budget (None: EOS or context window);
# max_num_seqs None leaves it to the run's config (ar_max_num_seqs, default 64).
TEXT_GENERATION_POLICY = {"max_tokens": None, "chat": True, "max_num_seqs": None}
PROMPT_BRIDGE_POLICY = {"max_tokens": 128, "chat": True, "max_num_seqs": None}


def node_policy(node: NodeSpec, defaults: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(node.policy) - set(defaults))
    if unknown:
        raise InvalidParameter(f"policy of node {node.id}", f"unknown key(s) {', '.join(unknown)}; "
                               f"known: {', '.join(sorted(defaults))}")
    policy = {**defaults, **node.policy}
    budget = policy["max_tokens"]
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise InvalidParameter(f"policy max_tokens of node {node.id}", f"{budget!r} is not an integer >= 1")
    seqs = policy["max_num_seqs"]
    if seqs is not None and (not isinstance(seqs, int) or isinstance(seqs, bool) or seqs < 1):
        raise InvalidParameter(f"policy max_num_seqs of node {node.id}", f"{seqs!r} is not an integer >= 1")
    return policy


class ARStage(Stage):
    """An AR node: refuses a prompt the model cannot take, or one that can never fit the KV pool, before
    anything runs."""

    def __init__(self, node: NodeSpec, engine: Engine, executor):
        super().__init__(node, "ar", engine)
        self.executor = executor
        self.announced = False  # the engine's one-line summary is logged at the first request

    def check(self, request: Request) -> None:
        self.executor.check(request.prompt, request.options, request.params.get(self.kind))

    def add_request(self, item) -> None:
        if not self.announced:
            log.info("%s", self.executor.summary)
            self.announced = True
        super().add_request(item)


class QwenStages:
    """Builds the AR stages. Owns the loaded models, one per (path, dtype, device), so a graph with several AR
    nodes (or several graphs of one host) loads each model once and keeps it loaded."""

    def __init__(self):
        self.pipelines: dict[tuple, Any] = {}

    def text_generation(self, node: NodeSpec, config: Mapping[str, Any]) -> ARStage:
        policy = node_policy(node, TEXT_GENERATION_POLICY)
        from .sequence import ARNodeSettings

        settings = ARNodeSettings(chat=policy["chat"], max_tokens=policy["max_tokens"])
        return self._build(node, config, policy, settings)

    def prompt_bridge(self, node: NodeSpec, config: Mapping[str, Any]) -> ARStage:
        policy = node_policy(node, PROMPT_BRIDGE_POLICY)
        from .sequence import ARNodeSettings

        settings = ARNodeSettings(chat=policy["chat"], render=bridge_prompt, max_tokens=policy["max_tokens"],
                                  contract=CONTRACT, prompt_label="bridge_")
        return self._build(node, config, policy, settings)

    def _build(self, node: NodeSpec, config: Mapping[str, Any], policy, settings) -> ARStage:
        serving = ServingConfig.from_config(config, policy["max_num_seqs"])  # refused before any model loads
        pipeline = self.pipeline(config)
        from .engine import build_ar_engine

        engine, executor = build_ar_engine(node.id, pipeline, settings, serving)
        return ARStage(node, engine, executor)

    def pipeline(self, config: Mapping[str, Any]):
        """The loaded model for this run's config (ar_model, ar_dtype, ar_device, ar_trust_remote_code)."""
        from .model import TransformersARPipeline, default_device, resolve_dtype

        path = config.get("ar_model")
        if path is None:
            from .demo import ensure_demo_checkpoint

            path = ensure_demo_checkpoint()
            log.info("using a random-weight demo model at %s; pass --ar-model DIR for real weights", path)
        dtype = config.get("ar_dtype")
        resolve_dtype(dtype)
        device = config.get("ar_device") or default_device()
        trust = bool(config.get("ar_trust_remote_code", False))
        key = (str(Path(path).expanduser().resolve()), dtype, device, trust)
        if key not in self.pipelines:
            self.pipelines[key] = TransformersARPipeline.load(path, dtype=dtype, device=device,
                                                              trust_remote_code=trust)
        return self.pipelines[key]
