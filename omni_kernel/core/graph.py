"""Pipeline plans and the StageGraph rules (docs/architecture.md, "Graph rules")."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
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
    # The node's request parameters from the request's, `params(values, request) -> values` (default: all it
    # declares, as given): where nodes of one plan declare one name for different things (omni_bridge's narrated
    # pipelines: `output` is the mux's file; the Wan node writes its video beside it, the voice writes none).
    params: Callable[..., Mapping[str, Any]] | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class EdgeSpec:
    """An edge: its connector turns the source's output into the target's input. `stream`: the target gets the
    source's output in chunks as they are produced (the connector cuts them) and starts before the source finishes.
    `input`: which of the target's joined inputs the edge fills, where the target's node type joins (`Join`)."""

    source: str
    target: str
    connector: str
    stream: bool = attrs.field(default=False, kw_only=True)
    input: str | None = attrs.field(default=None, kw_only=True)


@attrs.frozen
class Join:
    """What a node type joins: the named inputs it waits for (one input edge each, `EdgeSpec.input`) and how, one
    merge step, `merge(inputs, request)`: the node's one StageInput from every input's (by name, each converted by
    its edge's connector) and the Request. A join never streams in and is never an entry node."""

    inputs: tuple[str, ...] = attrs.field(converter=tuple)
    merge: Callable[..., Any] = attrs.field(eq=False, repr=False)
    # `release(inputs, request)`: the inputs there so far of a request that failed or was aborted before the merge
    # (e.g. a file one of them names is removed)
    release: Callable[..., None] | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class PipelinePlan:
    """A static pipeline: nodes, edges and which nodes' outputs are the request's outputs (its final nodes)."""

    name: str
    nodes: tuple[NodeSpec, ...] = attrs.field(converter=tuple)
    edges: tuple[EdgeSpec, ...] = attrs.field(default=(), converter=tuple)
    description: str = ""

    def node(self, node_id: str) -> NodeSpec:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(f"pipeline {self.name!r} has no node {node_id!r}")


RULES = ("duplicate_node", "unknown_edge_node", "self_loop", "cycle", "multiple_inputs", "join_input", "unreachable",
         "no_entry", "final_output", "unknown_node_type", "unknown_connector", "connector_kind_mismatch",
         "stream_edge", "contract", "node_policy")  # the last two are checked against the registry (planner)


def validate_plan(plan: PipelinePlan, node_kinds: Mapping[str, str], connectors: Mapping[str, Any],
                  joins: Mapping[str, Collection[str]] | None = None,
                  stream_inputs: Collection[str] = ()) -> list[str]:
    """Check every rule; raise one GraphError naming the first broken rule and its nodes.

    node_kinds maps a registered node type to its kind; connectors maps a connector name to an object with
    `source_kind` and `target_kind` (and `splitter`, where it can stream); joins maps a node type that joins to
    the inputs it declares; stream_inputs names the node types whose stages take a streamed input. Returns the
    node ids in topological order.
    """
    ids = [n.id for n in plan.nodes]
    _check_unique(ids)
    _check_edges(plan.edges, set(ids))
    order = _kahn(ids, plan.edges)
    if len(order) != len(ids):
        stuck = sorted(_cycle_nodes(ids, plan.edges))
        raise GraphError("cycle", stuck, f"the graph has a cycle through {', '.join(stuck)}")
    declared = {n.id: tuple(joins.get(n.type, ())) if joins else () for n in plan.nodes}
    _check_inputs(ids, plan.edges, declared)
    _check_final(plan.nodes)
    _check_node_types(plan.nodes, node_kinds)
    kinds = {n.id: node_kinds[n.type] for n in plan.nodes}
    for e in plan.edges:
        _check_connector(e, kinds, connectors)
    types = {n.id: n.type for n in plan.nodes}
    for e in plan.edges:
        _check_stream(e, connectors[e.connector], types, declared, stream_inputs)
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


def _check_inputs(ids: list[str], edges, declared: Mapping[str, tuple[str, ...]]) -> None:
    """A node takes one input edge, or, where its node type joins, one edge for each input it declares."""
    inputs = Counter(e.target for e in edges)
    many = sorted(n for n, k in inputs.items() if k > 1 and not declared[n])
    if many:
        raise GraphError("multiple_inputs", many, f"a node takes at most one input edge unless its node type joins "
                                                  f"several: {', '.join(many)}")
    for e in edges:
        _check_join_input(e, declared[e.target])
    for node_id in ids:
        _check_join_fed(node_id, edges, declared[node_id])
    # With no cycles, each node an entry or fed by one edge, and every join fed by all its inputs, every node runs.
    if all(i in inputs for i in ids):
        raise GraphError("no_entry", [], "the graph has no entry node")


def _check_join_input(edge, declared: tuple[str, ...]) -> None:
    if not declared and edge.input is not None:
        raise GraphError("join_input", [edge.target], f"edge {edge.source} -> {edge.target} fills input "
                         f"{edge.input!r}, but node {edge.target}'s type joins no inputs")
    if declared and edge.input not in declared:
        raise GraphError("join_input", [edge.target], f"edge {edge.source} -> {edge.target} fills input "
                         f"{edge.input!r}; node {edge.target}'s type joins {', '.join(declared)}")


def _check_join_fed(node_id: str, edges, declared: tuple[str, ...]) -> None:
    if not declared:
        return
    into = [e for e in edges if e.target == node_id]
    filled = Counter(e.input for e in into)
    twice = sorted(name for name, k in filled.items() if k > 1)
    if twice:
        raise GraphError("join_input", [node_id], f"node {node_id} joins input {twice[0]!r} from more than one edge")
    sources = Counter(e.source for e in into)
    again = sorted(source for source, k in sources.items() if k > 1)
    if again:
        raise GraphError("join_input", [node_id], f"node {node_id} joins two inputs from one node, {again[0]}")
    unfed = [name for name in declared if name not in filled]
    if unfed:
        raise GraphError("unreachable", [node_id], f"node {node_id} joins {', '.join(declared)} and would wait for "
                         f"ever: no edge fills {', '.join(unfed)}")


def _check_final(nodes) -> None:
    if not any(n.final for n in nodes):
        raise GraphError("final_output", [], "at least one node must be a final output (NodeSpec.final)")


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


def _check_stream(edge, connector, types: Mapping[str, str], declared: Mapping[str, tuple[str, ...]],
                  stream_inputs: Collection[str]) -> None:
    """A streaming edge has a connector that cuts chunks, into a node whose type takes them and does not join."""
    if not edge.stream:
        return
    ends = [edge.source, edge.target]
    if not callable(getattr(connector, "splitter", None)):
        raise GraphError("stream_edge", ends, f"edge {edge.source} -> {edge.target} streams, but connector "
                         f"{edge.connector!r} cannot cut a stream into chunks (it has no splitter)")
    if declared[edge.target]:
        raise GraphError("stream_edge", ends, f"edge {edge.source} -> {edge.target} streams into a join; a join "
                         "waits for its inputs whole")
    if types[edge.target] not in stream_inputs:
        raise GraphError("stream_edge", ends, f"edge {edge.source} -> {edge.target} streams, but node type "
                         f"{types[edge.target]!r} of {edge.target} takes no streamed input")


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
        """The first of the pipeline's outputs (the one output of a pipeline that names one)."""
        return self.finals[0]

    @property
    def finals(self) -> list[str]:
        """The nodes whose outputs are the request's outputs, in plan order."""
        return [n.id for n in self.plan.nodes if n.final]

    def parent(self, node_id: str) -> str | None:
        return next((e.source for e in self.plan.edges if e.target == node_id), None)

    def children(self, node_id: str) -> list[str]:
        return [e.target for e in self.plan.edges if e.source == node_id]

    def edges_from(self, node_id: str) -> list[EdgeSpec]:
        return [e for e in self.plan.edges if e.source == node_id]

    def entries(self) -> list[str]:
        return [n for n in self.order if self.parent(n) is None]
