"""Planner (pipeline name -> PipelinePlan) and GraphBuilder (plan + config -> validated StageGraph)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import PluginError, UnknownPipeline
from .graph import PipelinePlan, StageGraph, validate_plan
from .params import split
from .registry import Registry


class Planner:
    """Static: each pipeline name maps to the plan a plugin registered."""

    def __init__(self, registry: Registry):
        self.registry = registry

    def names(self) -> list[str]:
        return sorted(self.registry.pipelines)

    def plan(self, name: str) -> PipelinePlan:
        registered = self.registry.pipelines.get(name)
        if registered is None:
            known = ", ".join(self.names()) or "none"
            raise UnknownPipeline(f"unknown pipeline {name!r}; known pipelines: {known}")
        return registered.item


class GraphBuilder:
    """Validates a plan against the registered node types and connectors, then builds its stages."""

    def __init__(self, registry: Registry):
        self.registry = registry

    def validate(self, plan: PipelinePlan) -> list[str]:
        return validate_plan(plan, self.registry.node_kinds(), self.registry.connector_items())

    def configs(self, plan: PipelinePlan, config: Mapping[str, Any] | None) -> dict[str, Any]:
        """Each node's config instance; an undeclared key is refused before any model loads."""
        types = self.registry.node_types_of(plan)
        return split(plan.name, "config key", {n: t.config for n, t in types.items()}, config or {})

    def build(self, plan: PipelinePlan, config: Mapping[str, Any] | None = None) -> StageGraph:
        order = self.validate(plan)
        configs = self.configs(plan, config)
        types = self.registry.node_types_of(plan)
        stages = {}
        for node_id in order:
            node_type = types[node_id]
            stage = node_type.factory(plan.node(node_id), configs[node_id])
            if stage.kind != node_type.kind:
                raise PluginError(f"node type {node_type.name!r} declares kind {node_type.kind!r} but its factory "
                                  f"built a stage of kind {stage.kind!r}")
            stages[node_id] = stage
        connectors = {(e.source, e.target): self.registry.connectors[e.connector].item for e in plan.edges}
        return StageGraph(plan=plan, stages=stages, connectors=connectors, order=order, node_types=types)
