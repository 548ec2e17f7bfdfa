"""Planner (pipeline name -> PipelinePlan) and GraphBuilder (plan + config -> validated StageGraph)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .errors import PluginError, UnknownPipeline
from .graph import PipelinePlan, StageGraph, validate_plan
from .params import split
from .registry import Registry
from .workers import RunSettings, WorkerGroup, WorkerSpec, build_remote, check_placement_nodes, default_host_factory


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

    def build(self, plan: PipelinePlan, config: Mapping[str, Any] | None = None,
              settings: RunSettings | None = None, host_factory: Callable[[], Any] | None = None) -> StageGraph:
        """Build every node's stage where `settings` places it: in this process (the factory here), or in a
        worker process / Ray actor (the factory there, behind a proxy; docs/distributed.md). `host_factory`
        rebuilds the plugin host in a worker (default: `load_host()` under the same OMNI_PLUGINS)."""
        order = self.validate(plan)
        settings = settings or RunSettings()
        settings.check()
        check_placement_nodes(settings, plan)
        configs = self.configs(plan, config)
        types = self.registry.node_types_of(plan)
        stages: dict[str, Any] = {}
        group = None
        try:
            for node_id in order:
                node_type, node = types[node_id], plan.node(node_id)
                mode = settings.placement_of(node)
                if mode != "inproc":
                    group = group or WorkerGroup()
                    spec = WorkerSpec(node, node_type.kind, configs[node_id], host_factory or default_host_factory(),
                                      settings.worker_threads)
                    stages[node_id] = build_remote(mode, spec, group, settings)
                    continue
                stage = node_type.factory(node, configs[node_id])
                if stage.kind != node_type.kind:
                    raise PluginError(f"node type {node_type.name!r} declares kind {node_type.kind!r} but its "
                                      f"factory built a stage of kind {stage.kind!r}")
                stages[node_id] = stage
            for stage in stages.values():  # the workers load their models at the same time
                if hasattr(stage, "wait_ready"):
                    stage.wait_ready()
        except BaseException:
            if group is not None:
                group.close()
            raise
        connectors = {(e.source, e.target): self.registry.connectors[e.connector].item for e in plan.edges}
        return StageGraph(plan=plan, stages=stages, connectors=connectors, order=order, node_types=types,
                          workers=group)
