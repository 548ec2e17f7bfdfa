"""Run settings: where each stage runs (`placement`), and the settings each placement declares for itself.

The kernel builds `inproc` stages itself. Any other placement is registered by a plugin
(`omni_register_placements`) as an object with a `name`, a `settings` class (attrs fields made with
`params.option`, or None), `check(settings, plan, placement_of)` (refuse settings that do not fit the plan, before
anything is built) and `build(nodes, settings, host_factory, handle, fail_fast)`. The kernel knows none of those
settings: it takes their keys out of a run's keyword arguments by what the placements declare, builds flags from
them, and hands each placement its own instance (docs/plugins.md, "Placements").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from omni_kernel.core.errors import InvalidParameter, PluginError, UserError
from omni_kernel.core.params import make, options_of

INPROC = "inproc"


@attrs.frozen
class RunSettings:
    """Kernel-level settings of one run (not a node type's config).

    `placement`: None (each node's plan placement, else inproc), one placement for every node, or per node
    ("video=process,bridge=inproc" or a mapping); a per-node entry wins over the run-wide one, which wins over the
    plan's `NodeSpec.placement`. `placed`: each registered placement's settings instance, by placement name.
    `fail_fast`: a call to a placed stage that cannot take requests now (its worker restarts) raises
    StageUnavailable at once instead of waiting; a server whose one loop serves every pipeline sets it. Each
    placement is built with it (`build(..., fail_fast=)`).
    """

    placement: Any = None
    placed: Mapping[str, Any] = attrs.field(factory=dict)
    fail_fast: bool = False

    @classmethod
    def pop(cls, config: dict[str, Any], placements: Mapping[str, Any] | None = None) -> RunSettings:
        """Take the run settings out of a config mapping (what `Omni(pipeline, **config)` receives): `placement`,
        `fail_fast` and every key a registered placement declares. Keys no placement declares stay in `config`."""
        placement = config.pop("placement", None)
        fail_fast = bool(config.pop("fail_fast", False))
        placements = placements or {}
        keys = {name for p in placements.values() for name in options_of(settings_class(p))}
        given = {k: config.pop(k) for k in list(config) if k in keys}
        given = {k: v for k, v in given.items() if v is not None}
        placed = {}
        for name, p in placements.items():
            settings_cls = settings_class(p)
            if settings_cls is not None:
                placed[name] = make(settings_cls, {k: v for k, v in given.items() if k in options_of(settings_cls)})
        settings = cls(placement, placed, fail_fast)
        settings.check()
        return settings

    def check(self) -> None:
        parse_placement(self.placement)

    def complete(self, placements: Mapping[str, Any]) -> RunSettings:
        """These settings with each registered placement's defaults where none were given."""
        placed = dict(self.placed)
        for name, p in placements.items():
            settings_cls = settings_class(p)
            if settings_cls is not None and name not in placed:
                placed[name] = make(settings_cls, {})
        return attrs.evolve(self, placed=placed)

    def placement_of(self, node) -> str:
        run_wide, nodes = parse_placement(self.placement)
        return nodes.get(node.id) or run_wide or node.placement or INPROC

    def settings_of(self, placement: str) -> Any:
        """The settings instance of a placement (None when it declares none)."""
        return self.placed.get(placement)


def settings_class(placement: Any) -> type | None:
    """The settings class a registered placement declares (None: it declares none)."""
    return getattr(placement, "settings", None)


def parse_placement(value: Any) -> tuple[str | None, dict[str, str]]:
    """(run-wide placement, {node id: placement}) of a placement setting: "process", "video=process,bridge=inproc",
    "process,video=ray", or a mapping of node id to placement. Names are checked against the registered
    placements when the graph is built (`check_placements`)."""
    return per_node("placement", value, "NAME", _placement_name, "a placement name")


def _placement_name(text: str) -> str | None:
    return text if text.replace("_", "").isalnum() else None


def per_node(name: str, value: Any, what: str, convert: Callable[[str], Any], expected: str) -> tuple[Any, dict]:
    """A run setting given run-wide, per node (NODE=VALUE pairs, comma-separated) or as a mapping of node id to
    value; `convert` turns a value's text into the setting, or None where it is not `expected`. For placements'
    own per-node settings too (e.g. a replica count per node)."""
    if value is None or value == "":
        return None, {}
    if isinstance(value, Mapping):
        items = [(str(k), str(v)) for k, v in value.items()]
    elif isinstance(value, (str, int)) and not isinstance(value, bool):
        items = [_pair(part) for part in str(value).split(",") if part.strip()]
    else:
        raise InvalidParameter(name, f"{value!r} is not {expected} or NODE={what} pairs")
    nodes: dict[str, Any] = {}
    for key, text in items:
        converted = convert(text)
        if converted is None:
            raise InvalidParameter(name, f"{text!r} is not {expected}")
        nodes[key] = converted
    run_wide = nodes.pop("", None)
    return run_wide, nodes


def _pair(part: str) -> tuple[str, str]:
    key, sep, value = part.partition("=")
    if not sep:
        return "", key.strip()
    return key.strip(), value.strip()


def check_node_ids(name: str, nodes: Mapping[str, Any], plan) -> None:
    """Per-node entries of the setting `name` name nodes of the plan."""
    ids = [n.id for n in plan.nodes]
    unknown = sorted(set(nodes) - set(ids))
    if unknown:
        raise InvalidParameter(name, f"pipeline {plan.name!r} has no node {unknown[0]!r}; its nodes: {', '.join(ids)}")


def check_placements(settings: RunSettings, plan, placements: Mapping[str, Any]) -> None:
    """Every placement the plan's nodes use is inproc or registered; each registered placement accepts its own
    settings for this plan (its `check`), before any stage is built."""
    _, nodes = parse_placement(settings.placement)
    check_node_ids("placement", nodes, plan)
    known = [INPROC, *sorted(placements)]
    for node in plan.nodes:
        if node.placement is not None and node.placement not in known:
            raise PluginError(f"node {node.id!r} of pipeline {plan.name!r} has placement {node.placement!r}; "
                              f"installed placements: {', '.join(known)}")
    for used in sorted({settings.placement_of(n) for n in plan.nodes} - set(known)):
        raise UserError(f"placement {used!r} is not installed; installed placements: {', '.join(known)} "
                        "(`omni plugins` lists the plugins, and what each registers)")
    for name, placement in sorted(placements.items()):
        placement.check(settings.settings_of(name), plan, settings.placement_of)
