"""What plugins register: node types, connectors, pipelines and CLI commands, each with its claimant."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from omni_kernel.core.errors import DuplicateRegistration
from omni_kernel.core.graph import PipelinePlan


@attrs.frozen
class NodeType:
    """A stage type. `factory(node, config)` builds the Stage for one graph node.

    `config` and `params` are attrs classes of `params.option` fields: the model-level settings the factory
    receives (as one instance) and the request parameters each StageInput carries. `inputs` names the request
    inputs the node reads besides the prompt (e.g. "image"). An undeclared key is refused everywhere.
    `output_contract` names what its StageOutput holds for a connector that declares a `source_contract`.
    `share_key(node, config)`, where given: nodes with equal keys share one engine (the factory shares it), so a
    worker placement hosts their stages in one worker.
    """

    name: str
    kind: str
    factory: Callable[..., Any]
    config: type | None = None
    params: type | None = None
    inputs: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    description: str = ""
    output_contract: str | None = None
    share_key: Callable[..., Any] | None = None


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

    def node_kinds(self) -> Mapping[str, str]:
        return {name: r.item.kind for name, r in self.node_types.items()}

    def connector_items(self) -> Mapping[str, Any]:
        return {name: r.item for name, r in self.connectors.items()}

    def by_plugin(self, plugin: str) -> dict[str, list[str]]:
        tables = {"node types": self.node_types, "connectors": self.connectors, "pipelines": self.pipelines,
                  "commands": self.commands, "placements": self.placements}
        found = {what: sorted(n for n, r in table.items() if r.plugin == plugin) for what, table in tables.items()}
        return found if found["placements"] else {k: v for k, v in found.items() if k != "placements"}

    def node_types_of(self, plan: PipelinePlan) -> dict[str, NodeType]:
        """Node id -> NodeType for the plan's registered node types."""
        return {n.id: self.node_types[n.type].item for n in plan.nodes if n.type in self.node_types}
