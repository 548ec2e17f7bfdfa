"""Pipeline plans and the StageGraph rules (docs/architecture.md, "Graph rules")."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import attrs

from omni_kernel.core.errors import GraphError
from omni_kernel.core.ranks import RankLauncher


@attrs.frozen
class NodeSpec:
    """One graph node: an id, a registered node type, and that node's policy.

    `placement` is where the node's stage runs when the run does not say (`inproc`, `process`, `ray`;
    docs/distributed.md); `resources` are the Ray resources of its actor (e.g. {"GPU": 1}; default {"CPU": 1}).
    Both are the kernel's, not the plugin's: they stay out of `policy`, which the plugin validates. `ranks` is not
    the plan's: the placement that builds the node in a process of its own sets it there (core/ranks.py), and the
    node type's engine settings carry it to its engine.
    """

    id: str
    type: str
    policy: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    final: bool = False
    plugin_hint: str | None = None  # the distribution that provides `type`, for the "install X" message
    placement: str | None = None
    resources: Mapping[str, float] | None = attrs.field(default=None,
                                                        converter=lambda r: None if r is None else dict(r))
    ranks: RankLauncher | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class EdgeSpec:
    source: str
    target: str
    connector: str


@attrs.frozen
class PipelinePlan:
    """A static pipeline: nodes, edges and which node's output is the request's output."""

    name: str
    nodes: tuple[NodeSpec, ...] = attrs.field(converter=tuple)
    edges: tuple[EdgeSpec, ...] = attrs.field(default=(), converter=tuple)
    description: str = ""

    def node(self, node_id: str) -> NodeSpec:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(f"pipeline {self.name!r} has no node {node_id!r}")


RULES = ("duplicate_node", "unknown_edge_node", "self_loop", "cycle", "multiple_inputs", "no_entry",
         "final_output", "unknown_node_type", "unknown_connector", "connector_kind_mismatch", "contract",
         "node_policy")  # the last two are checked against the registry (planner.GraphBuilder.validate)


def validate_plan(plan: PipelinePlan, node_kinds: Mapping[str, str], connectors: Mapping[str, Any]) -> list[str]:
    """Check every rule; raise one GraphError naming the first broken rule and its nodes.

    node_kinds maps a registered node type to its kind; connectors maps a connector name to an object with
    `source_kind` and `target_kind`. Returns the node ids in topological order.
    """
    ids = [n.id for n in plan.nodes]
    _check_unique(ids)
    _check_edges(plan.edges, set(ids))
    order = _kahn(ids, plan.edges)
    if len(order) != len(ids):
        stuck = sorted(_cycle_nodes(ids, plan.edges))
        raise GraphError("cycle", stuck, f"the graph has a cycle through {', '.join(stuck)}")
    _check_inputs(ids, plan.edges)
    _check_final(plan.nodes)
    _check_node_types(plan.nodes, node_kinds)
    kinds = {n.id: node_kinds[n.type] for n in plan.nodes}
    for e in plan.edges:
        _check_connector(e, kinds, connectors)
    return order


def _check_unique(ids: list[str]) -> None:
    counts = Counter(ids)
    duplicates = sorted(i for i, k in counts.items() if k > 1)
    if duplicates:
        raise GraphError("duplicate_node", duplicates, f"node ids must be unique: {', '.join(duplicates)}")


def _check_edges(edges, ids: set[str]) -> None:
    for e in edges:
        missing = [n for n in (e.source, e.target) if n not in ids]
        if missing:
            raise GraphError("unknown_edge_node", missing,
                             f"edge {e.source} -> {e.target} names unknown node(s) {', '.join(missing)}")
    for e in edges:
        if e.source == e.target:
            raise GraphError("self_loop", [e.source], f"node {e.source} has an edge to itself")


def _check_inputs(ids: list[str], edges) -> None:
    inputs = Counter(e.target for e in edges)
    many = sorted(n for n, k in inputs.items() if k > 1)
    if many:
        raise GraphError("multiple_inputs", many, f"a node takes at most one input edge: {', '.join(many)}")
    # With at most one input per node and no cycles, every node is reachable from an entry node.
    if all(i in inputs for i in ids):
        raise GraphError("no_entry", [], "the graph has no entry node")


def _check_final(nodes) -> None:
    finals = [n.id for n in nodes if n.final]
    if len(finals) != 1:
        found = f" ({', '.join(finals)})" if finals else ""
        raise GraphError("final_output", finals,
                         f"exactly one node must be the final output, found {len(finals)}{found}")


def _check_node_types(nodes, node_kinds: Mapping[str, str]) -> None:
    unknown = [n for n in nodes if n.type not in node_kinds]
    if not unknown:
        return
    hints = sorted({n.plugin_hint for n in unknown if n.plugin_hint})
    hint = ""
    if hints:
        hint = (f"; install the plugin(s) that provide them ({', '.join(hints)}), or check `omni plugins` and "
                f"OMNI_PLUGINS if installed")
    names = ", ".join(f"{n.id} ({n.type!r})" for n in unknown)
    raise GraphError("unknown_node_type", [n.id for n in unknown], f"unregistered node type(s): {names}{hint}")


def _check_connector(edge, kinds: Mapping[str, str], connectors: Mapping[str, Any]) -> None:
    connector = connectors.get(edge.connector)
    if connector is None:
        raise GraphError("unknown_connector", [edge.source, edge.target],
                         f"edge {edge.source} -> {edge.target} uses unregistered connector {edge.connector!r}")
    joins = (kinds[edge.source], kinds[edge.target])
    if (connector.source_kind, connector.target_kind) != joins:
        raise GraphError("connector_kind_mismatch", [edge.source, edge.target],
                         f"connector {edge.connector!r} joins {connector.source_kind} -> {connector.target_kind}, "
                         f"but edge {edge.source} -> {edge.target} joins {joins[0]} -> {joins[1]}")


def _kahn(ids, edges) -> list[str]:
    """Kahn's algorithm; on a cycle it stops early and returns the nodes it could order."""
    indegree = {i: 0 for i in ids}
    for e in edges:
        indegree[e.target] += 1
    ready = [i for i in ids if indegree[i] == 0]
    order = []
    while ready:
        node = ready.pop(0)
        order.append(node)
        for e in edges:
            if e.source == node:
                indegree[e.target] -= 1
                if indegree[e.target] == 0:
                    ready.append(e.target)
    return order


def _cycle_nodes(ids, edges) -> set[str]:
    # Kahn leaves the cycles and every node after them; Kahn on the reversed edges peels off the latter.
    stuck = set(ids) - set(_kahn(ids, edges))
    reversed_inner = [EdgeSpec(e.target, e.source, e.connector) for e in edges if {e.source, e.target} <= stuck]
    return stuck - set(_kahn(sorted(stuck), reversed_inner))


@attrs.define
class StageGraph:
    """A validated plan with its stages and connectors materialized."""

    plan: PipelinePlan
    stages: dict[str, Any]
    connectors: dict[tuple[str, str], Any]
    order: list[str]
    node_types: dict[str, Any] = attrs.Factory(dict)
    # What the placements of its placed stages returned (each with close() and watch(timeout)); none for inproc.
    placed: list = attrs.Factory(list)
    # node id -> the values its request options take in this build, where its model decides them (NodeType.choices)
    choices: dict[str, Mapping[str, tuple[str, ...]]] = attrs.Factory(dict)

    def close(self) -> None:
        """Stop the graph's placed stages (a no-op for in-process stages); the graph takes no requests after."""
        for handle in self.placed:
            handle.close()

    def watch(self, timeout: float = 0.0) -> None:
        """With nothing to step: let the placements look at their stages (blocking up to `timeout`), so one that
        died while idle is noticed, and replaced, before the next request instead of at it."""
        for handle in self.placed:
            handle.watch(timeout)
            timeout = 0

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def final(self) -> str:
        return next(n.id for n in self.plan.nodes if n.final)

    def parent(self, node_id: str) -> str | None:
        return next((e.source for e in self.plan.edges if e.target == node_id), None)

    def children(self, node_id: str) -> list[str]:
        return [e.target for e in self.plan.edges if e.source == node_id]

    def entries(self) -> list[str]:
        return [n for n in self.order if self.parent(n) is None]
