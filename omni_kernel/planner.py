"""Planner (pipeline name -> PipelinePlan) and PipelineRegistry (plan -> validated StageGraph)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import UnknownPipeline
from .graph import PipelinePlan, StageGraph, validate_plan
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


class PipelineRegistry:
    """Validates a plan against the registered node types and connectors, then builds its stages."""

    def __init__(self, registry: Registry):
        self.registry = registry

    def validate(self, plan: PipelinePlan) -> list[str]:
        return validate_plan(plan, self.registry.node_kinds(), self.registry.connector_items())

    def build(self, plan: PipelinePlan, config: Mapping[str, Any] | None = None) -> StageGraph:
        order = self.validate(plan)
        config = dict(config or {})
        stages = {}
        for node_id in order:
            node = plan.node(node_id)
            stages[node_id] = self.registry.node_types[node.type].item.factory(node, config)
        connectors = {(e.source, e.target): self.registry.connectors[e.connector].item for e in plan.edges}
        return StageGraph(plan=plan, stages=stages, connectors=connectors, order=order)
