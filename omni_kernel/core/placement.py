"""Run settings: where each stage runs (`placement`) and how its workers behave (docs/distributed.md).

The kernel builds `inproc` stages itself; any other placement is built by the plugin that registered it
(`omni_register_placements`; `process` and `ray` come with the omni-workers plugin).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from omni_kernel.core.errors import InvalidParameter, PluginError, UserError

PLACEMENTS = ("inproc", "process", "ray")
PROVIDERS = {"process": "omni-workers", "ray": "omni-workers"}  # for the "install X" message
RUN_KEYS = frozenset({"placement", "replicas", "max_restarts", "worker_threads", "ray_address"})


@attrs.frozen
class RunSettings:
    """Kernel-level settings of one run (not a node type's config): where each stage runs and how workers behave.

    `placement`: None (each node's plan placement, else inproc), one mode for every node, or per node
    ("video=process,bridge=inproc" or a mapping); a per-node entry wins over the run-wide mode, which wins over
    the plan's `NodeSpec.placement`. `max_restarts`: restarts of a worker that died. `worker_threads`: torch /
    OpenMP threads in each worker (None: the library default), or "shared": the worker processes of one front
    lend their cores to each other, so the only busy one uses all of them (Ray actors: their bundle's CPUs).
    `ray_address`: the Ray cluster (None: a local Ray). `replicas`: independent copies of a stage in workers of
    its own, run-wide or per node as `placement` ("video=2"), each new request routed to the least loaded.
    """

    placement: Any = None
    replicas: Any = None
    max_restarts: int = 1
    worker_threads: int | str | None = None
    ray_address: str | None = None

    @classmethod
    def pop(cls, config: dict[str, Any]) -> RunSettings:
        """Take the run settings out of a config mapping (what `Omni(pipeline, **config)` receives)."""
        found = {k: config.pop(k) for k in list(config) if k in RUN_KEYS}
        settings = cls(**{k: v for k, v in found.items() if v is not None})
        settings.check()
        return settings

    def check(self) -> None:
        if not isinstance(self.max_restarts, int) or isinstance(self.max_restarts, bool) or self.max_restarts < 0:
            raise InvalidParameter("max_restarts", f"{self.max_restarts!r} is not an integer >= 0")
        if (threads := self.worker_threads) not in (None, "shared") and not (type(threads) is int and threads >= 1):
            raise InvalidParameter("worker_threads", f"{threads!r} is not an integer >= 1 or 'shared'")
        parse_placement(self.placement)
        parse_replicas(self.replicas)

    def placement_of(self, node) -> str:
        run_wide, nodes = parse_placement(self.placement)
        return nodes.get(node.id) or run_wide or node.placement or "inproc"

    def replicas_of(self, node) -> int:
        run_wide, nodes = parse_replicas(self.replicas)
        return nodes.get(node.id) or run_wide or 1


def parse_placement(value: Any) -> tuple[str | None, dict[str, str]]:
    """(run-wide mode, {node id: mode}) of a placement setting: "process", "video=process,bridge=inproc",
    "process,video=ray", or a mapping of node id to mode."""
    return per_node("placement", value, "MODE", lambda mode: mode in PLACEMENTS and mode,
                    f"one of {', '.join(PLACEMENTS)}")


def parse_replicas(value: Any) -> tuple[int | None, dict[str, int]]:
    """(run-wide count, {node id: count}) of a replicas setting: 2, "video=2", "1,video=2", or a mapping."""
    return per_node("replicas", value, "N", lambda n: n.isdigit() and int(n) >= 1 and int(n), "an integer >= 1")


def per_node(name: str, value: Any, what: str, convert, expected: str) -> tuple[Any, dict[str, Any]]:
    """A run setting given run-wide, per node (NODE=VALUE pairs, comma-separated) or as a mapping of node id to
    value; `convert` turns a value's text into the setting (false where it is not `expected`)."""
    if value is None or value == "":
        return None, {}
    if isinstance(value, Mapping):
        items = [(str(k), str(v)) for k, v in value.items()]
    elif isinstance(value, (str, int)) and not isinstance(value, bool):
        parts = [p.partition("=") for p in str(value).split(",") if p.strip()]
        items = [(key.strip(), v.strip()) if sep else ("", key.strip()) for key, sep, v in parts]
    else:
        raise InvalidParameter(name, f"{value!r} is not {expected} or NODE={what} pairs")
    run_wide, nodes = None, {}
    for key, text in items:
        if not (converted := convert(text)):
            raise InvalidParameter(name, f"{text!r} is not {expected}")
        nodes[key] = converted
    return nodes.pop("", run_wide), nodes


def check_placement_nodes(settings: RunSettings, plan, provided: Mapping[str, Any] | None = None) -> None:
    """The per-node entries name nodes of the plan; every placement used is one an installed plugin provides."""
    ids = [n.id for n in plan.nodes]
    for name, (_, nodes) in (("placement", parse_placement(settings.placement)),
                             ("replicas", parse_replicas(settings.replicas))):
        if unknown := sorted(set(nodes) - set(ids)):
            raise InvalidParameter(name, f"pipeline {plan.name!r} has no node {unknown[0]!r}; its nodes: "
                                         f"{', '.join(ids)}")
    for node in plan.nodes:
        if node.placement is not None and node.placement not in PLACEMENTS:
            raise PluginError(f"node {node.id!r} of pipeline {plan.name!r} has placement {node.placement!r}; "
                              f"expected one of {', '.join(PLACEMENTS)}")
        if settings.replicas_of(node) > 1 and settings.placement_of(node) == "inproc":
            raise InvalidParameter("replicas", f"node {node.id!r} runs inproc; replicas need placement process or ray")
    provided = PLACEMENTS if provided is None else provided
    for mode in sorted({settings.placement_of(n) for n in plan.nodes} - {"inproc"} - set(provided)):
        plugin = PROVIDERS.get(mode, mode)
        raise UserError(f"placement {mode!r} needs the {plugin} plugin (pip install {plugin}; check `omni plugins` "
                        "and OMNI_PLUGINS if installed)")
