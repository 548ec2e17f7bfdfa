"""Run settings: where each stage runs (`placement`) and how its workers behave (docs/distributed.md).

The kernel builds `inproc` stages itself; any other placement is built by the plugin that registered it
(`omni_register_placements`; `process` and `ray` come with the omni-workers plugin).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .errors import InvalidParameter, PluginError, UserError

PLACEMENTS = ("inproc", "process", "ray")
PROVIDERS = {"process": "omni-workers", "ray": "omni-workers"}  # for the "install X" message
RUN_KEYS = frozenset({"placement", "max_restarts", "worker_threads", "ray_address"})


@attrs.frozen
class RunSettings:
    """Kernel-level settings of one run (not a node type's config): where each stage runs and how workers behave.

    `placement`: None (each node's plan placement, else inproc), one mode for every node, or per node
    ("video=process,bridge=inproc" or a mapping); a per-node entry wins over the run-wide mode, which wins over
    the plan's `NodeSpec.placement`. `max_restarts`: restarts of a worker that died. `worker_threads`: torch /
    OpenMP threads in each worker (None: the library default), or "shared": the worker processes of one front
    lend their cores to each other, so the only busy one uses all of them (Ray actors: their bundle's CPUs).
    `ray_address`: the Ray cluster (None: a local Ray).
    """

    placement: Any = None
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
        threads = self.worker_threads
        if threads is not None and threads != "shared" and (not isinstance(threads, int) or isinstance(threads, bool)
                                                            or threads < 1):
            raise InvalidParameter("worker_threads", f"{threads!r} is not an integer >= 1 or 'shared'")
        parse_placement(self.placement)

    def placement_of(self, node) -> str:
        run_wide, per_node = parse_placement(self.placement)
        return per_node.get(node.id) or run_wide or node.placement or "inproc"


def parse_placement(value: Any) -> tuple[str | None, dict[str, str]]:
    """(run-wide mode, {node id: mode}) of a placement setting: "process", "video=process,bridge=inproc",
    "process,video=ray", or a mapping of node id to mode."""
    if value is None or value == "":
        return None, {}
    if isinstance(value, Mapping):
        items = [(str(k), str(v)) for k, v in value.items()]
    elif isinstance(value, str):
        items = []
        for part in (p.strip() for p in value.split(",")):
            if part:
                key, sep, mode = part.partition("=")
                items.append((key.strip(), mode.strip()) if sep else ("", key.strip()))
    else:
        raise InvalidParameter("placement", f"{value!r} is not a placement (one of {', '.join(PLACEMENTS)}, or "
                                            "NODE=MODE pairs)")
    run_wide, per_node = None, {}
    for key, mode in items:
        if mode not in PLACEMENTS:
            raise InvalidParameter("placement", f"{mode!r} is not one of {', '.join(PLACEMENTS)}")
        if key:
            per_node[key] = mode
        else:
            run_wide = mode
    return run_wide, per_node


def check_placement_nodes(settings: RunSettings, plan, provided: Mapping[str, Any] | None = None) -> None:
    """The per-node entries name nodes of the plan; every placement used is one an installed plugin provides."""
    _, per_node = parse_placement(settings.placement)
    ids = [n.id for n in plan.nodes]
    if unknown := sorted(set(per_node) - set(ids)):
        raise InvalidParameter("placement", f"pipeline {plan.name!r} has no node {unknown[0]!r}; its nodes: "
                                            f"{', '.join(ids)}")
    for node in plan.nodes:
        if node.placement is not None and node.placement not in PLACEMENTS:
            raise PluginError(f"node {node.id!r} of pipeline {plan.name!r} has placement {node.placement!r}; "
                              f"expected one of {', '.join(PLACEMENTS)}")
    provided = PLACEMENTS if provided is None else provided
    for mode in sorted({settings.placement_of(n) for n in plan.nodes} - {"inproc"} - set(provided)):
        plugin = PROVIDERS.get(mode, mode)
        raise UserError(f"placement {mode!r} needs the {plugin} plugin (pip install {plugin}; check `omni plugins` "
                        "and OMNI_PLUGINS if installed)")
