"""What plugins register: node types, connectors, pipelines, CLI commands, placements and fetchable models, each
with its claimant."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import attrs

from omni_kernel.core.errors import DuplicateRegistration, PluginError
from omni_kernel.core.graph import Join, PipelinePlan
from omni_kernel.core.models import FetchableModel

OLD_FORM = ("NodeType(factory=...) is the old form: a node type now gives engine_settings=, engine= and stage= "
            "(the kernel builds and shares the engines; docs/plugins.md, \"Node types\")")


def _refuse_old_form(instance, attribute, value) -> None:
    if value is not None:
        raise PluginError(f"node type {instance.name!r}: {OLD_FORM}")


@attrs.frozen
class NodeType:
    """A stage type: what the kernel needs to build an engine, and a stage on an engine, for one graph node.

    - `engine_settings(node, config, policy)`: everything the node's engine depends on (the model's resolved path,
      dtype, device, engine limits) as one hashable value, computed without loading anything. It is where
      settings invalid for the checkpoint are refused (a UserError), before any model loads or worker starts.
    - `engine(settings)`: builds (loads) the Engine for those settings.
    - `stage(node, config, policy, settings, engine)`: the node's Stage over `engine`, given the engine settings
      the kernel computed for it (one `engine_settings` call per node and build).

    Nodes whose types have the same `engine` factory and equal settings share one engine per plugin host, in any
    pipeline (`share_key`): one batch, one KV pool, one copy of the weights. `config`, `params` and `policy` are
    attrs classes of `params.option` fields: the model-level settings, the request parameters each StageInput
    carries, and the node policy a pipeline plan sets (`NodeSpec.policy`, validated when the plan is built). An
    undeclared key is refused everywhere. `inputs` names the request inputs the node may read besides the prompt
    ("image", "audio"; params.REQUEST_INPUTS): a request that gives one no node reads is refused, and `omni run`
    needs no `--prompt` where a node reads an input the run gives (a speech-to-text node reads its audio; its
    prompt is then ""; a node that reads the prompt refuses "" in its check, params.check_prompt).
    `check(node, config, policy, settings, item)`, where given, refuses a request's inputs and parameters before
    any model loads (the part of input processing that needs no model: the same checks the stage's input processor
    runs first when the request is processed). `choices(node, config, policy, settings)`, where given, names the
    values a request option takes in this build where its model decides them (option name -> values, the default
    first; a voice model's voices), kept on the built graph (StageGraph.choices) for what shows them (omni serve's
    /v1/audio/voices); the node's check still refuses any other. `output_contract` names what its StageOutput
    holds for a connector that declares a `source_contract` (or the node's policy does, where its class declares an
    `output_contract` and the plan sets it: planner.output_contract). `join` (graph.Join), where given, declares the
    named inputs the node waits for and the merge step that makes its one input of them (docs/architecture.md,
    "Joins"); `stream_input` says its stage takes a streamed input (`Stage.append`: its input processor's `extend`,
    its scheduler's `extend`), so a streaming edge may end at it.
    """

    name: str
    kind: str
    # The old form's third positional argument: refused, naming the new form.
    factory: Any = attrs.field(default=None, validator=_refuse_old_form, repr=False)
    engine_settings: Callable[..., Hashable] = attrs.field(default=None, kw_only=True)
    engine: Callable[..., Any] = attrs.field(default=None, kw_only=True)
    stage: Callable[..., Any] = attrs.field(default=None, kw_only=True)
    config: type | None = attrs.field(default=None, kw_only=True)
    params: type | None = attrs.field(default=None, kw_only=True)
    policy: type | None = attrs.field(default=None, kw_only=True)
    inputs: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset, kw_only=True)
    check: Callable[..., None] | None = attrs.field(default=None, kw_only=True)
    choices: Callable[..., Mapping[str, tuple[str, ...]]] | None = attrs.field(default=None, kw_only=True)
    description: str = attrs.field(default="", kw_only=True)
    output_contract: str | None = attrs.field(default=None, kw_only=True)
    join: Join | None = attrs.field(default=None, kw_only=True)
    stream_input: bool = attrs.field(default=False, kw_only=True)
    share_key: Any = attrs.field(default=None, kw_only=True, validator=_refuse_old_form, repr=False)

    def __attrs_post_init__(self) -> None:
        missing = [name for name in ("engine_settings", "engine", "stage") if getattr(self, name) is None]
        if missing:
            raise PluginError(f"node type {self.name!r} gives no {', '.join(missing)}: a node type gives "
                              "engine_settings=, engine= and stage= (docs/plugins.md, \"Node types\")")


def share_key(node_type: NodeType, node, config: Any, policy: Any) -> tuple:
    """The one place sharing is decided: nodes with equal keys share one engine (in this process, and in one
    worker of a worker placement)."""
    return (node_type.engine, node_type.engine_settings(node, config, policy))


@attrs.frozen
class Registered:
    item: Any
    plugin: str


@attrs.define
class Registry:
    node_types: dict[str, Registered] = attrs.Factory(dict)
    connectors: dict[str, Registered] = attrs.Factory(dict)
    pipelines: dict[str, Registered] = attrs.Factory(dict)
    commands: dict[str, Registered] = attrs.Factory(dict)
    placements: dict[str, Registered] = attrs.Factory(dict)
    models: dict[str, Registered] = attrs.Factory(dict)

    def copy(self) -> Registry:
        return Registry(*(dict(getattr(self, f.name)) for f in attrs.fields(Registry)))

    def _add(self, table: dict[str, Registered], what: str, name: str, item: Any, plugin: str) -> None:
        if name in table:
            raise DuplicateRegistration(
                f"{what} {name!r} is registered by both {table[name].plugin!r} and {plugin!r}")
        table[name] = Registered(item, plugin)

    def add_node_type(self, node_type: NodeType, plugin: str) -> None:
        self._add(self.node_types, "node type", node_type.name, node_type, plugin)

    def add_connector(self, connector: Any, plugin: str) -> None:
        self._add(self.connectors, "connector", connector.name, connector, plugin)

    def add_pipeline(self, plan: PipelinePlan, plugin: str) -> None:
        self._add(self.pipelines, "pipeline", plan.name, plan, plugin)

    def add_command(self, command: Any, plugin: str) -> None:
        self._add(self.commands, "command", command.name, command, plugin)

    def add_placement(self, placement: Any, plugin: str) -> None:
        self._add(self.placements, "placement", placement.name, placement, plugin)

    def add_model(self, model: FetchableModel, plugin: str) -> None:
        if not isinstance(model, FetchableModel):
            raise PluginError(f"plugin {plugin!r} registers {model!r} as a model; omni_register_models takes a "
                              "FetchableModel (omni_kernel.core.models)")
        self._add(self.models, "model", model.name, model, plugin)

    def node_kinds(self) -> Mapping[str, str]:
        return {name: r.item.kind for name, r in self.node_types.items()}

    def node_joins(self) -> Mapping[str, tuple[str, ...]]:
        """Each node type that joins -> the inputs it declares."""
        return {name: r.item.join.inputs for name, r in self.node_types.items() if r.item.join is not None}

    def stream_inputs(self) -> set[str]:
        """The node types whose stages take a streamed input."""
        return {name for name, r in self.node_types.items() if r.item.stream_input}

    def connector_items(self) -> Mapping[str, Any]:
        return {name: r.item for name, r in self.connectors.items()}

    def by_plugin(self, plugin: str) -> dict[str, list[str]]:
        tables = {"node types": self.node_types, "connectors": self.connectors, "pipelines": self.pipelines,
                  "commands": self.commands, "placements": self.placements, "models": self.models}
        found = {what: sorted(n for n, r in table.items() if r.plugin == plugin) for what, table in tables.items()}
        return {k: v for k, v in found.items() if v or k not in ("placements", "models")}  # those two where any

    def node_types_of(self, plan: PipelinePlan) -> dict[str, NodeType]:
        """Node id -> NodeType for the plan's registered node types."""
        return {n.id: self.node_types[n.type].item for n in plan.nodes if n.type in self.node_types}
