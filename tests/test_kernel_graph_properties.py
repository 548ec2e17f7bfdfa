"""Graph validation against an independent oracle, and the StageScheduler on every valid graph: DAGs whose nodes
take one input edge or, where their node type joins, one edge per declared input; streaming edges; one or several
final nodes."""

from __future__ import annotations

import ast
import inspect

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_kernel.api import Omni
from omni_kernel.core.errors import GraphError, UserError
from omni_kernel.core.graph import RULES, EdgeSpec, NodeSpec, PipelinePlan, validate_plan
from omni_kernel.core.request import Request
from omni_kernel.events import RequestFailed, RequestFinished, TokenDelta
from omni_kernel.plugins import PluginHost

from kernel_fakes import StreamTagConnector, TagConnector, registry_with, stage_text

IDS = "abcdefg"
NODE_KINDS = {"t.ar": "ar", "t.diff": "diffusion", "t.text": "text", "t.join": "join"}
TYPE_OF_KIND = {kind: name for name, kind in NODE_KINDS.items()}
JOINS = {"t.join": ("left", "right")}  # the node type that joins, and the inputs it declares
INPUT_NAMES = ("left", "right", "other")  # "other" is declared by none
STREAM_INPUTS = {"t.text"}  # the node type that takes a streamed input
CONNECTORS = {c.name: c for c in (TagConnector("ar_to_diff", "ar", "diffusion"), TagConnector("ar_to_ar", "ar", "ar"),
                                  TagConnector("diff_to_text", "diffusion", "text"),
                                  TagConnector("text_to_ar", "text", "ar"), TagConnector("ar_to_join", "ar", "join"),
                                  TagConnector("diff_to_join", "diffusion", "join"),
                                  TagConnector("join_to_text", "join", "text"),
                                  StreamTagConnector("ar_streams_text", "ar", "text"))}
STREAMING = {name for name, c in CONNECTORS.items() if hasattr(c, "splitter")}
FAST = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- plans -------------------------------------------------------------------------------------------------

@st.composite
def random_plans(draw):
    """Anything: duplicate ids, dangling edges, cycles, unregistered types and connectors, any final flags."""
    n = draw(st.integers(0, 6))
    ids = draw(st.lists(st.sampled_from(IDS[:6]), min_size=n, max_size=n, unique=draw(st.booleans())))
    types = st.sampled_from([*NODE_KINDS, *NODE_KINDS, "t.missing"])
    nodes = [NodeSpec(i, draw(types), final=draw(st.booleans())) for i in ids]
    ends = st.sampled_from([*ids, *ids, *ids, "zz"]) if ids else st.just("zz")
    connectors = st.sampled_from([*CONNECTORS, "c.missing"])
    inputs = st.sampled_from([None, None, *INPUT_NAMES])
    edges = draw(st.lists(st.builds(EdgeSpec, ends, ends, connectors, stream=st.booleans(), input=inputs),
                          max_size=7))
    return PipelinePlan("p", nodes, edges)


def into(kind: str) -> list[str]:
    return sorted(c.name for c in CONNECTORS.values() if c.target_kind == kind)


@st.composite
def valid_plans(draw, streams: bool = True):
    """A DAG whose edges use connectors that fit: each node an entry (never a join), fed by one earlier node, or a
    join fed by two; some edges into a node that takes streams stream; one or several final nodes."""
    n = draw(st.integers(1, 6))
    ids = draw(st.permutations(IDS))[:n]
    entry_kinds = sorted(k for k in TYPE_OF_KIND if k != "join")
    kinds, edges = [draw(st.sampled_from(entry_kinds))], []
    for i in range(1, n):
        feeds_join = [j for j in range(i) if f"{kinds[j]}_to_join".replace("diffusion", "diff") in CONNECTORS]
        shape = draw(st.sampled_from(["entry", "one", "join"] if len(feeds_join) >= 2 else ["entry", "one"]))
        if shape == "entry":
            kinds.append(draw(st.sampled_from(entry_kinds)))
        elif shape == "join":
            left, right = draw(st.lists(st.sampled_from(feeds_join), min_size=2, max_size=2, unique=True))
            kinds.append("join")
            for parent, name in ((left, "left"), (right, "right")):
                connector = next(c for c in into("join") if CONNECTORS[c].source_kind == kinds[parent])
                edges.append(EdgeSpec(ids[parent], ids[i], connector, input=name))
        else:
            parent = draw(st.integers(0, i - 1))
            connector = draw(st.sampled_from(sorted(c.name for c in CONNECTORS.values()
                                                    if c.source_kind == kinds[parent] and c.target_kind != "join")))
            kinds.append(CONNECTORS[connector].target_kind)
            stream = streams and connector in STREAMING and draw(st.booleans())
            edges.append(EdgeSpec(ids[parent], ids[i], connector, stream=stream))
    finals = draw(st.sets(st.integers(0, n - 1), min_size=1))
    nodes = [NodeSpec(ids[i], TYPE_OF_KIND[kinds[i]], final=i in finals) for i in range(n)]
    return PipelinePlan("p", draw(st.permutations(nodes)), draw(st.permutations(edges)))


@st.composite
def mutated_plans(draw):
    """A valid plan with one random change, so that near-valid graphs are common."""
    plan = draw(valid_plans())
    nodes, edges = list(plan.nodes), list(plan.edges)
    ids = [n.id for n in nodes]
    kind = {n.id: NODE_KINDS[n.type] for n in nodes}

    def fitting(source, target):  # prefer a connector that fits, so the change is the only broken rule
        fits = [c.name for c in CONNECTORS.values() if (c.source_kind, c.target_kind) == (kind[source], kind[target])]
        return draw(st.sampled_from(fits or list(CONNECTORS)))

    change = draw(st.sampled_from(["edge", "cycle", "fan_in", "final", "type", "connector", "duplicate",
                                   "drop_node", "join_cycle", "join_input", "drop_join_input", "stream"]))
    if change in ("edge", "cycle", "fan_in", "connector"):
        mutate_edges(draw, change, ids, edges, fitting)
    elif change in ("join_cycle", "join_input", "drop_join_input", "stream"):
        mutate_joins(draw, change, edges, fitting)
    else:
        mutate_nodes(draw, change, ids, nodes)
    return PipelinePlan("p", nodes, edges)


def descendants(node: str, edges: list) -> set:
    found, frontier = set(), [node]
    while frontier:
        current = frontier.pop()
        for e in edges:
            if e.source == current and e.target not in found:
                found.add(e.target)
                frontier.append(e.target)
    return found


def mutate_joins(draw, change: str, edges: list, fitting) -> None:
    """A cycle through a join (its right input fed from below it), an input it does not declare, an input no
    longer fed, or an edge's streaming turned over."""
    joined = [i for i, e in enumerate(edges) if e.input is not None]
    if change == "stream" and edges:
        i = draw(st.integers(0, len(edges) - 1))
        edges[i] = attrs.evolve(edges[i], stream=not edges[i].stream)
    elif change == "join_input" and edges:
        i = draw(st.integers(0, len(edges) - 1))
        edges[i] = attrs.evolve(edges[i], input=draw(st.sampled_from([n for n in (None, *INPUT_NAMES)
                                                                       if n != edges[i].input])))
    elif change == "drop_join_input" and joined:
        edges.pop(draw(st.sampled_from(joined)))
    elif change == "join_cycle" and joined:
        edge = edges[draw(st.sampled_from(joined))]
        below = sorted(descendants(edge.target, edges))
        if below:
            source = draw(st.sampled_from(below))
            edges[edges.index(edge)] = EdgeSpec(source, edge.target, fitting(source, edge.target), input=edge.input)


def mutate_edges(draw, change: str, ids: list, edges: list, fitting) -> None:
    if change == "edge":
        ends = st.sampled_from(ids + ids + ["zz"])
        edges.append(EdgeSpec(draw(ends), draw(ends), draw(st.sampled_from([*CONNECTORS, "c.missing"]))))
    elif change == "cycle" and edges:
        parent_of = {e.target: e.source for e in edges}
        child = top = draw(st.sampled_from(sorted(parent_of)))
        while top in parent_of:
            top = parent_of[top]
        edges.append(EdgeSpec(child, top, fitting(child, top)))
    elif change == "fan_in" and edges:
        target, source = draw(st.sampled_from([e.target for e in edges])), draw(st.sampled_from(ids))
        edges.append(EdgeSpec(source, target, fitting(source, target)))
    elif change == "connector" and edges:
        i = draw(st.integers(0, len(edges) - 1))
        edges[i] = EdgeSpec(edges[i].source, edges[i].target, draw(st.sampled_from([*CONNECTORS, "c.missing"])))


def mutate_nodes(draw, change: str, ids: list, nodes: list) -> None:
    if change == "final":
        i = draw(st.integers(0, len(nodes) - 1))
        nodes[i] = NodeSpec(nodes[i].id, nodes[i].type, final=not nodes[i].final)
    elif change == "type":
        i = draw(st.integers(0, len(nodes) - 1))
        nodes[i] = NodeSpec(nodes[i].id, draw(st.sampled_from([*NODE_KINDS, "t.missing"])), final=nodes[i].final)
    elif change == "duplicate":
        nodes.append(NodeSpec(draw(st.sampled_from(ids)), draw(st.sampled_from(list(NODE_KINDS)))))
    elif change == "drop_node" and len(nodes) > 1:
        nodes.pop(draw(st.integers(0, len(nodes) - 1)))


# ---- the oracle: each rule checked on its own, by different algorithms than graph.py -----------------------

def reach(start, successors) -> set:
    """Nodes reachable from `start` in one or more steps (recursive DFS)."""
    seen: set = set()

    def visit(node):
        for nxt in successors.get(node, ()):
            if nxt not in seen:
                seen.add(nxt)
                visit(nxt)

    for node in start:
        visit(node)
    return seen


def has_cycle(ids, successors) -> bool:
    """DFS colouring: a grey node met again is a back edge."""
    colour = dict.fromkeys(ids, "white")

    def visit(node) -> bool:
        colour[node] = "grey"
        for nxt in successors.get(node, ()):
            if colour[nxt] == "grey" or (colour[nxt] == "white" and visit(nxt)):
                return True
        colour[node] = "black"
        return False

    return any(colour[i] == "white" and visit(i) for i in ids)


def oracle(plan: PipelinePlan) -> dict[str, set]:
    """Every broken rule with the nodes it implicates."""
    unique = {n.id for n in plan.nodes}
    inner = [e for e in plan.edges if e.source in unique and e.target in unique]
    found = {**_node_rules(plan), **_edge_rules(plan, unique, inner), **_shape_rules(unique, inner),
             **_type_rules(plan, inner)}
    return {rule: nodes for rule, nodes in found.items() if nodes is not None}


def _node_rules(plan: PipelinePlan) -> dict[str, set | None]:
    ids = [n.id for n in plan.nodes]
    dups = {i for i in ids if ids.count(i) > 1}
    any_final = any(n.final for n in plan.nodes)
    return {"duplicate_node": dups or None, "final_output": None if any_final else set()}


def declared_inputs(plan: PipelinePlan) -> dict[str, tuple]:
    return {n.id: JOINS.get(n.type, ()) for n in plan.nodes}


def _edge_rules(plan: PipelinePlan, unique: set, inner: list) -> dict[str, set | None]:
    dangling = {x for e in plan.edges for x in (e.source, e.target) if x not in unique}
    loops = {e.source for e in inner if e.source == e.target}
    declared = declared_inputs(plan)
    fan_in = {t for t in unique if sum(e.target == t for e in inner) > 1 and not declared[t]}
    return {"unknown_edge_node": dangling or None, "self_loop": loops or None, "multiple_inputs": fan_in or None,
            **_join_rules(unique, inner, declared)}


def _join_rules(unique: set, inner: list, declared: dict) -> dict[str, set | None]:
    """An edge fills an input its target's type declares (none where it joins none), each once, from distinct
    nodes; a join with a declared input no edge fills never runs."""
    bad = {e.target for e in inner if (e.input is not None or declared[e.target])
           and e.input not in declared[e.target]}
    for t in (t for t in unique if declared[t]):
        feeding = [e for e in inner if e.target == t]
        names, sources = [e.input for e in feeding], [e.source for e in feeding]
        if len(set(names)) < len(names) or len(set(sources)) < len(sources):
            bad.add(t)
    unfed = {t for t in unique if not set(declared[t]) <= {e.input for e in inner if e.target == t}}
    return {"join_input": bad or None, "unreachable": unfed or None}


def _shape_rules(unique: set, inner: list) -> dict[str, set | None]:
    """Cycles, entries and reachability."""
    successors: dict[str, list] = {}
    for e in inner:
        successors.setdefault(e.source, []).append(e.target)
    found: dict[str, set | None] = {}
    if has_cycle(sorted(unique), successors):
        on_cycle = {i for i in unique if i in reach([i], successors)}
        found["cycle"] = on_cycle | reach(on_cycle, successors)  # the cycle and everything after it
        found["cycle_core"] = on_cycle
    entries = unique - {e.target for e in inner}
    found["no_entry"] = None if entries else set()
    lost = unique - entries - reach(entries, successors)
    found["lost"] = lost or None
    return found


def _type_rules(plan: PipelinePlan, inner: list) -> dict[str, set | None]:
    untyped = {n.id for n in plan.nodes if n.type not in NODE_KINDS}
    unknown_conn = {x for e in inner if e.connector not in CONNECTORS for x in (e.source, e.target)}
    kind = {n.id: NODE_KINDS.get(n.type) for n in plan.nodes}
    misfit = set()
    for e in inner:
        joins = (kind[e.source], kind[e.target])
        connector = CONNECTORS.get(e.connector)
        if connector is not None and None not in joins and (connector.source_kind, connector.target_kind) != joins:
            misfit |= {e.source, e.target}
    types = {n.id: n.type for n in plan.nodes}
    streams = {x for e in inner if e.stream and e.connector in CONNECTORS
               and (e.connector not in STREAMING or types[e.target] not in STREAM_INPUTS
                    or types[e.target] in JOINS) for x in (e.source, e.target)}
    return {"unknown_node_type": untyped or None, "unknown_connector": unknown_conn or None,
            "connector_kind_mismatch": misfit or None, "stream_edge": streams or None}


def check_rejection(error: GraphError, broken: dict[str, set], plan: PipelinePlan) -> None:
    assert error.rule in broken and error.rule in RULES, (error.rule, sorted(broken))
    assert error.rule in str(error)
    named = set(error.nodes)
    implicated = broken[error.rule]
    if error.rule == "cycle":
        assert broken["cycle_core"] <= named <= implicated
    elif error.rule in ("duplicate_node", "multiple_inputs", "final_output"):
        assert named == implicated
    else:
        assert named <= implicated and (named or not implicated)
    for node in named:
        assert node in str(error)


def validate(plan: PipelinePlan) -> list[str]:
    return validate_plan(plan, NODE_KINDS, CONNECTORS, JOINS, STREAM_INPUTS)


@FAST
@given(st.one_of(random_plans(), mutated_plans(), valid_plans()))
def test_validator_accepts_exactly_what_the_oracle_accepts(plan):
    broken = oracle(plan)
    if broken:
        with pytest.raises(GraphError) as info:
            validate(plan)
        check_rejection(info.value, broken, plan)
        return
    order = validate(plan)
    assert sorted(order) == sorted(n.id for n in plan.nodes)
    for e in plan.edges:
        assert order.index(e.source) < order.index(e.target)


@settings(max_examples=60, deadline=None)
@given(valid_plans())
def test_generated_valid_plans_are_valid(plan):
    assert oracle(plan) == {}


def oracle_rules() -> set[str]:
    """The names the oracle can report: every constant key of the dicts its rule helpers build."""
    names = set()
    for helper in (_node_rules, _edge_rules, _join_rules, _shape_rules, _type_rules):
        for node in ast.walk(ast.parse(inspect.getsource(helper))):
            if isinstance(node, ast.Dict):
                names |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.slice,
                                                                                                  ast.Constant):
                names.add(node.slice.value)
    return names


# Oracle keys graph.py never raises: `cycle_core` is what check_rejection expects a cycle error to name, and `lost`
# (a node no entry reaches) only ever comes with a cycle (a DAG's every node is reached from one of its sources).
ORACLE_ONLY = {"cycle_core", "lost"}
REGISTRY_RULES = {"contract", "node_policy"}  # checked by GraphBuilder.validate against the registry, not here


def test_the_oracle_and_graph_py_name_the_same_rules():
    """check_rejection compares rule names, so both sides must spell them alike."""
    assert set(RULES) - REGISTRY_RULES <= oracle_rules() and oracle_rules() - set(RULES) <= ORACLE_ONLY


RULE_EXAMPLES = [
    (PipelinePlan("p", [NodeSpec("a", "t.ar", final=True), NodeSpec("a", "t.ar")]), "duplicate_node", ("a",)),
    (PipelinePlan("p", [NodeSpec("a", "t.ar", final=True)], [EdgeSpec("a", "x", "ar_to_ar")]),
     "unknown_edge_node", ("x",)),
    (PipelinePlan("p", [NodeSpec("a", "t.ar", final=True)], [EdgeSpec("a", "a", "ar_to_ar")]), "self_loop", ("a",)),
    (PipelinePlan("p", [NodeSpec("a", "t.ar", final=True), NodeSpec("b", "t.ar")],
                  [EdgeSpec("a", "b", "ar_to_ar"), EdgeSpec("b", "a", "ar_to_ar")]), "cycle", ("a", "b")),
    (PipelinePlan("p", [NodeSpec("a", "t.ar"), NodeSpec("b", "t.ar"), NodeSpec("c", "t.ar", final=True)],
                  [EdgeSpec("a", "c", "ar_to_ar"), EdgeSpec("b", "c", "ar_to_ar")]), "multiple_inputs", ("c",)),
    (PipelinePlan("p", [NodeSpec("a", "t.ar"), NodeSpec("b", "t.ar"), NodeSpec("j", "t.join", final=True)],
                  [EdgeSpec("a", "j", "ar_to_join", input="left"), EdgeSpec("b", "j", "ar_to_join", input="centre")]),
     "join_input", ("j",)),
    (PipelinePlan("p", [NodeSpec("a", "t.ar"), NodeSpec("j", "t.join", final=True)],
                  [EdgeSpec("a", "j", "ar_to_join", input="left")]), "unreachable", ("j",)),
    (PipelinePlan("p", []), "no_entry", ()),
    (PipelinePlan("p", [NodeSpec("a", "t.ar"), NodeSpec("b", "t.ar")]), "final_output", ()),
    (PipelinePlan("p", [NodeSpec("a", "wan.i2v", final=True, plugin_hint="omni-wan")]), "unknown_node_type", ("a",)),
    (PipelinePlan("p", [NodeSpec("a", "t.ar"), NodeSpec("b", "t.ar", final=True)], [EdgeSpec("a", "b", "nope")]),
     "unknown_connector", ("a", "b")),
    (PipelinePlan("p", [NodeSpec("a", "t.ar"), NodeSpec("b", "t.text", final=True)],
                  [EdgeSpec("a", "b", "ar_to_diff")]), "connector_kind_mismatch", ("a", "b")),
    (PipelinePlan("p", [NodeSpec("a", "t.ar"), NodeSpec("b", "t.diff", final=True)],
                  [EdgeSpec("a", "b", "ar_to_diff", stream=True)]), "stream_edge", ("a", "b")),
]

# A cycle through a join: its right input comes from below it. And a join of an input its type does not declare,
# and one whose input no edge fills (it would wait for ever), each named with its rule and node.
JOIN_EXAMPLES = [
    (PipelinePlan("p", [NodeSpec("a", "t.ar"), NodeSpec("j", "t.join"), NodeSpec("t", "t.text"),
                        NodeSpec("b", "t.ar", final=True)],
                  [EdgeSpec("a", "j", "ar_to_join", input="left"), EdgeSpec("j", "t", "join_to_text"),
                   EdgeSpec("t", "b", "text_to_ar"), EdgeSpec("b", "j", "ar_to_join", input="right")]),
     "cycle", ("b", "j", "t")),
    (PipelinePlan("p", [NodeSpec("a", "t.ar"), NodeSpec("j", "t.join", final=True)],
                  [EdgeSpec("a", "j", "ar_to_join")]), "join_input", ("j",)),
    (PipelinePlan("p", [NodeSpec("a", "t.ar"), NodeSpec("b", "t.text", final=True)],
                  [EdgeSpec("a", "b", "ar_streams_text", input="left")]), "join_input", ("b",)),
    (PipelinePlan("p", [NodeSpec("a", "t.ar"), NodeSpec("j", "t.join", final=True)],
                  [EdgeSpec("a", "j", "ar_to_join", input="left"), EdgeSpec("a", "j", "ar_to_join", input="right")]),
     "join_input", ("j",)),
    (PipelinePlan("p", [NodeSpec("j", "t.join", final=True)]), "unreachable", ("j",)),
    (PipelinePlan("p", [NodeSpec("a", "t.ar"), NodeSpec("b", "t.ar"), NodeSpec("j", "t.join"),
                        NodeSpec("t", "t.text", final=True)],
                  [EdgeSpec("a", "j", "ar_to_join", input="left"), EdgeSpec("b", "j", "ar_to_join", input="right"),
                   EdgeSpec("j", "t", "join_to_text", stream=True)]), "stream_edge", ("j", "t")),
]


def test_every_rule_has_an_example():
    assert {rule for _, rule, _ in RULE_EXAMPLES} == set(RULES) - REGISTRY_RULES


@pytest.mark.parametrize("plan, rule, nodes", RULE_EXAMPLES + JOIN_EXAMPLES)
def test_each_rule_names_itself_and_its_nodes(plan, rule, nodes):
    assert rule in oracle(plan)
    with pytest.raises(GraphError) as info:
        validate(plan)
    assert (info.value.rule, tuple(info.value.nodes)) == (rule, nodes)
    assert isinstance(info.value, UserError)
    for node in nodes:
        assert node in str(info.value)


def test_a_join_several_outputs_and_a_stream_are_valid():
    plan = PipelinePlan("p", [NodeSpec("a", "t.ar", final=True), NodeSpec("b", "t.diff"), NodeSpec("j", "t.join"),
                              NodeSpec("s", "t.text", final=True), NodeSpec("t", "t.text", final=True)],
                        [EdgeSpec("a", "j", "ar_to_join", input="left"),
                         EdgeSpec("b", "j", "diff_to_join", input="right"),
                         EdgeSpec("a", "s", "ar_streams_text", stream=True), EdgeSpec("j", "t", "join_to_text")])
    assert oracle(plan) == {}
    order = validate(plan)
    assert order.index("j") > max(order.index("a"), order.index("b"))


def test_unknown_node_type_says_which_plugin_to_install():
    plan = PipelinePlan("p", [NodeSpec("wan", "diffusion.wan22_i2v", final=True, plugin_hint="omni-wan")])
    with pytest.raises(GraphError, match="install the plugin\\(s\\) that provide them \\(omni-wan\\)"):
        validate(plan)


# ---- the StageScheduler on valid graphs --------------------------------------------------------------------

def expected_text(plan: PipelinePlan, node_id: str, prompt: str) -> str:
    edges = [e for e in plan.edges if e.target == node_id]
    if not edges:
        return stage_text(node_id, prompt)
    inputs = {e.input: f"{e.connector}[{expected_text(plan, e.source, prompt)}]" for e in edges}
    if len(edges) == 1 and edges[0].input is None:
        return stage_text(node_id, inputs[None])
    return stage_text(node_id, "join[" + "|".join(f"{name}={inputs[name]}" for name in sorted(inputs)) + "]")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=valid_plans(streams=False), prompts=st.lists(st.text("xyé世 ", max_size=6), min_size=1, max_size=3),
       max_batch=st.sampled_from([1, 2, 8]))
def test_scheduler_runs_each_node_once_after_its_parent_through_the_edge_connector(plan, prompts, max_batch):
    """Each node runs once, after every node it takes input from (a join after all of its inputs, merged by its
    type's merge step); the request finishes with every final node's output."""
    log: list = []
    registry = registry_with(NODE_KINDS, CONNECTORS.values(), log, joins=JOINS, max_batch=max_batch)
    host = PluginHost()
    host.registry = registry
    scheduler = Omni(plan, host=host)
    graph = scheduler.graph
    requests = [Request("p", prompt, request_id=f"r{i}") for i, prompt in enumerate(prompts)]
    events = list(scheduler.run(requests))

    assert not [e for e in events if isinstance(e, RequestFailed)]
    finished = {e.request_id: e.result for e in events if isinstance(e, RequestFinished)}
    assert sorted(finished) == sorted(r.request_id for r in requests)
    assert [e.request_id for e in events if isinstance(e, RequestFinished)].count("r0") == 1
    for request in requests:
        rid, result = request.request_id, finished[request.request_id]
        assert result.output.node_id == graph.final
        assert list(result.final_outputs) == [n.id for n in plan.nodes if n.final] == list(result.finals)
        for node in plan.nodes:
            adds = [i for i, entry in enumerate(log) if entry == ("add", node.id, rid)]
            finishes = [i for i, entry in enumerate(log) if entry == ("finish", node.id, rid)]
            assert len(adds) == 1 and len(finishes) == 1, (node.id, rid, log)
            for parent in (e.source for e in plan.edges if e.target == node.id):
                assert log.index(("finish", parent, rid)) < adds[0]
            text = expected_text(plan, node.id, request.prompt)
            assert result.outputs[node.id].text == text
            assert "".join(e.text for e in events if isinstance(e, TokenDelta) and e.request_id == rid
                           and e.node_id == node.id) == text
        for edge in plan.edges:
            assert result.trace[f"connector.{edge.source}.{edge.connector}"] is True
    assert not scheduler.has_unfinished()
    assert all(not stage.engine.has_unfinished() and not stage.engine.runner.live
               for stage in graph.stages.values())
