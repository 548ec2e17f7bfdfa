"""Planner (pipeline name -> PipelinePlan) and GraphBuilder (plan + config -> validated StageGraph).

The GraphBuilder is where engine sharing is decided: it keeps one engine per share key (`registry.share_key`) for
every graph it builds, so the stages of several pipelines of one plugin host that use the same node-type engine
with the same settings share one engine (one batch, one KV pool, one copy of the weights). A dead engine is
replaced by the next build.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import GraphError, InvalidParameter, PluginError, UnknownPipeline, UserError
from omni_kernel.core.graph import NodeSpec, PipelinePlan, StageGraph, validate_plan
from omni_kernel.core.params import make, options_of, resolve, split
from omni_kernel.core.placement import INPROC, RunSettings, check_placements
from omni_kernel.core.registry import NodeType, Registry, share_key
from omni_kernel.core.request import Request, StageInput


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


@attrs.frozen
class NodeBuild:
    """Everything one node's stage is built from, checked: its spec, type, config, policy and share key."""

    node: NodeSpec
    node_type: NodeType
    config: Any
    policy: Any
    key: tuple

    @property
    def settings(self) -> Any:
        """The node's engine settings (`NodeType.engine_settings`), computed once, when the build was prepared."""
        return self.key[1]


def node_policy(node: NodeSpec, node_type: NodeType) -> Any:
    """The node's policy instance (the plan's `NodeSpec.policy` validated by the node type's declared class)."""
    cls = node_type.policy
    if cls is None:
        if node.policy:
            raise GraphError("node_policy", [node.id], f"node {node.id!r}: node type {node_type.name!r} takes no "
                                                       f"policy, not {', '.join(sorted(node.policy))}")
        return None
    valid = sorted(options_of(cls))
    unknown = sorted(set(node.policy) - set(valid))
    if unknown:
        raise GraphError("node_policy", [node.id], f"node {node.id!r}: node type {node_type.name!r} has no policy "
                                                   f"key {unknown[0]!r}; valid keys: {', '.join(valid) or 'none'}")
    try:
        return make(cls, node.policy)
    except InvalidParameter as exc:
        raise GraphError("node_policy", [node.id], f"node {node.id!r}: policy {exc}") from None


def output_contract(node_type: NodeType, policy: Any) -> str | None:
    """What a node's output holds for a connector: its policy's `output_contract` where its node type's policy
    declares one and the plan sets it (the plugin that gives the node its answer's format names the contract too),
    else its node type's."""
    declared = getattr(policy, "output_contract", None)
    return declared if declared is not None else node_type.output_contract


class GraphBuilder:
    """Validates a plan against the registered node types and connectors, then builds its stages; keeps the
    engines it built, one per share key, for every later graph."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self.engines: dict[tuple, Engine] = {}

    def validate(self, plan: PipelinePlan) -> list[str]:
        """The graph rules, the connectors' contracts and the node policies; the node ids in order."""
        order = validate_plan(plan, self.registry.node_kinds(), self.registry.connector_items(),
                              self.registry.node_joins(), self.registry.stream_inputs())
        types = self.registry.node_types_of(plan)
        policies = {node.id: node_policy(node, types[node.id]) for node in plan.nodes}
        for e in plan.edges:
            self._check_contract(e, types[e.source], policies[e.source])
        return order

    def _check_contract(self, edge, source: NodeType, policy: Any) -> None:
        wanted = getattr(self.registry.connectors[edge.connector].item, "source_contract", None)
        outputs = output_contract(source, policy)
        if wanted is not None and outputs != wanted:
            raise GraphError("contract", [edge.source], f"connector {edge.connector!r} reads {wanted!r} but node "
                             f"{edge.source} ({source.name}) outputs {outputs!r}")

    def configs(self, plan: PipelinePlan, config: Mapping[str, Any] | None) -> dict[str, Any]:
        """Each node's config instance; an undeclared key is refused before any model loads."""
        types = self.registry.node_types_of(plan)
        return split(plan.name, "config key", {n: t.config for n, t in types.items()}, config or {})

    def prepare(self, plan: PipelinePlan, config: Mapping[str, Any] | None = None,
                settings: RunSettings | None = None) -> list[NodeBuild]:
        """Every check that needs no model: the plan, the config, the node policies, the placements' settings
        and each node's engine settings (which refuse settings invalid for the checkpoint). Nothing loads."""
        order = self.validate(plan)
        settings = (settings or RunSettings()).complete(self.placements())
        settings.check()
        check_placements(settings, plan, self.placements())
        self._check_stream_placements(plan, settings)
        configs = self.configs(plan, config)
        types = self.registry.node_types_of(plan)
        builds = []
        for node_id in order:
            node, node_type = plan.node(node_id), types[node_id]
            policy = node_policy(node, node_type)
            key = share_key(node_type, node, configs[node_id], policy)
            builds.append(NodeBuild(node, node_type, configs[node_id], policy, key))
        return builds

    def _check_stream_placements(self, plan: PipelinePlan, settings: RunSettings) -> None:
        """A streaming edge's target runs where chunks can reach it: in this process, or under a placement that
        declares `streams` (it carries StreamChunks to its stages)."""
        placements = self.placements()
        for edge in plan.edges:
            name = settings.placement_of(plan.node(edge.target)) if edge.stream else INPROC
            if name != INPROC and not getattr(placements.get(name), "streams", False):
                raise UserError(f"pipeline {plan.name!r} streams {edge.source} -> {edge.target}, and placement "
                                f"{name!r} cannot carry streamed chunks to node {edge.target!r} yet; place it "
                                f"inproc (--placement {edge.target}=inproc)")

    def check_request(self, plan: PipelinePlan, builds: list[NodeBuild], request: Request) -> None:
        """A request's parameters and inputs, against what the nodes declare and their own checks
        (`NodeType.check`), before any model loads."""
        params = resolve(plan.name, {b.node.id: b.node_type for b in builds}, request, plan.nodes)
        items = self.registry.connector_items()
        connectors = {(e.source, e.target): items.get(e.connector) for e in plan.edges}
        for build in builds:
            if build.node_type.check is None:
                continue
            item = request_input(plan, build.node.id, request, params[build.node.id], connectors)
            build.node_type.check(build.node, build.config, build.policy, build.settings, item)


    def placements(self) -> dict[str, Any]:
        return {name: r.item for name, r in self.registry.placements.items()}

    def build(self, plan: PipelinePlan, config: Mapping[str, Any] | None = None,
              settings: RunSettings | None = None, host_factory: Callable[[], Any] | None = None) -> StageGraph:
        """Build every node's stage where `settings` places it: `inproc` here, on the engine of its share key, any
        other placement by the plugin that registered it (docs/distributed.md). `host_factory` rebuilds the
        plugin host where a placement needs one (default: the placement's)."""
        settings = (settings or RunSettings()).complete(self.placements())
        builds = self.prepare(plan, config, settings)
        placed: dict[str, list[NodeBuild]] = {}
        for build in builds:
            placed.setdefault(settings.placement_of(build.node), []).append(build)
        stages: dict[str, Any] = {}
        handles: list = []
        try:
            for name, group in placed.items():  # placed stages first: they load their models while inproc ones do
                if name != INPROC:
                    stages.update(self._place(name, group, settings, host_factory, handles))
            for build in placed.get(INPROC, ()):
                stages[build.node.id] = self.stage(build)
            for stage in stages.values():
                stage.wait_ready()
        except BaseException:
            for handle in handles:
                handle.close()
            raise
        types = {b.node.id: b.node_type for b in builds}
        connectors = {(e.source, e.target): self.registry.connectors[e.connector].item for e in plan.edges}
        order = [b.node.id for b in builds]
        choices = {b.node.id: dict(b.node_type.choices(b.node, b.config, b.policy, b.settings)) for b in builds
                   if b.node_type.choices is not None}
        return StageGraph(plan=plan, stages={n: stages[n] for n in order}, connectors=connectors, order=order,
                          node_types=types, placed=handles, choices=choices)

    def _place(self, name: str, group: list[NodeBuild], settings: RunSettings, host_factory, handles: list) -> dict:
        """A placement's stages; the handle it returns (close(), watch(timeout)) is offered to the next placement of
        the graph, which may share it (omni-workers' process and ray share one group of workers)."""
        placement = self.registry.placements[name].item
        shared = handles[-1] if handles else None
        stages, handle = placement.build(group, settings.settings_of(name), host_factory, shared,
                                         fail_fast=settings.fail_fast)
        if handle is not None and handle is not shared:
            handles.append(handle)
        return stages

    def stage(self, build: NodeBuild) -> Any:
        """The node's stage in this process, on the engine of its share key (built, or a dead one replaced)."""
        engine = self.engine(build)
        stage = build.node_type.stage(build.node, build.config, build.policy, build.settings, engine)
        if stage.kind != build.node_type.kind:
            raise PluginError(f"node type {build.node_type.name!r} declares kind {build.node_type.kind!r} but its "
                              f"stage factory built a stage of kind {stage.kind!r}")
        return stage

    def engine(self, build: NodeBuild) -> Engine:
        engine = self.engines.get(build.key)
        if engine is None or engine.dead is not None:  # a dead engine takes nothing more: a new one
            engine = build.node_type.engine(build.settings)
            self.engines[build.key] = engine
        return engine


def request_input(plan: PipelinePlan, node_id: str, request: Request, params: Any,
                  connectors: Mapping[tuple[str, str], Any] | None = None) -> StageInput:
    """What a node is checked with at submit (and an entry node is given): the request's prompt and inputs, or,
    for a node whose input streams in, the opening of that stream (no prompt; its text comes in chunks). Where the
    connector of a node's input edge declares `stand_in` (its text is made from the source's output, which does
    not exist at submit: a transcript), the node is checked with the connector's stand-in for that input."""
    streamed = any(e.stream and e.target == node_id for e in plan.edges)
    item = StageInput(request.request_id, "" if streamed else request.prompt, image=request.image,
                      audio=request.audio, params=params, stream=streamed, arrival_time=request.arrival_time)
    edge = next((e for e in plan.edges if e.target == node_id and not e.stream), None)
    connector = None if edge is None else (connectors or {}).get((edge.source, edge.target))
    stand_in = getattr(connector, "stand_in", None)
    return item if stand_in is None else stand_in(item)
