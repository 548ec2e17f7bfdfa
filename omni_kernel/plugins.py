"""Plugin loading: pluggy hooks, entry points in the `omni_kernel` group, an allowlist in OMNI_PLUGINS."""

from __future__ import annotations

import importlib.metadata
import logging
import os
from typing import Any

import attrs
import pluggy

from . import hookspecs
from .errors import PluginError
from .registry import Registry

ENTRY_POINT_GROUP = "omni_kernel"
ALLOWLIST_ENV = "OMNI_PLUGINS"
HOOKS = {
    "omni_register_node_types": Registry.add_node_type,
    "omni_register_connectors": Registry.add_connector,
    "omni_register_pipelines": Registry.add_pipeline,
    "omni_register_commands": Registry.add_command,
}

log = logging.getLogger("omni")


@attrs.frozen
class PluginInfo:
    name: str
    version: str
    status: str  # loaded | failed | skipped
    error: str | None = None


class PluginHost:
    def __init__(self):
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.registry = Registry()
        self.plugins: list[PluginInfo] = []

    def register(self, plugin: Any, name: str, version: str = "unknown") -> None:
        """Register a plugin object and everything its hooks register; all or nothing."""
        self.pm.register(plugin, name=name)
        try:
            pending = []
            for hook_name in HOOKS:
                for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                    if impl.plugin_name == name:
                        impl.function(register=lambda item, h=hook_name: pending.append((h, item)))
            staged = attrs.evolve(self.registry, node_types=dict(self.registry.node_types),
                                  connectors=dict(self.registry.connectors), pipelines=dict(self.registry.pipelines),
                                  commands=dict(self.registry.commands))
            for hook_name, item in pending:
                HOOKS[hook_name](staged, item, name)
        except BaseException:
            self.pm.unregister(name=name)
            raise
        self.registry = staged
        self.plugins.append(PluginInfo(name, version, "loaded"))

    def load_entry_points(self, allowlist: str | None = None) -> None:
        """Load every installed plugin; one that fails is reported by name and version and skipped."""
        allow = allowlist if allowlist is not None else os.environ.get(ALLOWLIST_ENV)
        allowed = {n.strip() for n in allow.split(",") if n.strip()} if allow else None
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            version = getattr(ep.dist, "version", None) or "unknown"
            if allowed is not None and ep.name not in allowed:
                self.plugins.append(PluginInfo(ep.name, version, "skipped", f"not in {ALLOWLIST_ENV}"))
                continue
            try:
                obj = ep.load()
                self.register(obj() if isinstance(obj, type) else obj, ep.name, version)
            except Exception as exc:  # noqa: BLE001 - one broken plugin must not break the others
                error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, PluginError) else str(exc)
                log.warning("plugin %s %s failed to load and was skipped: %s", ep.name, version, error)
                self.plugins.append(PluginInfo(ep.name, version, "failed", error))


def load_host(allowlist: str | None = None) -> PluginHost:
    """A host with the kernel's own plugin and every installed plugin loaded."""
    from .identity import KernelPlugin

    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel", _version("omni-kernel"))
    host.load_entry_points(allowlist)
    return host


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
