"""Planner (pipeline name -> PipelinePlan) and GraphBuilder (plan + config -> validated StageGraph)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omni_kernel.core.errors import GraphError, PluginError, UnknownPipeline
from omni_kernel.core.graph import PipelinePlan, StageGraph, validate_plan
from omni_kernel.core.params import split
from omni_kernel.core.placement import RunSettings, check_placement_nodes
from omni_kernel.core.registry import Registry


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
        order = validate_plan(plan, self.registry.node_kinds(), self.registry.connector_items())
        types = self.registry.node_types_of(plan)
        for e in plan.edges:
            wanted = getattr(self.registry.connectors[e.connector].item, "source_contract", None)
            if wanted is not None and types[e.source].output_contract != wanted:
                raise GraphError("contract", [e.source], f"connector {e.connector!r} reads {wanted!r} but node "
                                 f"{e.source} ({types[e.source].name}) outputs {types[e.source].output_contract!r}")
        return order

    def configs(self, plan: PipelinePlan, config: Mapping[str, Any] | None) -> dict[str, Any]:
        """Each node's config instance; an undeclared key is refused before any model loads."""
        types = self.registry.node_types_of(plan)
        return split(plan.name, "config key", {n: t.config for n, t in types.items()}, config or {})

    def build(self, plan: PipelinePlan, config: Mapping[str, Any] | None = None,
              settings: RunSettings | None = None, host_factory: Callable[[], Any] | None = None) -> StageGraph:
        """Build every node's stage where `settings` places it: `inproc` here (the node type's factory), any other
        placement by the plugin that registered it (e.g. omni-workers: a worker process or a Ray actor behind a
        proxy; docs/distributed.md). `host_factory` rebuilds the plugin host there (default: the plugin's)."""
        order = self.validate(plan)
        settings = settings or RunSettings()
        settings.check()
        check_placement_nodes(settings, plan, self.registry.placements)
        configs = self.configs(plan, config)
        types = self.registry.node_types_of(plan)
        placed: dict[str, list] = {}
        for node_id in order:
            placed.setdefault(settings.placement_of(plan.node(node_id)), []).append(node_id)
        stages: dict[str, Any] = {}
        workers = None
        try:
            for mode, ids in placed.items():  # workers first: they load their models while inproc stages do
                if mode != "inproc":
                    nodes = [(plan.node(n), types[n], configs[n]) for n in ids]
                    built, workers = self.registry.placements[mode].item.build(nodes, settings, host_factory, workers)
                    stages.update(built)
            for node_id in placed.get("inproc", ()):
                node_type = types[node_id]
                stages[node_id] = stage = node_type.factory(plan.node(node_id), configs[node_id])
                if stage.kind != node_type.kind:
                    raise PluginError(f"node type {node_type.name!r} declares kind {node_type.kind!r} but its "
                                      f"factory built a stage of kind {stage.kind!r}")
            for stage in stages.values():
                stage.wait_ready()
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        connectors = {(e.source, e.target): self.registry.connectors[e.connector].item for e in plan.edges}
        return StageGraph(plan=plan, stages={n: stages[n] for n in order}, connectors=connectors, order=order,
                          node_types=types, workers=workers)
