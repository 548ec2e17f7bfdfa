"""`omni run` flags from what node types declare: each `option(..., flag=...)` of a config or params class
becomes one flag; node types that declare the same field with the same type share it (e.g. `--seed`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from omni_kernel.core.errors import InvalidParameter, UserError
from omni_kernel.core.graph import PipelinePlan
from omni_kernel.core.params import OptionInfo, options_of, parse
from omni_kernel.core.registry import Registry

log = logging.getLogger("omni")
Where = Literal["config", "params"]


@attrs.frozen
class Flag:
    flag: str
    where: Where
    name: str
    info: OptionInfo
    plugins: tuple[str, ...]

    @property
    def dest(self) -> str:
        return f"{self.where}__{self.name}"


def collect(registry: Registry) -> list[Flag]:
    """Every flag the registered node types declare, in registration order."""
    flags: dict[str, Flag] = {}
    for registered in registry.node_types.values():
        node_type = registered.item
        for where in ("config", "params"):
            for name, info in options_of(getattr(node_type, where)).items():
                if info.flag is None:
                    continue
                known = flags.get(info.flag)
                if known is None:
                    flags[info.flag] = Flag(info.flag, where, name, info, (registered.plugin,))
                elif (known.where, known.name, known.info.type) == (where, name, info.type):
                    if registered.plugin not in known.plugins:
                        flags[info.flag] = attrs.evolve(known, plugins=known.plugins + (registered.plugin,))
                else:
                    log.warning("plugin %s declares %s for %s %s, already taken by %s; ignored", registered.plugin,
                                info.flag, where, name, ", ".join(known.plugins))
    return list(flags.values())


def declared(registry: Registry, plan: PipelinePlan, where: Where) -> dict[str, OptionInfo]:
    """The options of `where` that the plan's node types declare, by name."""
    found: dict[str, OptionInfo] = {}
    for node_type in registry.node_types_of(plan).values():
        found.update(options_of(getattr(node_type, where)))
    return found


def values(registry: Registry, plan: PipelinePlan, given: Mapping[Flag, Any], pairs: Mapping[Where, tuple[str, ...]]
           ) -> dict[Where, dict[str, Any]]:
    """Config and params values from flags plus `key=value` pairs; a flag the plan does not use is refused."""
    out: dict[Where, dict[str, Any]] = {"config": {}, "params": {}}
    unused = [f.flag for f, v in given.items() if f.name not in declared(registry, plan, f.where)]
    if unused:
        raise UserError(f"pipeline {plan.name!r} does not use {', '.join(unused)}")
    for flag, value in given.items():
        out[flag.where][flag.name] = value
    for where, items in pairs.items():
        known = declared(registry, plan, where)
        for item in items:
            key, sep, text = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or not key:
                raise InvalidParameter("-o/-c", f"{item!r} is not key=value")
            info = known.get(key)
            value = text if info is None else parse(key, info, text)  # unknown keys are refused by name later
            if info is not None and info.multiple:
                value = (*out[where].get(key, ()), value)
            out[where][key] = value
    return out
